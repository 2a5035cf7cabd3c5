// What of the CUDA attention kernels is host arithmetic, checked in every build (no GPU, no
// emulator): the index arithmetic of kernels/cuda/attention_tiles.h (the tile schedule against
// brute force over every pair, the document ranges against the CPU reference's, the walk bits,
// the shared-memory swizzle, the ldmatrix lane addresses and the mma fragment tables against the
// PTX ISA's), the unmasked tiles' per-lane code of kernels/cuda/attention_lane.h against the
// masked code, and the optional weight skip (every skipped tile's weights below ε; its stated
// bound on the output, in float64). The kernels themselves — CTAs, warps, ldmatrix, mma.sync,
// wgmma — run on one emulation, kernels/cuda/emu (tests/cuda/test_gated_attention_cuda.cpp
// under launch/test-emu.sh in CI, and on a GPU when one is lent).
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "kernels/base/half.h"
#include "kernels/cpu/retention_cpu.h"
#include "kernels/cuda/attention_lane.h"
#include "kernels/cuda/attention_tiles.h"
#include "kernels/retention.h"
#include "kernels/tensor.h"

using namespace retain::cuda::tiles;
namespace spans = retain::cuda::spans;

namespace {

std::vector<int32_t> random_docs(int64_t T, std::mt19937& rng, bool interleaved) {
  std::vector<int32_t> doc;
  if (interleaved) {
    std::uniform_int_distribution<int32_t> id(-1, 3);
    for (int64_t t = 0; t < T; ++t) doc.push_back(id(rng));
    return doc;
  }
  std::uniform_int_distribution<int64_t> len(1, std::max<int64_t>(1, T / 4));
  std::bernoulli_distribution pad(0.2);
  int32_t next = 0;
  while (static_cast<int64_t>(doc.size()) < T) {
    const int32_t value = pad(rng) ? -1 : next++;
    for (int64_t n = len(rng); n > 0 && static_cast<int64_t>(doc.size()) < T; --n) doc.push_back(value);
  }
  return doc;
}

std::vector<DocRange> ranges_of(const std::vector<int32_t>& doc) {
  const int64_t T = static_cast<int64_t>(doc.size());
  std::vector<DocRange> r;
  for (int64_t b = 0; b < block_count(T); ++b) r.push_back(block_doc_range(doc.data(), T, b));
  return r;
}

// The span table the device builds from the ranges (kernels/cuda/block_spans.cu).
std::vector<spans::BlockSpan> spans_of(const std::vector<DocRange>& r) {
  return spans::host_block_spans(&r[0].lo, &r[0].hi, sizeof(DocRange) / sizeof(int32_t),
                                 static_cast<int32_t>(r.size()));
}

bool allowed_by_definition(const std::vector<int32_t>& doc, int64_t t, int64_t i) {
  return i <= t && doc[t] >= 0 && doc[i] == doc[t];
}

}  // namespace

TEST(AttentionTiles, BlockArithmetic) {
  EXPECT_EQ(block_count(1), 1);
  EXPECT_EQ(block_count(64), 1);
  EXPECT_EQ(block_count(65), 2);
  EXPECT_EQ(block_count(1000), 16);
  EXPECT_EQ(block_size(1000, 15), 1000 - 15 * 64);
  EXPECT_EQ(block_size(128, 1), 64);
  EXPECT_EQ(block_begin(3), 192);
}

// The kernels' ranges are the CPU reference's (kernels/cpu/retention_cpu.h), element by element.
TEST(AttentionTiles, DocRangesMatchTheCpuReference) {
  std::mt19937 rng(1);
  for (int64_t T : {1, 63, 64, 65, 200, 1000}) {
    for (bool interleaved : {false, true}) {
      const std::vector<int32_t> doc = random_docs(T, rng, interleaved);
      const std::vector<DocRange> got = ranges_of(doc);
      const std::vector<retain::cpu::DocRange> want = retain::cpu::block_doc_ranges(doc.data(), T);
      ASSERT_EQ(got.size(), want.size());
      for (size_t b = 0; b < got.size(); ++b) {
        if (want[b].empty()) {
          EXPECT_GT(got[b].lo, got[b].hi) << "block " << b;
          continue;
        }
        EXPECT_EQ(got[b].lo, want[b].lo) << "block " << b;
        EXPECT_EQ(got[b].hi, want[b].hi) << "block " << b;
        EXPECT_EQ(got[b].single != 0, want[b].single()) << "block " << b;
      }
    }
  }
}

