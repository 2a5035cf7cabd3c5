// The CUDA attention kernels checked on the CPU in every build (no GPU needed):
// - the index arithmetic of kernels/cuda/attention_tiles.h: the tile schedule against brute
//   force over every pair, the document ranges against the CPU reference's, the shared-memory
//   swizzle, and the mma/ldmatrix fragment mapping, by emulating ldmatrix and mma.sync from the
//   PTX ISA's definitions and multiplying real matrices through them (Q·Kᵀ, then P·V with the
//   scores re-used as the A operand, and the transposed products of the backward);
// - the three kernels emulated CTA by CTA (their schedule, tiles and per-lane code of
//   kernels/cuda/attention_lane.h) against the CPU reference op at the GPU tests' tolerance;
// - the optional weight skip: every skipped tile's weights are below ε, and its stated bound
//   on the output holds.
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

namespace {

// ---- an emulated warp ---------------------------------------------------------------------
// Values are floats (exact small integers in the fragments, so sums are exact); a register
// holds two values (low, high) as the bf16x2 registers do.
using Reg = std::array<float, 2>;
using Lanes4 = std::array<std::array<Reg, 4>, 32>;  // x4 ldmatrix result / A fragment per lane

// A kBlock × d tile stored as the kernels store it.
struct SmemTile {
  int d;
  std::vector<float> data;
  SmemTile(int d_, const std::vector<float>& rowmajor) : d(d_), data(rowmajor.size()) {
    for (int r = 0; r < kBlock; ++r)
      for (int c = 0; c < d; ++c)
        data[static_cast<size_t>(swizzled_chunk(r, c / 8, d / 8) * 8 + c % 8)] =
            rowmajor[static_cast<size_t>(r * d + c)];
  }
  const float* chunk(int row, int chunk_index) const {
    return &data[static_cast<size_t>(swizzled_chunk(row, chunk_index, d / 8) * 8)];
  }
};

// ldmatrix.x4 per the PTX ISA: lanes 8m..8m+7 address the rows of matrix m; register m of
// lane l gets row l/4, elements 2(l%4), 2(l%4)+1 — or, transposed, column l/4 of rows
// 2(l%4), 2(l%4)+1.
Lanes4 ldmatrix(const std::array<const float*, 32>& row_addr, bool trans) {
  Lanes4 out{};
  for (int l = 0; l < 32; ++l)
    for (int m = 0; m < 4; ++m)
      for (int half = 0; half < 2; ++half)
        out[l][m][half] =
            trans ? row_addr[8 * m + 2 * (l % 4) + half][l / 4] : row_addr[8 * m + l / 4][2 * (l % 4) + half];
  return out;
}

// mma.sync.m16n8k16 per the PTX ISA fragment tables (written out here independently of
// attention_tiles.h: groupID = l >> 2, threadID_in_group = l % 4):
//   a0: (g, 2q..2q+1)  a1: (g+8, 2q..)  a2: (g, 2q+8..)  a3: (g+8, 2q+8..)
//   b0: (2q..2q+1, g)  b1: (2q+8.., g)
//   c0,c1: (g, 2q..2q+1)  c2,c3: (g+8, 2q..2q+1)
void mma(std::array<std::array<float, 4>, 32>& acc, const std::array<std::array<Reg, 4>, 32>& a,
         const std::array<std::array<Reg, 2>, 32>& b) {
  float A[16][16], Bm[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, q = l % 4;
    for (int h = 0; h < 2; ++h) {
      A[g][2 * q + h] = a[l][0][h];
      A[g + 8][2 * q + h] = a[l][1][h];
      A[g][2 * q + 8 + h] = a[l][2][h];
      A[g + 8][2 * q + 8 + h] = a[l][3][h];
      Bm[2 * q + h][g] = b[l][0][h];
      Bm[2 * q + 8 + h][g] = b[l][1][h];
    }
  }
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, q = l % 4;
    for (int e = 0; e < 4; ++e) {
      const int row = g + 8 * (e / 2), col = 2 * q + e % 2;
      float sum = 0;
      for (int k = 0; k < 16; ++k) sum += A[row][k] * Bm[k][col];
      acc[l][e] += sum;
    }
  }
}

std::vector<float> small_ints(size_t n, std::mt19937& rng) {
  std::uniform_int_distribution<int> u(-3, 3);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(u(rng));
  return v;
}

using Acc = std::vector<std::array<std::array<float, 4>, 32>>;  // [n-tile][lane][e]

