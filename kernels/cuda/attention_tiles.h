// The index arithmetic of the CUDA retention-gated attention kernels (gated_attention.cu),
// as __host__ __device__ functions so that tests/cuda/test_attention_tiles.cpp checks it on
// the CPU in every build: which tiles a block visits (and which the optional weight skip
// drops, with its error bound), the pair mask, the shared-memory swizzle, and which element of
// a tile each lane's mma.sync / ldmatrix fragment holds.
// Plain C++ (no CUDA headers): the host compiler sees the same code.
#pragma once
#include <math.h>

#include <cstdint>

#include "kernels/cuda/block_spans.h"
#include "kernels/cuda/host_device.h"  // RETAIN_HD
// Full unrolling of the fragment loops in device code (host compilers do not know the pragma).
#if defined(__CUDA_ARCH__)
#define RETAIN_UNROLL _Pragma("unroll")
#else
#define RETAIN_UNROLL
#endif

namespace retain::cuda::tiles {

// Queries and keys are both cut into blocks of kBlock tokens; a CTA owns one block (a query
// block in the forward and dq kernels, a key block in the dk/dv kernel) and visits tiles of
// kBlock × kBlock pairs. With equal query and key blocks, "key block kb holds a key i ≤ t
// for some query t of block qb" is exactly kb ≤ qb.
inline constexpr int kBlock = 64;
inline constexpr int kWarps = 4;                 // each warp owns 16 rows of the CTA's block
inline constexpr int kThreads = 32 * kWarps;
inline constexpr int kRowsPerWarp = kBlock / kWarps;  // = 16, the m of m16n8k16
static_assert(kRowsPerWarp == 16, "one m16 fragment row-block per warp");

RETAIN_HD int64_t block_count(int64_t T) { return (T + kBlock - 1) / kBlock; }
// Tokens [block_begin, block_begin + block_size) of block b (the last one may be short).
RETAIN_HD int64_t block_begin(int64_t b) { return b * kBlock; }
RETAIN_HD int64_t block_size(int64_t T, int64_t b) {
  const int64_t n = T - b * kBlock;
  return n < kBlock ? n : kBlock;
}

// The document ids among a block's non-padding tokens as [lo, hi] (lo > hi: none), and
// whether the block is "single": full length and every token in document lo == hi.
// Equal ids lie in both ranges, so two blocks can hold an allowed pair only if their ranges
// intersect (this holds for any layout of documents; the per-pair mask does the rest).
struct DocRange {
  int32_t lo;
  int32_t hi;
  int32_t single;  // 1: a full block of one document (no padding)
  int32_t pad_;    // keeps the struct 16 bytes (one vector load on the device)
};

RETAIN_HD DocRange block_doc_range(const int32_t* doc, int64_t T, int64_t b) {
  DocRange r{INT32_MAX, INT32_MIN, 0, 0};
  const int64_t begin = block_begin(b), n = block_size(T, b);
  bool padded = n < kBlock;
  for (int64_t t = begin; t < begin + n; ++t) {
    const int32_t x = doc[t];
    if (x < 0) {
      padded = true;
      continue;
    }
    r.lo = x < r.lo ? x : r.lo;
    r.hi = x > r.hi ? x : r.hi;
  }
  r.single = !padded && r.lo == r.hi;
  return r;
}

RETAIN_HD bool ranges_meet(const DocRange& a, const DocRange& b) {
  return a.lo <= a.hi && b.lo <= b.hi && a.lo <= b.hi && b.lo <= a.hi;
}

// Tile (query block qb, key block kb) may hold an allowed pair: on or below the diagonal
// and the blocks share a document id range.
RETAIN_HD bool tile_visited(const DocRange* ranges, int64_t qb, int64_t kb) {
  return kb <= qb && ranges_meet(ranges[qb], ranges[kb]);
}

// Every pair of the tile is allowed (no per-pair mask needed): strictly below the diagonal
// (so every i < every t) and both blocks full blocks of the same single document.
RETAIN_HD bool tile_all_allowed(const DocRange* ranges, int64_t qb, int64_t kb) {
  return kb < qb && ranges[qb].single && ranges[kb].single && ranges[qb].lo == ranges[kb].lo;
}

// ---- optional skip of negligible tiles (off unless asked for) --------------------------
// Every weight β_i^(t−i) = exp((t − i)·logβ_i) of tile (qb, kb), kb < qb, is at most
// exp(d_min·lbmax) with d_min = (qb − kb)·kBlock − (kBlock − 1) the tile's smallest distance and
// lbmax the largest logβ among the key block's non-padding keys (logβ ≤ 0). The tile is
// negligible when that is below ε, i.e. d_min·lbmax < log ε. The diagonal tile (t = i, weight
// 1) is never negligible. Bounds (tested in tests/cuda/test_attention_tiles.cpp): with
// a_ti = (q_t·k_i)·scale and S_t the allowed keys of the tiles skipped for row t, the softmax
// mass δ_t the row loses satisfies
//   a priori     δ_t ≤ ε · Σ_{i∈S_t} exp(a_ti − a_tt)   (the normalizer is ≥ the i = t term),
//   a posteriori δ_t / (1 − δ_t) ≤ ε · Σ_{i∈S_t} exp(a_ti − l̂se_t)   (l̂se: the skipping run's),
// and then ‖o_t − ô_t‖ ≤ 2·δ_t·max_i ‖v_i‖ and lse_t − l̂se_t = −log(1 − δ_t). The backward
// given the same ε visits the same tiles: it is the exact gradient of the skipping forward.
RETAIN_HD int64_t tile_min_distance(int64_t qb, int64_t kb) { return (qb - kb) * kBlock - (kBlock - 1); }
RETAIN_HD bool tile_negligible(float lbmax, int64_t qb, int64_t kb, float log_eps) {
  return kb < qb && static_cast<float>(tile_min_distance(qb, kb)) * lbmax < log_eps;
}
// The largest logβ[t, kv] over the non-padding tokens t of block b (−inf when there are none).
RETAIN_HD float block_max_log_beta(const float* log_beta, const int32_t* doc, int64_t T, int64_t K, int64_t b,
                                   int64_t kv) {
  float mx = -INFINITY;
  for (int64_t t = block_begin(b); t < block_begin(b) + block_size(T, b); ++t)
    if (doc[t] >= 0) mx = fmaxf(mx, log_beta[t * K + kv]);
  return mx;
}

// The tiles a CTA visits: tile_visited, and not negligible when the weight skip is on
// (lbmax: this KV head's per-block maxima, lbmax[kb·stride]; nullptr: exact, nothing skipped).
// spans (kernels/cuda/block_spans.h) bound the walks: query block qb meets no key block before
// spans[qb].key_begin, key block kb no query block from spans[kb].query_end on, so a CTA looks
// its span up instead of testing every block from 0 (forward, dq) or up to nb (dk/dv).
//
// A rectangle (rect_tiles; context parallelism's chunk against a wholly earlier chunk,
// kernels/retention_spans.h): the keys are another span of query_blocks × key_blocks tiles,
// every pair is causal (each key precedes each query), so a tile is visited when the blocks'
// document ranges meet, with no diagonal; the key blocks have their own ranges, no spans table
// (the walks cover every block of the other side) and no weight skip.
struct TileFilter {
  const DocRange* ranges;  // the query blocks' (one sequence: every block's)
  const spans::BlockSpan* spans;
  const float* lbmax;
  int64_t stride;
  float log_eps;
  const DocRange* key_ranges = nullptr;  // a rectangle's key blocks (nullptr: one sequence)
  int64_t query_blocks = 0, key_blocks = 0;  // a rectangle's block counts
};
RETAIN_HD TileFilter exact_tiles(const DocRange* ranges, const spans::BlockSpan* block_spans) {
  return {ranges, block_spans, nullptr, 0, 0.0f};
}
RETAIN_HD TileFilter rect_tiles(const DocRange* query_ranges, int64_t query_blocks, const DocRange* key_ranges,
                                int64_t key_blocks) {
  return {query_ranges, nullptr, nullptr, 0, 0.0f, key_ranges, query_blocks, key_blocks};
}
RETAIN_HD bool is_rect(const TileFilter& f) { return f.key_ranges != nullptr; }
RETAIN_HD bool visits(const TileFilter& f, int64_t qb, int64_t kb) {
  if (is_rect(f)) return ranges_meet(f.ranges[qb], f.key_ranges[kb]);
  return tile_visited(f.ranges, qb, kb) && !(f.lbmax && tile_negligible(f.lbmax[kb * f.stride], qb, kb, f.log_eps));
}
// Every pair of a visited tile is allowed: tile_all_allowed, or in a rectangle both blocks
// full blocks of the same single document.
RETAIN_HD bool all_allowed(const TileFilter& f, int64_t qb, int64_t kb) {
  if (is_rect(f)) {
    const DocRange &q = f.ranges[qb], &k = f.key_ranges[kb];
    return q.single && k.single && q.lo == k.lo;
  }
  return tile_all_allowed(f.ranges, qb, kb);
}

// The blocks a CTA's walk covers, as [lo, hi): for query block qb the key blocks from its
// span's start to the diagonal (a rectangle: all of them), for key block kb the query blocks
// from the diagonal to its span's end (a rectangle: all of them).
struct WalkRange {
  int64_t lo, hi;
};
RETAIN_HD WalkRange key_walk_range(const TileFilter& f, int64_t qb) {
  if (is_rect(f)) return {0, f.key_blocks};
  return {f.spans[qb].key_begin, qb + 1};
}
RETAIN_HD WalkRange query_walk_range(const TileFilter& f, int64_t kb) {
  if (is_rect(f)) return {0, f.query_blocks};
  return {kb, f.spans[kb].query_end};
}

// The next key block ≥ kb visited by query block qb, or key_walk_range(f, qb).hi (one
// sequence: qb + 1) when none is left.
RETAIN_HD int64_t next_key_block(const TileFilter& f, int64_t qb, int64_t kb) {
  const WalkRange r = key_walk_range(f, qb);
  if (kb < r.lo) kb = r.lo;
  while (kb < r.hi && !visits(f, qb, kb)) ++kb;
  return kb;
}

// The next query block ≥ qb that visits key block kb, or nb when none is left.
RETAIN_HD int64_t next_query_block(const TileFilter& f, int64_t nb, int64_t kb, int64_t qb) {
  const int64_t end = query_walk_range(f, kb).hi;
  while (qb < end && !visits(f, qb, kb)) ++qb;
  return qb < end ? qb : nb;
}

// The dk/dv walk for key block kb: every query head h of [h_begin, h_end) (a GQA group), and
// for each the query blocks visiting kb in increasing order, starting at
// first_qb = next_query_block(f, nb, kb, query_walk_range(f, kb).lo) (< nb: the walk is empty
// otherwise). The kernels take these walks on shared-memory bits (below); these are the
// definitions they are tested against.
// Returns the step after (h, qb); h == h_end marks the end.
struct HeadBlock {
  int h;
  int64_t qb;
};
RETAIN_HD HeadBlock next_head_block(const TileFilter& f, int64_t nb, int64_t kb, int64_t first_qb, HeadBlock at) {
  const int64_t qb = next_query_block(f, nb, kb, at.qb + 1);
  if (qb < nb) return {at.h, qb};
  return {at.h + 1, first_qb};
}

// ---- a CTA's walk as bits in shared memory ------------------------------------------------
// Deciding visits() tile by tile inside the loop put a chain of dependent global loads (the
// span, both blocks' ranges, the skip's maximum) in front of every tile, with every warp of
// the CTA waiting on it. Instead a CTA sets, once, two bits per block it may meet: `visit`
// (visits()) and `full` (tile_all_allowed), in shared words; the loop then finds its next
// block with one shared load and a count of trailing zeros. Bit b lives in word b / 32.
//   query side (forward, dq; query block qb): bit kb for kb ∈ key_walk_range(f, qb);
//   key side (dk/dv; key block kb): bit qb for qb ∈ query_walk_range(f, kb).
// key_walk_range / query_walk_range give [lo, hi); walk_bits the two bits of one block.
RETAIN_HD int64_t walk_words(int64_t nb) { return (nb + 31) / 32; }
struct WalkBits {
  bool visit, full;
};
RETAIN_HD WalkBits walk_bits(const TileFilter& f, int64_t qb, int64_t kb) {
  const bool visit = visits(f, qb, kb);
  return {visit, visit && all_allowed(f, qb, kb)};
}

RETAIN_HD int count_trailing_zeros(uint32_t w) {  // w ≠ 0
#if defined(__CUDA_ARCH__)
  return __ffs(w) - 1;
#else
  return __builtin_ctz(w);
#endif
}

// The first set bit b ≥ from with b < end, or end when there is none (from ≥ the walk's lo).
RETAIN_HD int64_t next_walk_bit(const uint32_t* bits, int64_t from, int64_t end) {
  while (from < end) {
    const uint32_t w = bits[from / 32] >> (from % 32);
    if (w != 0) {
      const int64_t b = from + count_trailing_zeros(w);
      return b < end ? b : end;
    }
    from = (from / 32 + 1) * 32;
  }
  return end;
}
RETAIN_HD bool walk_bit(const uint32_t* bits, int64_t b) { return (bits[b / 32] >> (b % 32)) & 1u; }

RETAIN_HD int count_leading_zeros(uint32_t w) {  // w ≠ 0
#if defined(__CUDA_ARCH__)
  return __clz(w);
#else
  return __builtin_clz(w);
#endif
}

// The last set bit b ≤ from with b ≥ lo, or lo − 1 when there is none (from < the walk's hi;
// lo ≥ 0). The forward walks its key blocks from the diagonal down with it (see forward_kernel).
RETAIN_HD int64_t prev_walk_bit(const uint32_t* bits, int64_t from, int64_t lo) {
  while (from >= lo) {
    const int shift = 31 - static_cast<int>(from % 32);
    const uint32_t w = bits[from / 32] << shift;  // bits ≤ from, at the top
    if (w != 0) {
      const int64_t b = from - count_leading_zeros(w);
      return b >= lo ? b : lo - 1;
    }
    from = from / 32 * 32 - 1;
  }
  return lo - 1;
}

// next_head_block on a key block's walk (r = query_walk_range, first_qb its first set bit).
RETAIN_HD HeadBlock next_walk_head_block(const uint32_t* visit, WalkRange r, int64_t first_qb, HeadBlock at) {
  const int64_t qb = next_walk_bit(visit, at.qb + 1, r.hi);
  if (qb < r.hi) return {at.h, qb};
  return {at.h + 1, first_qb};
}

// The pair (t, i) enters the softmax: causal, same document, not padding. doc_t / doc_i are
// the ids of tokens t and i, or -1 for a row beyond T (a short last block), so an out-of-range
// token is never allowed (doc_t ≥ 0 is required, and doc_i = -1 never equals it).
RETAIN_HD bool pair_allowed(int64_t t, int64_t i, int32_t doc_t, int32_t doc_i) {
  return i <= t && doc_t >= 0 && doc_i == doc_t;
}

// The decay term (t − i)·logβ_i of an allowed pair, in whatever units lb is given. t − i is
// exact in float (T < 2^24). The i = t term is exactly 0, also for logβ = −inf (0·−inf would
// be NaN).
RETAIN_HD float decay(int64_t t, int64_t i, float lb) {
  return t > i ? static_cast<float>(t - i) * lb : 0.0f;
}

// ---- shared memory layout --------------------------------------------------------------
// A tile of kBlock rows × d bf16 values is stored as rows of d/8 16-byte chunks, chunk c of
// row r at chunk slot r·(d/8) + (c ^ (r % 8)). ldmatrix reads one 16-byte chunk from each of
// 8 consecutive rows at the same logical chunk: the XOR puts them in 8 different slots mod 8,
// i.e. 8 disjoint groups of 4 banks, so the read is conflict-free; cp.async writes whole
// chunks, a row's chunks being a permutation of the row's slots. d/8 ≥ 8 (d ≥ 64), so the
// XOR stays inside the row.
RETAIN_HD int swizzled_chunk(int row, int chunk, int chunks_per_row) {
  return row * chunks_per_row + (chunk ^ (row & 7));
}

// ---- mma.sync.m16n8k16 (bf16 in, fp32 accumulate) fragments ----------------------------
// PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type": with
// group = lane / 4 and quad = lane % 4,
//   C/D (16×8 fp32, 4 regs): c_e holds row group + 8·(e / 2), column 2·quad + (e % 2).
//   A (16×16 bf16, 4 regs of 2 values): a_j holds row group + 8·(j % 2),
//       columns 2·quad + 8·(j / 2) + {0, 1}.
//   B (16×8 bf16, 2 regs of 2 values): b_j holds rows 2·quad + 8·j + {0, 1}, column group.
RETAIN_HD int c_row(int lane, int e) { return lane / 4 + 8 * (e / 2); }
RETAIN_HD int c_col(int lane, int e) { return 2 * (lane % 4) + (e % 2); }
RETAIN_HD int a_row(int lane, int j) { return lane / 4 + 8 * (j % 2); }
RETAIN_HD int a_col(int lane, int j, int half) { return 2 * (lane % 4) + 8 * (j / 2) + half; }
RETAIN_HD int b_row(int lane, int j, int half) { return 2 * (lane % 4) + 8 * j + half; }
RETAIN_HD int b_col(int lane) { return lane / 4; }

// The scores of a row-block against 16 keys are two C fragments (n-tiles 2s and 2s + 1);
// as the A operand of the next product (keys become the k dimension) they are exactly the
// A fragment of k-step s: a_0 = C(2s)[0,1], a_1 = C(2s)[2,3], a_2 = C(2s+1)[0,1],
// a_3 = C(2s+1)[2,3]. c_to_a_* says which C fragment and which pair feed a_j.
RETAIN_HD int c_to_a_ntile(int s, int j) { return 2 * s + j / 2; }
RETAIN_HD int c_to_a_pair(int j) { return j % 2; }  // 0: elements 0,1; 1: elements 2,3

// ---- ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16 ----------------------------------
// Lanes 8m..8m+7 give the row addresses of 8×8 matrix m (row lane % 8); register m of
// every lane receives from matrix m row lane / 4, elements 2·(lane % 4) + {0, 1} — or with
// .trans, column lane / 4, rows 2·(lane % 4) + {0, 1}.
// Two address patterns cover every operand of the kernels (tile rows = tokens, chunks =
// 8 head dims; row0 / chunk0 = the 16×16 sub-tile's corner):
//   pattern_a: matrix m = (rows row0 + 8·(m % 2), chunk chunk0 + m / 2). Without .trans the
//     4 registers are the A fragment of a 16×16 (rows × dims) sub-tile; with .trans, for a
//     (keys × dims) sub-tile used as B = [k = key][n = dim], registers {0, 1} are the B
//     fragment of dims chunk0·8..+7 and {2, 3} that of the next 8 dims.
//   pattern_b: matrix m = (rows row0 + 8·(m / 2), chunk chunk0 + m % 2), without .trans: for
//     a (keys × dims) sub-tile used as B = [k = dim][n = key], registers {0, 1} are the B
//     fragment of keys row0..+7 and {2, 3} that of keys row0 + 8..+15.
RETAIN_HD int ldsm_a_row(int lane) { return (lane % 8) + 8 * ((lane / 8) % 2); }
RETAIN_HD int ldsm_a_chunk(int lane) { return lane / 16; }
RETAIN_HD int ldsm_b_row(int lane) { return (lane % 8) + 8 * (lane / 16); }
RETAIN_HD int ldsm_b_chunk(int lane) { return (lane / 8) % 2; }

// This lane's ldmatrix addresses in a swizzled tile of kBlock × D bf16 (D ≥ 64), as byte
// offsets from the tile's start, for one of the patterns above (row(lane), chunk(lane)):
// rows r0 + row(lane), chunks 2k + chunk(lane), k < D/16, with r0 a multiple of 8. Then
// row % 8 = row(lane) % 8 and (2k + chunk) ^ (row % 8) = 8·(k / 4) + ((2·(k % 4) + chunk) ^
// row(lane) % 8): the lane part takes four values, worked out once per CTA; the rest is
// r0·2D + 128·(k / 4), a compile-time constant wherever r0 is. The kernels' tile loops paid a
// swizzle, an OR and two multiply-adds per ldmatrix before (kernels/cuda/sass_report.py).
template <int D>
struct LdsmLane {
  static_assert(D % 64 == 0, "the swizzle XOR stays inside a row of ≥ 8 chunks");
  uint32_t off[4];
  RETAIN_HD LdsmLane(int row, int chunk) {
    for (int j = 0; j < 4; ++j) off[j] = static_cast<uint32_t>(swizzled_chunk(row, 2 * j + chunk, D / 8) * 16);
  }
  RETAIN_HD uint32_t at(int r0, int k) const {
    return off[k % 4] + static_cast<uint32_t>(r0 * 2 * D + 128 * (k / 4));
  }
};

}  // namespace retain::cuda::tiles