// Every tile holding an allowed pair is visited by the query-side walk (forward, dq) and by the
// key-side walk (dk/dv) of every head of the group, in increasing order and once each; no tile
// above the diagonal or with disjoint document ranges is visited; tiles said to be all-allowed
// are, pair by pair; pair_allowed and decay match their definitions.
TEST(AttentionTiles, ScheduleVisitsExactlyTheTilesThatMatter) {
  std::mt19937 rng(2);
  for (int64_t T : {1, 63, 64, 65, 200, 1000}) {
    for (bool interleaved : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "T=" << T << " interleaved=" << interleaved);
      const std::vector<int32_t> doc = random_docs(T, rng, interleaved);
      const std::vector<DocRange> r = ranges_of(doc);
      const std::vector<spans::BlockSpan> sp = spans_of(r);
      const TileFilter exact = exact_tiles(r.data(), sp.data());
      const int64_t nb = block_count(T);
      // Brute force: which tiles hold an allowed pair.
      std::set<std::pair<int64_t, int64_t>> needed;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < T; ++i) {
          const int32_t doc_i = doc[static_cast<size_t>(i)];
          ASSERT_EQ(pair_allowed(t, i, doc[static_cast<size_t>(t)], doc_i), allowed_by_definition(doc, t, i));
          if (allowed_by_definition(doc, t, i)) needed.insert({t / kBlock, i / kBlock});
        }
      // Query-side walk.
      std::set<std::pair<int64_t, int64_t>> visited;
      for (int64_t qb = 0; qb < nb; ++qb) {
        int64_t prev = -1;
        for (int64_t kb = next_key_block(exact, qb, 0); kb <= qb;
             kb = next_key_block(exact, qb, kb + 1)) {
          EXPECT_GT(kb, prev);
          prev = kb;
          EXPECT_TRUE(ranges_meet(r[static_cast<size_t>(qb)], r[static_cast<size_t>(kb)]));
          visited.insert({qb, kb});
          if (tile_all_allowed(r.data(), qb, kb)) {
            for (int64_t t = block_begin(qb); t < block_begin(qb) + kBlock; ++t)
              for (int64_t i = block_begin(kb); i < block_begin(kb) + kBlock; ++i)
                ASSERT_TRUE(t < T && i < T && allowed_by_definition(doc, t, i)) << "t=" << t << " i=" << i;
          }
        }
      }
      for (const auto& tile : needed) EXPECT_TRUE(visited.count(tile)) << "tile " << tile.first << "," << tile.second;
      // Key-side walk over a GQA group of 3 heads (4..6): each head sees the transposed set.
      for (int64_t kb = 0; kb < nb; ++kb) {
        std::set<std::pair<int, int64_t>> walk;
        const int64_t first = next_query_block(exact, nb, kb, kb);
        const int h_begin = 4, h_end = 7;
        for (HeadBlock at{first < nb ? h_begin : h_end, first}; at.h < h_end;
             at = next_head_block(exact, nb, kb, first, at)) {
          ASSERT_GE(at.qb, kb);
          ASSERT_LT(at.qb, nb);
          EXPECT_TRUE(walk.insert({at.h, at.qb}).second) << "visited twice";
        }
        std::set<std::pair<int, int64_t>> want;
        for (const auto& [qb, k] : visited)
          if (k == kb)
            for (int h = h_begin; h < h_end; ++h) want.insert({h, qb});
        EXPECT_EQ(walk, want) << "key block " << kb;
      }
    }
  }
  EXPECT_EQ(decay(5, 5, -INFINITY), 0.0f);  // β⁰ = 1 even for β = 0
  EXPECT_EQ(decay(7, 5, -INFINITY), -INFINITY);
  EXPECT_EQ(decay(7, 5, -0.5f), -1.0f);
  EXPECT_EQ(decay((1 << 24) - 1, 0, 1.0f), static_cast<float>((1 << 24) - 1));  // exact below 2^24
}

// Each row's chunks are a permutation of that row's slots, and the 8 chunks an ldmatrix reads
// (same logical chunk, 8 consecutive rows) fall in 8 distinct bank groups.
// next_walk_bit finds the first set bit in [from, end) of random words, prev_walk_bit the last
// in [lo, from], across word edges.
TEST(AttentionTiles, NextWalkBitIsTheFirstSetBit) {
  std::mt19937 rng(4);
  for (int round = 0; round < 200; ++round) {
    uint32_t words[3];
    for (uint32_t& w : words) w = rng() & rng() & (round % 2 ? rng() : ~0u);  // sparse and dense
    for (int64_t from = 0; from <= 96; ++from)
      for (int64_t end = from; end <= 96; ++end) {
        int64_t want = end;
        for (int64_t b = from; b < end; ++b)
          if ((words[b / 32] >> (b % 32)) & 1u) {
            want = b;
            break;
          }
        ASSERT_EQ(next_walk_bit(words, from, end), want) << "from " << from << " end " << end;
      }
    for (int64_t lo = 0; lo <= 95; ++lo)  // prev_walk_bit: the last set bit in [lo, from]
      for (int64_t from = lo - 1; from <= 95; ++from) {
        int64_t want = lo - 1;
        for (int64_t b = from; b >= lo; --b)
          if ((words[b / 32] >> (b % 32)) & 1u) {
            want = b;
            break;
          }
        ASSERT_EQ(prev_walk_bit(words, from, lo), want) << "from " << from << " lo " << lo;
      }
  }
}