// rows_times_rows_t of the kernels, emulated: acc[nt] += A(16 rows from a_row0) · B(rows of b
// from b_row0 as columns), A by pattern_a ldmatrix, B by pattern_b ldmatrix.
void rows_times_rows_t(Acc& acc, const SmemTile& a, int a_row0, const SmemTile& b, int b_row0) {
  const int nt_count = static_cast<int>(acc.size());
  for (int ks = 0; ks < a.d / 16; ++ks) {
    std::array<const float*, 32> addr{};
    for (int l = 0; l < 32; ++l) addr[l] = a.chunk(a_row0 + ldsm_a_row(l), 2 * ks + ldsm_a_chunk(l));
    const Lanes4 af = ldmatrix(addr, false);
    for (int np = 0; np < nt_count / 2; ++np) {
      for (int l = 0; l < 32; ++l) addr[l] = b.chunk(b_row0 + 16 * np + ldsm_b_row(l), 2 * ks + ldsm_b_chunk(l));
      const Lanes4 bf = ldmatrix(addr, false);
      std::array<std::array<Reg, 2>, 32> b0{}, b1{};
      for (int l = 0; l < 32; ++l) {
        b0[l] = {bf[l][0], bf[l][1]};
        b1[l] = {bf[l][2], bf[l][3]};
      }
      mma(acc[static_cast<size_t>(2 * np)], af, b0);
      mma(acc[static_cast<size_t>(2 * np + 1)], af, b1);
    }
  }
}

// weights_times_rows of the kernels, emulated: out[dim n-tile] += W · B where W's C fragments
// become A fragments (c_to_a_*, rounded to bf16 as the kernels' pack_bf16 does when to_bf16)
// and B = rows of b from b_row0 ([k = row][n = dim], .trans).
float round_bf16(float x) { return retain::bf16_to_f32(retain::f32_to_bf16(x)); }

void weights_times_rows(Acc& out, const Acc& w, const SmemTile& b, int b_row0, bool to_bf16 = false) {
  for (int s = 0; s < static_cast<int>(w.size()) / 2; ++s) {
    std::array<std::array<Reg, 4>, 32> af{};
    for (int l = 0; l < 32; ++l)
      for (int j = 0; j < 4; ++j) {
        const auto& c = w[static_cast<size_t>(c_to_a_ntile(s, j))][l];
        af[l][j] = c_to_a_pair(j) == 0 ? Reg{c[0], c[1]} : Reg{c[2], c[3]};
        if (to_bf16) af[l][j] = {round_bf16(af[l][j][0]), round_bf16(af[l][j][1])};  // pack_bf16
      }
    for (int dp = 0; dp < b.d / 16; ++dp) {
      std::array<const float*, 32> addr{};
      for (int l = 0; l < 32; ++l) addr[l] = b.chunk(b_row0 + 16 * s + ldsm_a_row(l), 2 * dp + ldsm_a_chunk(l));
      const Lanes4 bf = ldmatrix(addr, true);
      std::array<std::array<Reg, 2>, 32> b0{}, b1{};
      for (int l = 0; l < 32; ++l) {
        b0[l] = {bf[l][0], bf[l][1]};
        b1[l] = {bf[l][2], bf[l][3]};
      }
      mma(out[static_cast<size_t>(2 * dp)], af, b0);
      mma(out[static_cast<size_t>(2 * dp + 1)], af, b1);
    }
  }
}

}  // namespace

// The attention_tiles.h fragment tables agree with the PTX ISA tables written out in mma().
// The unmasked tiles' own code (two FMAs on float distances, attention_lane.h) against the
// masked code on the same all-allowed tiles, lane by lane and element by element, on decays
// that matter at these distances and −inf keys: the fused form must give the same logits,
// probabilities, dS and dlogβ up to float rounding (the emulation above compares whole kernels
// at bf16 tolerance, which an off-by-one distance would pass).
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