// What fill_walk (gated_attention.cu) writes: whole words w ∈ [lo/32, ⌈hi/32⌉), bit b set when
// b ∈ [lo, hi) and bits(b) says so; other words keep whatever they held.
template <typename Bits>
void fill_walk_like_the_kernel(std::vector<uint32_t>& visit, std::vector<uint32_t>& full, WalkRange r, Bits bits) {
  for (int64_t w = r.lo / 32; 32 * w < r.hi; ++w) {
    uint32_t v = 0, a = 0;
    for (int lane = 0; lane < 32; ++lane) {
      const int64_t b = 32 * w + lane;
      if (b < r.lo || b >= r.hi) continue;
      const WalkBits x = bits(b);
      v |= uint32_t{x.visit} << lane;
      a |= uint32_t{x.full} << lane;
    }
    visit[static_cast<size_t>(w)] = v;
    full[static_cast<size_t>(w)] = a;
  }
}

// The walks the kernels take on their shared-memory bits visit the same tiles in the same
// order as the filter's own walks (next_key_block, next_head_block), exact and with the weight
// skip, and the full bits are tile_all_allowed; words outside the filled range (garbage here)
// are never read.
TEST(AttentionTiles, WalkBitsWalkLikeTheFilter) {
  std::mt19937 rng(5);
  for (int64_t T : {1, 64, 65, 2000, 4100, 9000}) {
    for (bool interleaved : {false, true}) {
      const std::vector<int32_t> doc = random_docs(T, rng, interleaved);
      const std::vector<DocRange> r = ranges_of(doc);
      const std::vector<spans::BlockSpan> sp = spans_of(r);
      const int64_t nb = block_count(T);
      std::vector<float> lbmax(static_cast<size_t>(nb));
      std::uniform_real_distribution<float> lb(-0.05f, 0.0f);
      for (float& x : lbmax) x = lb(rng);
      for (bool skip : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "T=" << T << " interleaved=" << interleaved << " skip=" << skip);
        const TileFilter f = skip ? TileFilter{r.data(), sp.data(), lbmax.data(), 1, std::log(1e-3f)}
                                  : exact_tiles(r.data(), sp.data());
        const size_t words = static_cast<size_t>(walk_words(nb));
        int64_t skipped = 0;
        for (int64_t qb = 0; qb < nb; ++qb) {  // forward, dq
          std::vector<uint32_t> visit(words), full(words);
          for (size_t w = 0; w < words; ++w) visit[w] = rng(), full[w] = rng();
          const WalkRange walk = key_walk_range(f, qb);
          fill_walk_like_the_kernel(visit, full, walk, [&](int64_t kb) { return walk_bits(f, qb, kb); });
          int64_t want = next_key_block(f, qb, 0);
          std::vector<int64_t> forward_order;
          for (int64_t kb = next_walk_bit(visit.data(), walk.lo, walk.hi); kb < walk.hi;
               kb = next_walk_bit(visit.data(), kb + 1, walk.hi)) {
            ASSERT_EQ(kb, want) << "query block " << qb;
            ASSERT_EQ(walk_bit(full.data(), kb), tile_all_allowed(r.data(), qb, kb));
            want = next_key_block(f, qb, kb + 1);
            forward_order.push_back(kb);
          }
          ASSERT_GT(want, qb) << "query block " << qb << ": the bits ended early";
          std::vector<int64_t> backward_order;  // the forward kernel's order: diagonal first
          for (int64_t kb = prev_walk_bit(visit.data(), walk.hi - 1, walk.lo); kb >= walk.lo;
               kb = prev_walk_bit(visit.data(), kb - 1, walk.lo))
            backward_order.push_back(kb);
          ASSERT_EQ(backward_order, std::vector<int64_t>(forward_order.rbegin(), forward_order.rend()));
          for (int64_t kb = 0; kb <= qb; ++kb) skipped += tile_visited(r.data(), qb, kb) && !visits(f, qb, kb);
        }
        if (skip && T >= 4100) {
          EXPECT_GT(skipped, 0) << "the skip case skips nothing";
        }
        for (int64_t kb = 0; kb < nb; ++kb) {  // dk/dv, a GQA group of heads 2..4
          std::vector<uint32_t> visit(words), full(words);
          for (size_t w = 0; w < words; ++w) visit[w] = rng(), full[w] = rng();
          const WalkRange walk = query_walk_range(f, kb);
          fill_walk_like_the_kernel(visit, full, walk, [&](int64_t qb) { return walk_bits(f, qb, kb); });
          const int64_t first = next_walk_bit(visit.data(), walk.lo, walk.hi);
          const int64_t first_want = next_query_block(f, nb, kb, kb);
          ASSERT_EQ(first < walk.hi, first_want < nb);
          std::vector<std::pair<int, int64_t>> got, want;
          for (HeadBlock at{first < walk.hi ? 2 : 5, first}; at.h < 5;
               at = next_walk_head_block(visit.data(), walk, first, at)) {
            got.emplace_back(at.h, at.qb);
            ASSERT_EQ(walk_bit(full.data(), at.qb), tile_all_allowed(r.data(), at.qb, kb));
          }
          for (HeadBlock at{first_want < nb ? 2 : 5, first_want}; at.h < 5;
               at = next_head_block(f, nb, kb, first_want, at))
            want.emplace_back(at.h, at.qb);
          ASSERT_EQ(got, want) << "key block " << kb;
        }
      }
    }
  }
}

// A rectangle (context parallelism: a query span against a wholly earlier key span; documents
// crossing between them): the walks of both sides, on the filter and on the walk bits, visit
// every tile holding an allowed pair, in increasing order, once each, and only tiles whose
// ranges meet; all-allowed tiles are, pair by pair; pair_allowed on positions (a query's index +
// the gap, a key's index) is "same document, not padding": every key precedes every query.
TEST(AttentionTiles, RectanglesVisitExactlyTheTilesThatMatter) {
  std::mt19937 rng(9);
  struct Spans {
    int64_t T, k0, k1, q0, q1;
  };
  for (const Spans& c : {Spans{300, 0, 64, 64, 300}, Spans{400, 10, 75, 200, 263}, Spans{1000, 0, 1, 1, 1000},
                         Spans{2000, 100, 1100, 1100, 1999}, Spans{130, 0, 65, 129, 130}}) {
    for (bool interleaved : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "T=" << c.T << " keys [" << c.k0 << ", " << c.k1 << ") queries [" << c.q0
                                        << ", " << c.q1 << ") interleaved=" << interleaved);
      const std::vector<int32_t> doc = random_docs(c.T, rng, interleaved);
      const std::vector<int32_t> qd(doc.begin() + c.q0, doc.begin() + c.q1), kd(doc.begin() + c.k0, doc.begin() + c.k1);
      const std::vector<DocRange> qr = ranges_of(qd), kr = ranges_of(kd);
      const int64_t Tq = c.q1 - c.q0, Tk = c.k1 - c.k0, nqb = block_count(Tq), nkb = block_count(Tk), gap = c.q0 - c.k0;
      const TileFilter f = rect_tiles(qr.data(), nqb, kr.data(), nkb);
      ASSERT_TRUE(is_rect(f));
      std::set<std::pair<int64_t, int64_t>> needed;
      for (int64_t a = 0; a < Tq; ++a)
        for (int64_t b = 0; b < Tk; ++b) {
          const bool want = allowed_by_definition(doc, c.q0 + a, c.k0 + b);
          ASSERT_EQ(pair_allowed(a + gap, b, qd[static_cast<size_t>(a)], kd[static_cast<size_t>(b)]), want);
          ASSERT_EQ(decay(a + gap, b, -0.5f), static_cast<float>(c.q0 + a - c.k0 - b) * -0.5f);
          if (want) needed.insert({a / kBlock, b / kBlock});
        }
      const auto all_pairs_allowed = [&](int64_t qb, int64_t kb) {
        for (int64_t a = block_begin(qb); a < block_begin(qb) + kBlock; ++a)
          for (int64_t b = block_begin(kb); b < block_begin(kb) + kBlock; ++b)
            if (!(a < Tq && b < Tk && allowed_by_definition(doc, c.q0 + a, c.k0 + b))) return false;
        return true;
      };
      std::set<std::pair<int64_t, int64_t>> visited;
      const size_t words = static_cast<size_t>(walk_words(std::max(nqb, nkb)));
      for (int64_t qb = 0; qb < nqb; ++qb) {  // forward, dq
        const WalkRange walk = key_walk_range(f, qb);
        ASSERT_EQ(walk.lo, 0);
        ASSERT_EQ(walk.hi, nkb);
        std::vector<uint32_t> visit(words), full(words);
        for (size_t w = 0; w < words; ++w) visit[w] = rng(), full[w] = rng();
        fill_walk_like_the_kernel(visit, full, walk, [&](int64_t kb) { return walk_bits(f, qb, kb); });
        int64_t want = next_key_block(f, qb, 0);
        for (int64_t kb = next_walk_bit(visit.data(), walk.lo, walk.hi); kb < walk.hi;
             kb = next_walk_bit(visit.data(), kb + 1, walk.hi)) {
          ASSERT_EQ(kb, want) << "query block " << qb;
          EXPECT_TRUE(ranges_meet(qr[static_cast<size_t>(qb)], kr[static_cast<size_t>(kb)]));
          ASSERT_EQ(walk_bit(full.data(), kb), all_allowed(f, qb, kb));
          if (all_allowed(f, qb, kb)) {
            ASSERT_TRUE(all_pairs_allowed(qb, kb)) << "tile " << qb << "," << kb;
          }
          visited.insert({qb, kb});
          want = next_key_block(f, qb, kb + 1);
        }
        ASSERT_EQ(want, nkb) << "query block " << qb << ": the bits ended early";
      }
      for (const auto& tile : needed) EXPECT_TRUE(visited.count(tile)) << "tile " << tile.first << "," << tile.second;
      for (int64_t kb = 0; kb < nkb; ++kb) {  // dk/dv, a GQA group of heads 2..4
        const WalkRange walk = query_walk_range(f, kb);
        ASSERT_EQ(walk.lo, 0);
        ASSERT_EQ(walk.hi, nqb);
        std::vector<uint32_t> visit(words), full(words);
        for (size_t w = 0; w < words; ++w) visit[w] = rng(), full[w] = rng();
        fill_walk_like_the_kernel(visit, full, walk, [&](int64_t qb) { return walk_bits(f, qb, kb); });
        const int64_t first = next_walk_bit(visit.data(), walk.lo, walk.hi);
        const int64_t first_want = next_query_block(f, nqb, kb, walk.lo);
        ASSERT_EQ(first < walk.hi ? first : nqb, first_want);
        std::vector<std::pair<int, int64_t>> got, want;
        for (HeadBlock at{first < walk.hi ? 2 : 5, first}; at.h < 5;
             at = next_walk_head_block(visit.data(), walk, first, at))
          got.emplace_back(at.h, at.qb);
        for (HeadBlock at{first_want < nqb ? 2 : 5, first_want}; at.h < 5;
             at = next_head_block(f, nqb, kb, first_want, at))
          want.emplace_back(at.h, at.qb);
        ASSERT_EQ(got, want) << "key block " << kb;
        std::vector<std::pair<int, int64_t>> from_visited;  // the transposed query-side set, per head
        for (int h = 2; h < 5; ++h)
          for (const auto& [qb, k] : visited)
            if (k == kb) from_visited.emplace_back(h, qb);
        ASSERT_EQ(got, from_visited) << "key block " << kb;
      }
    }
  }
}