// One warp's share of each product of the kernels, through emulated ldmatrix + mma, equals the
// plain matrix product: forward S = Q·Kᵀ and O = P·V, dq = dS·K, and the key-side Kᵀ-products
// Sᵀ = K·Qᵀ (over a 32-query sub-tile, as the dk/dv kernel takes them) and dV = Pᵀ·dO.
TEST(AttentionTiles, EmulatedWarpProductsMatchMatrixProducts) {
  std::mt19937 rng(3);
  for (int d : {64, 128}) {
    SCOPED_TRACE(::testing::Message() << "d=" << d);
    const std::vector<float> qv = small_ints(static_cast<size_t>(kBlock * d), rng);
    const std::vector<float> kvv = small_ints(static_cast<size_t>(kBlock * d), rng);
    const SmemTile Q(d, qv), Kt(d, kvv);
    for (int warp = 0; warp < kWarps; ++warp) {
      const int row0 = warp * kRowsPerWarp;
      // S = Q Kᵀ: rows row0..row0+15 of Q against all 64 keys.
      Acc s(kBlock / 8);
      rows_times_rows_t(s, Q, row0, Kt, 0);
      std::vector<float> S(static_cast<size_t>(16 * kBlock));
      for (int nt = 0; nt < kBlock / 8; ++nt)
        for (int l = 0; l < 32; ++l)
          for (int e = 0; e < 4; ++e) {
            const int r = c_row(l, e), c = 8 * nt + c_col(l, e);
            float want = 0;
            for (int j = 0; j < d; ++j)
              want += qv[static_cast<size_t>((row0 + r) * d + j)] * kvv[static_cast<size_t>(c * d + j)];
            ASSERT_EQ(s[static_cast<size_t>(nt)][l][e], want) << "S row " << r << " col " << c;
            S[static_cast<size_t>(r * kBlock + c)] = want;
          }
      // O = S·V with the scores re-used as A (V = the K tile's values: any matrix will do).
      Acc o(static_cast<size_t>(d / 8));
      weights_times_rows(o, s, Kt, 0);
      for (int nt = 0; nt < d / 8; ++nt)
        for (int l = 0; l < 32; ++l)
          for (int e = 0; e < 4; ++e) {
            const int r = c_row(l, e), c = 8 * nt + c_col(l, e);
            float want = 0;
            for (int i = 0; i < kBlock; ++i)
              want += S[static_cast<size_t>(r * kBlock + i)] * kvv[static_cast<size_t>(i * d + c)];
            ASSERT_EQ(o[static_cast<size_t>(nt)][l][e], want) << "O row " << r << " dim " << c;
          }
      // Key side: Sᵀ = K·Qᵀ over a query sub-tile (32 queries from 32, as d = 64 takes them;
      // 16 from 48, as d = 128 does), then Sᵀ·Q (dK = dSᵀ·Q's shape).
      for (const auto& [c0, sub] : {std::pair<int, int>{32, 32}, std::pair<int, int>{48, 16}}) {
        Acc st(static_cast<size_t>(sub / 8));
        rows_times_rows_t(st, Kt, row0, Q, c0);
        for (int nt = 0; nt < sub / 8; ++nt)
          for (int l = 0; l < 32; ++l)
            for (int e = 0; e < 4; ++e) {
              const int r = c_row(l, e), c = c0 + 8 * nt + c_col(l, e);
              float want = 0;
              for (int j = 0; j < d; ++j)
                want += kvv[static_cast<size_t>((row0 + r) * d + j)] * qv[static_cast<size_t>(c * d + j)];
              ASSERT_EQ(st[static_cast<size_t>(nt)][l][e], want) << "Sᵀ key " << r << " query " << c;
            }
        Acc dk(static_cast<size_t>(d / 8));
        weights_times_rows(dk, st, Q, c0);
        for (int nt = 0; nt < d / 8; ++nt)
          for (int l = 0; l < 32; ++l)
            for (int e = 0; e < 4; ++e) {
              const int r = c_row(l, e), c = 8 * nt + c_col(l, e);
              float want = 0;
              for (int t = c0; t < c0 + sub; ++t) {
                float st_rt = 0;
                for (int j = 0; j < d; ++j)
                  st_rt += kvv[static_cast<size_t>((row0 + r) * d + j)] * qv[static_cast<size_t>(t * d + j)];
                want += st_rt * qv[static_cast<size_t>(t * d + c)];
              }
              ASSERT_EQ(dk[static_cast<size_t>(nt)][l][e], want) << "dK key " << r << " dim " << c;
            }
      }
    }
  }
}