// The end of a forward row: lse = ln(Σ weights) from the base-2 running max m and sum l; no
// mass (nothing allowed, or only β = 0 keys of an earlier span, whose clamped logits are
// ≤ −1e30) gives out 0 and lse −inf, as the CPU reference does.
TEST(AttentionTiles, FinishRowKeepsOnlyRowsWithMass) {
  float inv = -1, lse = 0;
  finish_row(2.0f, 3.0f, inv, lse);
  EXPECT_FLOAT_EQ(inv, 0.5f);
  EXPECT_FLOAT_EQ(lse, 4.0f * 0.6931471805599453f);
  finish_row(0.0f, -INFINITY, inv, lse);
  EXPECT_EQ(inv, 0.0f);
  EXPECT_EQ(lse, -INFINITY);
  // A key of β = 0 one token back: its logit is the clamped decay plus q·k.
  const float clamped = 1.0f * staged_lb2(-INFINITY) + 50.0f;
  finish_row(1.0f, clamped, inv, lse);
  EXPECT_EQ(inv, 0.0f);
  EXPECT_EQ(lse, -INFINITY);
  finish_row(1.0f, -1e4f, inv, lse);  // a tiny weight is still a weight
  EXPECT_FLOAT_EQ(lse, -1e4f * 0.6931471805599453f);
}

// LdsmLane's split address (four lane values + a constant) is the swizzled chunk of every
// row block r0 (a multiple of 8) and k-step, for both ldmatrix patterns and every lane.
template <int D>
void check_ldsm_lane() {
  for (int lane = 0; lane < 32; ++lane)
    for (int pattern = 0; pattern < 2; ++pattern) {
      const int row = pattern == 0 ? ldsm_a_row(lane) : ldsm_b_row(lane);
      const int chunk = pattern == 0 ? ldsm_a_chunk(lane) : ldsm_b_chunk(lane);
      const LdsmLane<D> l(row, chunk);
      for (int r0 = 0; r0 + 16 <= kBlock; r0 += 8)
        for (int k = 0; k < D / 16; ++k)
          ASSERT_EQ(l.at(r0, k), static_cast<uint32_t>(16 * swizzled_chunk(r0 + row, 2 * k + chunk, D / 8)))
              << "D " << D << " lane " << lane << " pattern " << pattern << " r0 " << r0 << " k " << k;
    }
}
TEST(AttentionTiles, LdsmLaneAddressesAreTheSwizzledChunks) {
  check_ldsm_lane<64>();
  check_ldsm_lane<128>();
}

TEST(AttentionTiles, SwizzleIsAConflictFreePermutation) {
  for (int chunks : {8, 16}) {
    for (int row = 0; row < kBlock; ++row) {
      std::set<int> slots;
      for (int c = 0; c < chunks; ++c) {
        const int s = swizzled_chunk(row, c, chunks);
        EXPECT_GE(s, row * chunks);
        EXPECT_LT(s, (row + 1) * chunks);
        slots.insert(s);
      }
      EXPECT_EQ(static_cast<int>(slots.size()), chunks);
    }
    for (int row0 = 0; row0 < kBlock; row0 += 8)
      for (int c = 0; c < chunks; ++c) {
        std::set<int> groups;  // 16-byte slot → bank group (slot mod 8 of a 128-byte line)
        for (int r = row0; r < row0 + 8; ++r) groups.insert(swizzled_chunk(r, c, chunks) % 8);
        EXPECT_EQ(groups.size(), 8u);
      }
  }
}

// The unmasked tiles' own code (two FMAs on float distances, attention_lane.h) against the
// masked code on the same all-allowed tiles, lane by lane and element by element, on decays
// that matter at these distances and −inf keys: the fused form must give the same logits,
// probabilities, dS and dlogβ up to float rounding (the kernels themselves run on the CUDA
// emulator against the CPU reference at bf16 tolerance, which an off-by-one distance would pass).
TEST(AttentionTiles, UnmaskedTileCodeEqualsTheMaskedCode) {
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  const float scale2 = 0.125f * kLog2e;
  auto close = [](float a, float b) { return std::abs(a - b) <= 2e-5f * std::max(1.0f, std::abs(b)); };
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t kb = trial % 5, qb = kb + 1 + trial % 7;  // below the diagonal
    const int64_t i0 = block_begin(kb), q0 = block_begin(qb);
    float lb2[kBlock], ncl[kBlock], lse2_q[kBlock], delta_q[kBlock];
    int32_t doc[kBlock];
    for (int c = 0; c < kBlock; ++c) {
      lb2[c] = staged_lb2(u(rng) < 0.1f ? -INFINITY : -0.05f * u(rng));
      ncl[c] = staged_neg_c_lb2(c, lb2[c]);
      doc[c] = 3;
      lse2_q[c] = normal(rng);
      delta_q[c] = normal(rng);
    }
    for (int lane = 0; lane < 32; ++lane) {
      const int64_t t[2] = {q0 + c_row(lane, 0) + 16 * (trial % 4), q0 + c_row(lane, 2) + 16 * (trial % 4)};
      const int32_t doc_t[2] = {3, 3};
      const float lse2[2] = {normal(rng), normal(rng)}, delta[2] = {normal(rng), normal(rng)};
      float s[8][4], dp[8][4];
      for (auto& f : s)
        for (float& x : f) x = normal(rng);
      for (auto& f : dp)
        for (float& x : f) x = normal(rng);
      // Query rows: logits and dS.
      float a[8][4], b[8][4];
      std::memcpy(a, s, sizeof s), std::memcpy(b, s, sizeof s);
      query_row_logits(a, lane, t, doc_t, i0, lb2, ncl, doc, true, scale2);
      query_row_logits(b, lane, t, doc_t, i0, lb2, ncl, doc, false, scale2);
      for (int nt = 0; nt < 8; ++nt)
        for (int e = 0; e < 4; ++e) ASSERT_TRUE(close(a[nt][e], b[nt][e])) << a[nt][e] << " vs " << b[nt][e];
      std::memcpy(a, s, sizeof s), std::memcpy(b, s, sizeof s);
      query_row_dscores(a, dp, lane, t, doc_t, i0, lb2, ncl, doc, true, scale2, lse2, delta);
      query_row_dscores(b, dp, lane, t, doc_t, i0, lb2, ncl, doc, false, scale2, lse2, delta);
      for (int nt = 0; nt < 8; ++nt)
        for (int e = 0; e < 4; ++e) ASSERT_TRUE(close(a[nt][e], b[nt][e])) << a[nt][e] << " vs " << b[nt][e];
      // Key rows (the dk/dv kernel: keys of block kb, queries of block qb, sub-tiles of 16).
      const int64_t i[2] = {i0 + c_row(lane, 0) + 16 * (trial % 4), i0 + c_row(lane, 2) + 16 * (trial % 4)};
      const float lb2_i[2] = {lb2[i[0] - i0], lb2[i[1] - i0]};
      for (int col0 = 0; col0 < kBlock; col0 += 16) {
        float sa[2][4], sb[2][4], da[2][4], db[2][4], dla[2] = {0.5f, -0.25f}, dlb[2] = {0.5f, -0.25f};
        std::memcpy(sa, s, sizeof sa), std::memcpy(sb, s, sizeof sb);
        std::memcpy(da, dp, sizeof da), std::memcpy(db, dp, sizeof db);
        key_row_grads(sa, da, lane, i, doc_t, lb2_i, q0, col0, lse2_q, delta_q, doc, true, scale2, dla);
        key_row_grads(sb, db, lane, i, doc_t, lb2_i, q0, col0, lse2_q, delta_q, doc, false, scale2, dlb);
        for (int nt = 0; nt < 2; ++nt)
          for (int e = 0; e < 4; ++e) {
            ASSERT_TRUE(close(sa[nt][e], sb[nt][e])) << "P " << sa[nt][e] << " vs " << sb[nt][e];
            ASSERT_TRUE(close(da[nt][e], db[nt][e])) << "dS " << da[nt][e] << " vs " << db[nt][e];
          }
        // dlogβ sums (t − i)·dS terms of either sign: float rounding relative to Σ|terms|.
        double mass[2] = {1.0, 1.0};
        for (int nt = 0; nt < 2; ++nt)
          for (int e = 0; e < 4; ++e)
            mass[e / 2] += std::abs(static_cast<double>(q0 + col0 + 8 * nt + c_col(lane, e) - i[e / 2]) * db[nt][e]);
        for (int x = 0; x < 2; ++x)
          ASSERT_LE(std::abs(dla[x] - dlb[x]), 1e-6 * mass[x]) << "dlogβ " << dla[x] << " vs " << dlb[x];
      }
    }
  }
}