namespace {

// ---- whole CTAs of the three kernels, emulated warp by warp -----------------------------
// Each function below follows its kernel in gated_attention.cu step by step — the same
// schedule functions, shared tiles in the kernels' swizzled layout, emulated ldmatrix + mma,
// and the kernels' own per-lane code from attention_lane.h — with the quad shuffles written as
// sums/maxima over the 4 lanes. Only staging (cp.async, barriers) is not emulated.

struct Emu {
  int64_t T = 0, H = 0, K = 0, d = 0;
  float scale = 0;
  std::vector<float> q, k, v, dout, lb;  // q, k, v, dout already bf16-rounded
  std::vector<int32_t> doc;
  std::vector<DocRange> ranges;
  std::vector<retain::cuda::spans::BlockSpan> spans;
  bool bf16 = true;   // round P, dS and the outputs to bf16 as the device does
  bool skip = false;  // the optional weight skip, at log_eps, with lbmax [nb, K]
  float log_eps = 0.0f;
  std::vector<float> lbmax;
  TileFilter filter(int64_t kv) const {
    return {ranges.data(), spans.data(), skip ? lbmax.data() + kv : nullptr, K, log_eps};
  }
  float out_round(float x) const { return bf16 ? round_bf16(x) : x; }
};

using LaneFrag = float[16][4];  // room for up to 16 n-tiles

// Rows [row0, row0 + 64) of head `head` of a [T, heads, d] array as a shared tile (0 past T).
SmemTile tile_of(const Emu& e, const std::vector<float>& x, int64_t heads, int64_t head, int64_t row0) {
  std::vector<float> rows(static_cast<size_t>(kBlock * e.d), 0.0f);
  for (int r = 0; r < kBlock && row0 + r < e.T; ++r)
    for (int64_t j = 0; j < e.d; ++j)
      rows[static_cast<size_t>(r * e.d + j)] = x[static_cast<size_t>(((row0 + r) * heads + head) * e.d + j)];
  return SmemTile(static_cast<int>(e.d), rows);
}

template <int NT>
void to_lane(const Acc& a, int l, float (&f)[NT][4]) {
  for (int nt = 0; nt < NT; ++nt)
    for (int e = 0; e < 4; ++e) f[nt][e] = a[static_cast<size_t>(nt)][l][e];
}
template <int NT>
void from_lane(Acc& a, int l, const float (&f)[NT][4]) {
  for (int nt = 0; nt < NT; ++nt)
    for (int e = 0; e < 4; ++e) a[static_cast<size_t>(nt)][l][e] = f[nt][e];
}

// The rows of this lane in a warp's row-block starting at block row `base` + 16·warp.
struct LaneRows {
  int64_t pos[2];
  int32_t doc[2];
  bool in[2];
};
LaneRows lane_rows(const Emu& e, int64_t base, int warp, int l, int64_t count) {
  LaneRows r{};
  for (int x = 0; x < 2; ++x) {
    const int row = warp * kRowsPerWarp + c_row(l, 2 * x);
    r.pos[x] = base + row;
    r.in[x] = row < count;
    r.doc[x] = r.in[x] ? e.doc[static_cast<size_t>(r.pos[x])] : -1;
  }
  return r;
}

// Key-side staging of the forward/dq kernels' load_keys: staged logβ·log2 e, −c·lb2 and the
// documents of key block kb.
void stage_keys(const Emu& e, int64_t kb, int64_t kv, float* lb2, float* ncl, int32_t* doc_k) {
  const int64_t i0 = block_begin(kb), nk = block_size(e.T, kb);
  for (int c = 0; c < kBlock; ++c) {
    lb2[c] = c < nk ? staged_lb2(e.lb[static_cast<size_t>((i0 + c) * e.K + kv)]) : 0.0f;
    ncl[c] = staged_neg_c_lb2(c, lb2[c]);
    doc_k[c] = c < nk ? e.doc[static_cast<size_t>(i0 + c)] : -1;
  }
}

void emulate_forward(const Emu& e, std::vector<float>& out, std::vector<float>& lse) {
  const int64_t nb = block_count(e.T), group = e.H / e.K;
  const float scale2 = e.scale * kLog2e;
  for (int64_t qb = 0; qb < nb; ++qb)
    for (int64_t h = 0; h < e.H; ++h) {
      const int64_t kv = h / group, q0 = block_begin(qb), nq = block_size(e.T, qb);
      const SmemTile Q = tile_of(e, e.q, e.H, h, q0);
      for (int warp = 0; warp < kWarps; ++warp) {
        Acc o(static_cast<size_t>(e.d / 8));
        float m[32][2], l[32][2];
        for (int ln = 0; ln < 32; ++ln) m[ln][0] = m[ln][1] = -INFINITY, l[ln][0] = l[ln][1] = 0.0f;
        for (int64_t kb = next_key_block(e.filter(kv), qb, 0); kb <= qb;
             kb = next_key_block(e.filter(kv), qb, kb + 1)) {
          const SmemTile Kt = tile_of(e, e.k, e.K, kv, block_begin(kb)), Vt = tile_of(e, e.v, e.K, kv, block_begin(kb));
          float lb2[kBlock], ncl[kBlock];
          int32_t doc_k[kBlock];
          stage_keys(e, kb, kv, lb2, ncl, doc_k);
          const bool all = tile_all_allowed(e.ranges.data(), qb, kb);
          Acc s(kBlock / 8);
          rows_times_rows_t(s, Q, warp * kRowsPerWarp, Kt, 0);
          float mx[32][2];
          for (int ln = 0; ln < 32; ++ln) {
            float f[kBlock / 8][4];
            to_lane(s, ln, f);
            const LaneRows r = lane_rows(e, q0, warp, ln, nq);
            query_row_logits(f, ln, r.pos, r.doc, block_begin(kb), lb2, ncl, doc_k, all, scale2);
            lane_row_max(f, mx[ln]);
            from_lane(s, ln, f);
          }
          for (int ln = 0; ln < 32; ++ln) {  // quad_max
            float tile_max[2];
            for (int x = 0; x < 2; ++x) {
              tile_max[x] = -INFINITY;
              for (int o4 = 0; o4 < 4; ++o4) tile_max[x] = std::fmax(tile_max[x], mx[(ln & ~3) + o4][x]);
            }
            float f[kBlock / 8][4], alpha[2];
            to_lane(s, ln, f);
            online_softmax_step(f, tile_max, m[ln], l[ln], alpha);
            from_lane(s, ln, f);
            for (int nt = 0; nt < e.d / 8; ++nt)
              for (int el = 0; el < 4; ++el) o[static_cast<size_t>(nt)][ln][el] *= alpha[el / 2];
          }
          weights_times_rows(o, s, Vt, 0, e.bf16);
        }
        for (int ln = 0; ln < 32; ++ln) {
          const LaneRows r = lane_rows(e, q0, warp, ln, nq);
          for (int x = 0; x < 2; ++x) {
            if (!r.in[x]) continue;
            float lsum = 0, inv = 0, row_lse = 0;
            for (int o4 = 0; o4 < 4; ++o4) lsum += l[(ln & ~3) + o4][x];
            finish_row(lsum, m[ln][x], inv, row_lse);
            lse[static_cast<size_t>(r.pos[x] * e.H + h)] = row_lse;
            for (int nt = 0; nt < e.d / 8; ++nt)
              for (int half = 0; half < 2; ++half)
                out[static_cast<size_t>((r.pos[x] * e.H + h) * e.d + 8 * nt + c_col(ln, half))] =
                    e.out_round(o[static_cast<size_t>(nt)][ln][2 * x + half] * inv);
          }
        }
      }
    }
}

void emulate_dq(const Emu& e, const std::vector<float>& lse, const std::vector<float>& delta, std::vector<float>& dq) {
  const int64_t nb = block_count(e.T), group = e.H / e.K;
  const float scale2 = e.scale * kLog2e;
  for (int64_t qb = 0; qb < nb; ++qb)
    for (int64_t h = 0; h < e.H; ++h) {
      const int64_t kv = h / group, q0 = block_begin(qb), nq = block_size(e.T, qb);
      const SmemTile Q = tile_of(e, e.q, e.H, h, q0), dO = tile_of(e, e.dout, e.H, h, q0);
      for (int warp = 0; warp < kWarps; ++warp) {
        Acc acc(static_cast<size_t>(e.d / 8));
        for (int64_t kb = next_key_block(e.filter(kv), qb, 0); kb <= qb;
             kb = next_key_block(e.filter(kv), qb, kb + 1)) {
          const SmemTile Kt = tile_of(e, e.k, e.K, kv, block_begin(kb)), Vt = tile_of(e, e.v, e.K, kv, block_begin(kb));
          float lb2[kBlock], ncl[kBlock];
          int32_t doc_k[kBlock];
          stage_keys(e, kb, kv, lb2, ncl, doc_k);
          Acc s(kBlock / 8), dp(kBlock / 8);
          rows_times_rows_t(s, Q, warp * kRowsPerWarp, Kt, 0);
          rows_times_rows_t(dp, dO, warp * kRowsPerWarp, Vt, 0);
          for (int ln = 0; ln < 32; ++ln) {
            const LaneRows r = lane_rows(e, q0, warp, ln, nq);
            float lse2[2], dl[2];
            for (int x = 0; x < 2; ++x) {
              lse2[x] = lse_base2(r.in[x] ? lse[static_cast<size_t>(r.pos[x] * e.H + h)] : -INFINITY);
              dl[x] = r.in[x] ? delta[static_cast<size_t>(r.pos[x] * e.H + h)] : 0.0f;
            }
            float fs[kBlock / 8][4], fd[kBlock / 8][4];
            to_lane(s, ln, fs);
            to_lane(dp, ln, fd);
            query_row_dscores(fs, fd, ln, r.pos, r.doc, block_begin(kb), lb2, ncl, doc_k,
                              tile_all_allowed(e.ranges.data(), qb, kb), scale2, lse2, dl);
            from_lane(s, ln, fs);
          }
          weights_times_rows(acc, s, Kt, 0, e.bf16);
        }
        for (int ln = 0; ln < 32; ++ln) {
          const LaneRows r = lane_rows(e, q0, warp, ln, nq);
          for (int x = 0; x < 2; ++x)
            if (r.in[x])
              for (int nt = 0; nt < e.d / 8; ++nt)
                for (int half = 0; half < 2; ++half)
                  dq[static_cast<size_t>((r.pos[x] * e.H + h) * e.d + 8 * nt + c_col(ln, half))] =
                      e.out_round(acc[static_cast<size_t>(nt)][ln][2 * x + half] * e.scale);
        }
      }
    }
}

template <int kSub>
void emulate_dkdv(const Emu& e, const std::vector<float>& lse, const std::vector<float>& delta, std::vector<float>& dk,
                  std::vector<float>& dv, std::vector<float>& dlb) {
  const int64_t nb = block_count(e.T), group = e.H / e.K;
  const float scale2 = e.scale * kLog2e;
  for (int64_t kb = 0; kb < nb; ++kb)
    for (int64_t kv = 0; kv < e.K; ++kv) {
      const int64_t i0 = block_begin(kb), nk = block_size(e.T, kb);
      const SmemTile Kt = tile_of(e, e.k, e.K, kv, i0), Vt = tile_of(e, e.v, e.K, kv, i0);
      for (int warp = 0; warp < kWarps; ++warp) {
        Acc dk_acc(static_cast<size_t>(e.d / 8)), dv_acc(static_cast<size_t>(e.d / 8));
        double dl[32][2] = {};  // the kernel's fp64 sums across tiles
        const int64_t first = next_query_block(e.filter(kv), nb, kb, kb);
        const int h_end = static_cast<int>((kv + 1) * group);
        for (HeadBlock at{first < nb ? static_cast<int>(kv * group) : h_end, first}; at.h < h_end;
             at = next_head_block(e.filter(kv), nb, kb, first, at)) {
          const int64_t q0 = block_begin(at.qb), nq = block_size(e.T, at.qb);
          const SmemTile Q = tile_of(e, e.q, e.H, at.h, q0), dO = tile_of(e, e.dout, e.H, at.h, q0);
          float lse2[kBlock], dlt[kBlock];
          int32_t doc_q[kBlock];
          for (int c = 0; c < kBlock; ++c) {
            const bool in = c < nq;
            lse2[c] = lse_base2(in ? lse[static_cast<size_t>((q0 + c) * e.H + at.h)] : -INFINITY);
            dlt[c] = in ? delta[static_cast<size_t>((q0 + c) * e.H + at.h)] : 0.0f;
            doc_q[c] = in ? e.doc[static_cast<size_t>(q0 + c)] : -1;
          }
          const bool all = tile_all_allowed(e.ranges.data(), at.qb, kb);
          float dl_tile[32][2] = {};  // fp32 within the tile
          for (int c0 = 0; c0 < kBlock; c0 += kSub) {
            Acc s(kSub / 8), dp(kSub / 8);
            rows_times_rows_t(s, Kt, warp * kRowsPerWarp, Q, c0);
            rows_times_rows_t(dp, Vt, warp * kRowsPerWarp, dO, c0);
            for (int ln = 0; ln < 32; ++ln) {
              const LaneRows r = lane_rows(e, i0, warp, ln, nk);
              float lb2_i[2];
              for (int x = 0; x < 2; ++x)
                lb2_i[x] = r.in[x] ? staged_lb2(e.lb[static_cast<size_t>(r.pos[x] * e.K + kv)]) : 0.0f;
              float fs[kSub / 8][4], fd[kSub / 8][4];
              to_lane(s, ln, fs);
              to_lane(dp, ln, fd);
              key_row_grads(fs, fd, ln, r.pos, r.doc, lb2_i, q0, c0, lse2, dlt, doc_q, all, scale2, dl_tile[ln]);
              from_lane(s, ln, fs);
              from_lane(dp, ln, fd);
            }
            weights_times_rows(dv_acc, s, dO, c0, e.bf16);
            weights_times_rows(dk_acc, dp, Q, c0, e.bf16);
          }
          for (int ln = 0; ln < 32; ++ln)
            for (int x = 0; x < 2; ++x) dl[ln][x] += static_cast<double>(dl_tile[ln][x]);
        }
        for (int ln = 0; ln < 32; ++ln) {
          const LaneRows r = lane_rows(e, i0, warp, ln, nk);
          for (int x = 0; x < 2; ++x) {
            if (!r.in[x]) continue;
            // The quad shuffle's order: (l0 + l1) + (l2 + l3).
            const double sum = (dl[(ln & ~3) + 0][x] + dl[(ln & ~3) + 1][x]) + (dl[(ln & ~3) + 2][x] + dl[(ln & ~3) + 3][x]);
            dlb[static_cast<size_t>(r.pos[x] * e.K + kv)] = static_cast<float>(sum);
            for (int nt = 0; nt < e.d / 8; ++nt)
              for (int half = 0; half < 2; ++half) {
                const size_t at = static_cast<size_t>((r.pos[x] * e.K + kv) * e.d + 8 * nt + c_col(ln, half));
                dk[at] = e.out_round(dk_acc[static_cast<size_t>(nt)][ln][2 * x + half] * e.scale);
                dv[at] = e.out_round(dv_acc[static_cast<size_t>(nt)][ln][2 * x + half]);
              }
          }
        }
      }
    }
}

std::vector<float> bf16_randn(int64_t n, float std, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, std);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = round_bf16(dist(rng));
  return v;
}

double rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t x = 0; x < want.size(); ++x) {
    if (!std::isfinite(got[x])) return INFINITY;
    num += (double(got[x]) - want[x]) * (double(got[x]) - want[x]);
    den += double(want[x]) * want[x];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

std::vector<float> values(const retain::Tensor& t) {
  const float* p = t.data<float>();
  return std::vector<float>(p, p + t.numel());
}

}  // namespace

// The three kernels emulated CTA by CTA on the CPU against the CPU reference op, with the GPU
// test's tolerance (‖Δ‖/‖ref‖ ≤ 1e-2; bf16 rounding of P, dS and the outputs as on the device):
// the schedule, the fragment flow and the per-lane math of attention_lane.h together. Documents
// with padding, T not a block multiple, GQA 1/2/8, d = 64 and 128, logβ from −inf to 0, and
// long rows (T = 700, 1000) through many tiles.
TEST(AttentionTiles, EmulatedKernelsMatchCpuReference) {
  using retain::DType;
  using retain::Tensor;
  struct Case {
    int64_t T, H, K, d;
    bool interleaved;
    bool one_plain_document = false;  // a single document with logβ ≡ 0: long rows, all-allowed tiles
    bool two_long_documents = false;  // two documents of T/2: all-allowed tiles with decaying logβ
  };
  std::mt19937 rng(4);
  for (const Case& c : {Case{200, 4, 2, 64, false}, Case{130, 8, 1, 128, false}, Case{65, 2, 2, 128, true},
                        Case{150, 2, 1, 64, false}, Case{1000, 2, 1, 64, false, true}, Case{700, 2, 2, 128, false},
                        Case{1000, 4, 2, 64, false, false, true}, Case{640, 2, 1, 128, false, false, true}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << c.T << " H=" << c.H << " K=" << c.K << " d=" << c.d);
    Emu e;
    e.T = c.T, e.H = c.H, e.K = c.K, e.d = c.d, e.scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    e.q = bf16_randn(c.T * c.H * c.d, 1.5f, rng);
    e.k = bf16_randn(c.T * c.K * c.d, 1.5f, rng);
    e.v = bf16_randn(c.T * c.K * c.d, 1.0f, rng);
    e.dout = bf16_randn(c.T * c.H * c.d, 1.0f, rng);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (int64_t x = 0; x < c.T * c.K; ++x) {
      const float r = u(rng);
      e.lb.push_back(c.one_plain_document ? 0.0f
                     : r < 0.05f          ? -INFINITY
                     : r < 0.15f          ? -30.0f
                     : r < 0.5f           ? -2.0f * u(rng)
                                          : -1e-3f * u(rng));
    }
    e.doc =
        c.one_plain_document ? std::vector<int32_t>(static_cast<size_t>(c.T), 0) : random_docs(c.T, rng, c.interleaved);
    if (c.two_long_documents)
      for (int64_t t = 0; t < c.T; ++t) e.doc[static_cast<size_t>(t)] = static_cast<int32_t>(t / (c.T / 2));
    e.ranges = ranges_of(e.doc);
    e.spans = spans_of(e.ranges);
    if (c.two_long_documents) {  // the unmasked tiles' own code runs, on real decays and −inf keys
      int64_t unmasked = 0;
      for (int64_t qb = 0; qb < block_count(c.T); ++qb)
        for (int64_t kb = 0; kb < qb; ++kb) unmasked += tile_all_allowed(e.ranges.data(), qb, kb);
      EXPECT_GE(unmasked, 20);
    }

    // Reference.
    const Tensor q = Tensor::from_vector<float>(e.q, {c.T, c.H, c.d}),
                 k = Tensor::from_vector<float>(e.k, {c.T, c.K, c.d}),
                 v = Tensor::from_vector<float>(e.v, {c.T, c.K, c.d}),
                 lb = Tensor::from_vector<float>(e.lb, {c.T, c.K}), doc = Tensor::from_vector<int32_t>(e.doc, {c.T}),
                 dout = Tensor::from_vector<float>(e.dout, {c.T, c.H, c.d});
    Tensor out = Tensor::empty({c.T, c.H, c.d}, DType::F32), lse = Tensor::empty({c.T, c.H}, DType::F32);
    retain::ops::gated_attention(q, k, v, lb, doc, e.scale, out, lse);
    Tensor dq = Tensor::empty({c.T, c.H, c.d}, DType::F32), dk = Tensor::empty({c.T, c.K, c.d}, DType::F32),
           dv = Tensor::empty({c.T, c.K, c.d}, DType::F32), dlb = Tensor::empty({c.T, c.K}, DType::F32);
    retain::ops::gated_attention_backward(q, k, v, lb, doc, e.scale, out, lse, dout, dq, dk, dv, dlb);

    // Emulation (NaN-initialized: an element no CTA writes fails the comparison).
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> e_out(static_cast<size_t>(c.T * c.H * c.d), nan), e_lse(static_cast<size_t>(c.T * c.H), nan);
    emulate_forward(e, e_out, e_lse);
    std::vector<float> delta(static_cast<size_t>(c.T * c.H));  // delta_kernel: Σ dout·out (bf16 out)
    for (int64_t row = 0; row < c.T * c.H; ++row) {
      float sum = 0;
      for (int64_t j = 0; j < c.d; ++j)
        sum += e.dout[static_cast<size_t>(row * c.d + j)] * e_out[static_cast<size_t>(row * c.d + j)];
      delta[static_cast<size_t>(row)] = sum;
    }
    std::vector<float> e_dq(e.q.size(), nan), e_dk(e.k.size(), nan), e_dv(e.k.size(), nan), e_dlb(e.lb.size(), nan);
    emulate_dq(e, e_lse, delta, e_dq);
    if (c.d == 128)
      emulate_dkdv<16>(e, e_lse, delta, e_dk, e_dv, e_dlb);
    else
      emulate_dkdv<32>(e, e_lse, delta, e_dk, e_dv, e_dlb);

    EXPECT_LE(rel_err(e_out, values(out)), 1e-2);
    EXPECT_LE(rel_err(e_dq, values(dq)), 1e-2);
    EXPECT_LE(rel_err(e_dk, values(dk)), 1e-2);
    EXPECT_LE(rel_err(e_dv, values(dv)), 1e-2);
    EXPECT_LE(rel_err(e_dlb, values(dlb)), 1e-2);
    const std::vector<float> want_lse = values(lse);
    for (size_t x = 0; x < want_lse.size(); ++x) {
      if (std::isinf(want_lse[x]))
        EXPECT_EQ(e_lse[x], want_lse[x]) << "lse row " << x;
      else
        EXPECT_NEAR(e_lse[x], want_lse[x], 1e-3 * (1 + std::abs(want_lse[x]))) << "lse row " << x;
    }
    std::cout << "T=" << c.T << " H=" << c.H << " K=" << c.K << " d=" << c.d << ": rel err out "
              << rel_err(e_out, values(out)) << " dq " << rel_err(e_dq, values(dq)) << " dk "
              << rel_err(e_dk, values(dk)) << " dv " << rel_err(e_dv, values(dv)) << " dlogβ "
              << rel_err(e_dlb, values(dlb)) << "\n";
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

// The stated bounds of the weight skip (attention_tiles.h), on the emulated forward in fp32 (no
// bf16 rounding, so the difference is the skip's alone), per row t with S_t = the allowed keys
// of skipped tiles: a priori δ_t ≤ ε·Σ_{i∈S_t} exp(a_ti − a_tt) (checked where below 1);
// a posteriori, with the skip run's own l̂se, δ_t/(1 − δ_t) ≤ r_t = ε·Σ_{i∈S_t} exp(a_ti − l̂se_t);
// then ‖o_t − ô_t‖ ≤ 2·δ_t·max‖v‖ and |lse_t − l̂se_t| = log(1 + δ_t/(1 − δ_t)) ≤ log(1 + r_t),
// each plus 1e-5 for float32 arithmetic. The skip must have dropped tiles and changed some
// output by more than that slack (not vacuous).
TEST(AttentionTiles, WeightSkipStaysWithinItsBound) {
  std::mt19937 rng(6);
  const int64_t T = 600, H = 2, K = 1, d = 64;
  for (const float eps : {0.02f, 1e-3f}) {
    SCOPED_TRACE(::testing::Message() << "eps=" << eps);
    Emu e;
    e.T = T, e.H = H, e.K = K, e.d = d, e.scale = 1.0f / std::sqrt(static_cast<float>(d));
    e.q = bf16_randn(T * H * d, 1.0f, rng);
    e.k = bf16_randn(T * K * d, 1.0f, rng);
    e.v = bf16_randn(T * K * d, 1.0f, rng);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (int64_t x = 0; x < T * K; ++x) e.lb.push_back(-0.03f - 0.05f * u(rng));
    e.doc.assign(static_cast<size_t>(T), 0);
    for (int64_t t = 400; t < T; ++t) e.doc[static_cast<size_t>(t)] = t < 410 ? -1 : 1;  // two documents + padding
    e.ranges = ranges_of(e.doc);
    e.spans = spans_of(e.ranges);
    e.bf16 = false;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> out(static_cast<size_t>(T * H * d), nan), lse(static_cast<size_t>(T * H), nan);
    emulate_forward(e, out, lse);
    const int64_t nb = block_count(T);
    e.skip = true;
    e.log_eps = std::log(eps);
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t kv = 0; kv < K; ++kv) e.lbmax.push_back(block_max_log_beta(e.lb.data(), e.doc.data(), T, K, b, kv));
    std::vector<float> out_s(out.size(), nan), lse_s(lse.size(), nan);
    emulate_forward(e, out_s, lse_s);

    double vmax = 0;
    for (int64_t i = 0; i < T; ++i) {
      double n2 = 0;
      for (int64_t j = 0; j < d; ++j)
        n2 += double(e.v[static_cast<size_t>(i * d + j)]) * e.v[static_cast<size_t>(i * d + j)];
      vmax = std::max(vmax, std::sqrt(n2));
    }
    int skipped_tiles = 0;
    double largest_change = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const size_t row = static_cast<size_t>(t * H + h);
        if (e.doc[static_cast<size_t>(t)] < 0) {
          EXPECT_EQ(lse_s[row], -INFINITY);
          continue;
        }
        auto a = [&](int64_t i) {
          double dot = 0;
          for (int64_t j = 0; j < d; ++j)
            dot += double(e.q[row * d + static_cast<size_t>(j)]) * e.k[static_cast<size_t>(i * d + j)];
          return dot * e.scale;
        };
        const double a_tt = a(t), lse_hat = lse_s[row];
        double prior = 0, r = 0;
        for (int64_t i = 0; i < t; ++i)
          if (e.doc[static_cast<size_t>(i)] == e.doc[static_cast<size_t>(t)] &&
              !visits(e.filter(0), t / kBlock, i / kBlock)) {
            prior += std::exp(a(i) - a_tt);
            r += std::exp(a(i) - lse_hat);
          }
        prior *= eps;
        r *= eps;
        const double delta = r / (1 + r);
        double diff2 = 0;
        for (int64_t j = 0; j < d; ++j) {
          const double x = double(out[row * d + static_cast<size_t>(j)]) - out_s[row * d + static_cast<size_t>(j)];
          diff2 += x * x;
        }
        const double diff = std::sqrt(diff2);
        largest_change = std::max(largest_change, diff);
        EXPECT_LE(diff, 2 * delta * vmax + 1e-5) << "t=" << t << " h=" << h;
        if (prior < 1) {
          EXPECT_LE(diff, 2 * prior * vmax + 1e-5) << "t=" << t << " h=" << h;
        }
        EXPECT_LE(std::abs(double(lse[row]) - lse_s[row]), std::log1p(r) + 1e-5) << "t=" << t << " h=" << h;
      }
    for (int64_t qb = 0; qb < nb; ++qb)
      for (int64_t kb = 0; kb <= qb; ++kb)
        skipped_tiles += tile_visited(e.ranges.data(), qb, kb) && !visits(e.filter(0), qb, kb);
    std::cout << "eps " << eps << ": " << skipped_tiles << " tiles skipped, largest output change " << largest_change
              << "\n";
    EXPECT_GT(skipped_tiles, 0);
    EXPECT_GT(largest_change, 1e-4);
  }
}