// The attention_tiles.h fragment tables agree with the PTX ISA's mma.m16n8k16 tables, written out
// here (groupID g = l >> 2, threadID_in_group q = l % 4): a0 (g, 2q..2q+1), a1 (g+8, 2q..),
// a2 (g, 2q+8..), a3 (g+8, 2q+8..); b0 (2q..2q+1, g), b1 (2q+8.., g); c0,c1 (g, 2q..2q+1),
// c2,c3 (g+8, 2q..2q+1).
TEST(AttentionTiles, FragmentTablesMatchThePtxIsa) {
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, q = l % 4;
    for (int e = 0; e < 4; ++e) {
      EXPECT_EQ(c_row(l, e), g + 8 * (e / 2));
      EXPECT_EQ(c_col(l, e), 2 * q + e % 2);
    }
    const int arow[4] = {g, g + 8, g, g + 8}, acol[4] = {2 * q, 2 * q, 2 * q + 8, 2 * q + 8};
    for (int j = 0; j < 4; ++j)
      for (int h = 0; h < 2; ++h) {
        EXPECT_EQ(a_row(l, j), arow[j]);
        EXPECT_EQ(a_col(l, j, h), acol[j] + h);
      }
    for (int j = 0; j < 2; ++j)
      for (int h = 0; h < 2; ++h) EXPECT_EQ(b_row(l, j, h), 2 * q + 8 * j + h);
    EXPECT_EQ(b_col(l), g);
  }
}

// Every tile the weight skip calls negligible has all its pair weights exp((t − i)·logβ_i)
// below ε (brute force over the pairs), the diagonal tile never is, and per-block maxima match
// their definition.
TEST(AttentionTiles, NegligibleTilesHaveOnlyWeightsBelowEpsilon) {
  std::mt19937 rng(5);
  const int64_t T = 700, K = 2;
  std::vector<int32_t> doc = random_docs(T, rng, false);
  std::vector<float> lb(static_cast<size_t>(T * K));
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (float& x : lb) x = u(rng) < 0.05f ? -INFINITY : -0.2f * u(rng);
  const int64_t nb = block_count(T);
  int negligible = 0;
  for (const float eps : {1e-1f, 1e-3f, 1e-6f})
    for (int64_t kv = 0; kv < K; ++kv)
      for (int64_t kb = 0; kb < nb; ++kb) {
        const float mx = block_max_log_beta(lb.data(), doc.data(), T, K, kb, kv);
        float want = -INFINITY;
        for (int64_t i = block_begin(kb); i < block_begin(kb) + block_size(T, kb); ++i)
          if (doc[static_cast<size_t>(i)] >= 0) want = std::fmax(want, lb[static_cast<size_t>(i * K + kv)]);
        ASSERT_EQ(mx, want);
        for (int64_t qb = kb; qb < nb; ++qb) {
          if (!tile_negligible(mx, qb, kb, std::log(eps))) continue;
          ASSERT_LT(kb, qb);
          ++negligible;
          for (int64_t t = block_begin(qb); t < block_begin(qb) + block_size(T, qb); ++t)
            for (int64_t i = block_begin(kb); i < block_begin(kb) + block_size(T, kb); ++i) {
              if (doc[static_cast<size_t>(i)] < 0) continue;
              ASSERT_LT(std::exp(static_cast<double>(t - i) * lb[static_cast<size_t>(i * K + kv)]), eps);
            }
        }
      }
  EXPECT_GT(negligible, 100);  // the check is not vacuous
}

// The stated bounds of the weight skip (attention_tiles.h), in float64 on the attention the
// skip leaves: per row t, the allowed keys of the tiles the kernels' own filter drops
// (visits(), with the block maxima of block_max_log_beta) are S_t; with a_ti = q_t·k_i·scale,
// a priori δ_t ≤ ε·Σ_{i∈S_t} exp(a_ti − a_tt) (checked where below 1); a posteriori, with the
// skipping attention's own l̂se, δ_t/(1 − δ_t) ≤ r_t = ε·Σ_{i∈S_t} exp(a_ti − l̂se_t); then
// ‖o_t − ô_t‖ ≤ 2·δ_t·max‖v‖ and |lse_t − l̂se_t| = log(1 + δ_t/(1 − δ_t)) ≤ log(1 + r_t). That
// the kernels drop exactly these tiles, and agree with the CPU reference otherwise, is
// GatedAttentionCuda.WeightSkipKeepsNegligibleErrors (on the CUDA emulator in CI, a GPU when
// lent): one emulation of the kernels, not two. The skip must have dropped tiles and changed
// some output by more than the float64 slack (not vacuous).
TEST(AttentionTiles, WeightSkipStaysWithinItsBound) {
  std::mt19937 rng(6);
  const int64_t T = 600, H = 2, K = 1, d = 64;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<double> q(static_cast<size_t>(T * H * d)), k(static_cast<size_t>(T * K * d)), v(k.size());
  for (double& x : q) x = normal(rng);
  for (double& x : k) x = normal(rng);
  for (double& x : v) x = normal(rng);
  std::vector<float> lb;
  for (int64_t x = 0; x < T * K; ++x) lb.push_back(-0.03f - 0.05f * u(rng));
  std::vector<int32_t> doc(static_cast<size_t>(T), 0);
  for (int64_t t = 400; t < T; ++t) doc[static_cast<size_t>(t)] = t < 410 ? -1 : 1;  // two documents + padding
  const std::vector<DocRange> ranges = ranges_of(doc);
  const std::vector<spans::BlockSpan> spans_table = spans_of(ranges);
  const int64_t nb = block_count(T);
  std::vector<float> lbmax;
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t kv = 0; kv < K; ++kv) lbmax.push_back(block_max_log_beta(lb.data(), doc.data(), T, K, b, kv));
  double vmax = 0;
  for (int64_t i = 0; i < T; ++i) {
    double n2 = 0;
    for (int64_t j = 0; j < d; ++j) n2 += v[static_cast<size_t>(i * d + j)] * v[static_cast<size_t>(i * d + j)];
    vmax = std::max(vmax, std::sqrt(n2));
  }
  for (const float eps : {0.02f, 1e-3f}) {
    SCOPED_TRACE(::testing::Message() << "eps=" << eps);
    const TileFilter filter{ranges.data(), spans_table.data(), lbmax.data(), K, std::log(eps)};
    int skipped_tiles = 0;
    for (int64_t qb = 0; qb < nb; ++qb)
      for (int64_t kb = 0; kb <= qb; ++kb) skipped_tiles += tile_visited(ranges.data(), qb, kb) && !visits(filter, qb, kb);
    double largest_change = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (doc[static_cast<size_t>(t)] < 0) continue;
      for (int64_t h = 0; h < H; ++h) {
        const size_t row = static_cast<size_t>(t * H + h);
        auto a = [&](int64_t i) {
          double dot = 0;
          for (int64_t j = 0; j < d; ++j) dot += q[row * d + static_cast<size_t>(j)] * k[static_cast<size_t>(i * d + j)];
          return dot * scale;
        };
        // The gated logits of the allowed keys, split into those the filter keeps and drops.
        std::vector<double> full_logit, kept_logit;
        std::vector<int64_t> full_key, kept_key;
        for (int64_t i = 0; i <= t; ++i) {
          if (doc[static_cast<size_t>(i)] != doc[static_cast<size_t>(t)]) continue;
          const double x = a(i) + static_cast<double>(t - i) * lb[static_cast<size_t>(i)];
          full_logit.push_back(x), full_key.push_back(i);
          if (visits(filter, t / kBlock, i / kBlock)) kept_logit.push_back(x), kept_key.push_back(i);
        }
        auto attend = [&](const std::vector<double>& logit, const std::vector<int64_t>& key, std::vector<double>& o) {
          const double m = *std::max_element(logit.begin(), logit.end());
          double z = 0;
          o.assign(static_cast<size_t>(d), 0.0);
          for (size_t x = 0; x < logit.size(); ++x) {
            const double w = std::exp(logit[x] - m);
            z += w;
            for (int64_t j = 0; j < d; ++j) o[static_cast<size_t>(j)] += w * v[static_cast<size_t>(key[x] * d + j)];
          }
          for (double& y : o) y /= z;
          return m + std::log(z);
        };
        std::vector<double> o, o_hat;
        const double lse = attend(full_logit, full_key, o), lse_hat = attend(kept_logit, kept_key, o_hat);
        const double a_tt = a(t);
        double prior = 0, r = 0;
        for (int64_t i : full_key)
          if (!visits(filter, t / kBlock, i / kBlock)) {
            prior += std::exp(a(i) - a_tt);
            r += std::exp(a(i) - lse_hat);
          }
        prior *= eps;
        r *= eps;
        const double delta = r / (1 + r);
        double diff2 = 0;
        for (int64_t j = 0; j < d; ++j) diff2 += (o[static_cast<size_t>(j)] - o_hat[static_cast<size_t>(j)]) *
                                                 (o[static_cast<size_t>(j)] - o_hat[static_cast<size_t>(j)]);
        const double diff = std::sqrt(diff2);
        largest_change = std::max(largest_change, diff);
        EXPECT_LE(diff, 2 * delta * vmax + 1e-12) << "t=" << t << " h=" << h;
        if (prior < 1) {
          EXPECT_LE(diff, 2 * prior * vmax + 1e-12) << "t=" << t << " h=" << h;
        }
        EXPECT_LE(std::abs(lse - lse_hat), std::log1p(r) + 1e-12) << "t=" << t << " h=" << h;
      }
    }
    std::cout << "eps " << eps << ": " << skipped_tiles << " tiles skipped, largest output change " << largest_change
              << "\n";
    EXPECT_GT(skipped_tiles, 0);
    EXPECT_GT(largest_change, 1e-4);
  }
}
