// CUDA retention-gated attention, forward and backward (DESIGN §4; the CPU reference is
// kernels/cpu/gated_attention.cpp, whose tiling this follows). FlashAttention-2 structure:
//
//   forward   one CTA per (query block, query head): Q in registers, K/V tiles streamed
//             through a 2-stage cp.async pipeline, online softmax in registers, out in bf16
//             and the row log-sum-exp in fp32.
//   backward  delta:  D[t, h] = Σ_j dout·out (fp32), one warp per row.
//             dk/dv:  one CTA per (key block, KV head), over the group's query heads and
//                     the query blocks at or after it; dk, dv, dlogβ accumulate in registers
//                     (so GQA needs no atomics: one CTA owns a key block's gradients).
//             dq:     one CTA per (query block, query head), over key blocks, like the
//                     forward. A separate kernel instead of FA2's fp32 atomics: it recomputes
//                     S and dP (7 tile products per tile pair instead of 5) but is
//                     deterministic, needs no fp32 scratch and no conversion pass.
//
// Each kernel has a twin on Hopper's wgmma (forward_wgmma_kernel, dq_wgmma_kernel,
// dkdv_wgmma_kernel; RETAIN_ATTENTION_FORWARD / RETAIN_ATTENTION_BACKWARD=wgmma, sm_90): the
// same algorithm and lane code with the products as warpgroup instructions (see there).
//
// Blocks are kBlock = 64 tokens and CTAs have 4 warps (the wgmma forward 8: two query blocks,
// one per warpgroup); warp w owns rows 16w..16w+15 of the CTA's (warpgroup's) block (query
// rows in forward/dq, key rows in dk/dv), i.e. one m16 row-block of every mma. Tiles above
// the diagonal and tiles whose blocks share no document id are never visited (the per-block
// document ranges come from a small kernel, and each CTA starts and
// ends its walk at its block's span, kernels/cuda/block_spans.h); tiles strictly below the
// diagonal inside one document skip the per-pair mask. Scores are kept in base-2 units
// (multiplied by log2 e) so that exp is one ex2. Index math lives in attention_tiles.h and is
// unit-tested on the host (tests/cuda/test_attention_tiles.cpp).
//
// Numerics: bf16 operands, fp32 accumulators, P and dS rounded to bf16 before their products
// (as FlashAttention-2); the softmax statistics, D, dS (for dlogβ) stay fp32; dlogβ is summed
// in fp32 within a tile and in fp64 across tiles.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "kernels/cuda/attention_lane.h"
#include "kernels/cuda/attention_tiles.h"
#include "kernels/cuda/block_spans_cuda.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/ops.h"
#include "kernels/cuda/retention_cuda.h"
#include "kernels/cuda/span_pair.h"
#include "kernels/cuda/wgmma.cuh"

namespace retain::cuda {

namespace {

using namespace tiles;
using bf16 = __nv_bfloat16;
using ptx::cp_async_16;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::ldmatrix_x4_at;
using ptx::ldmatrix_x4_trans_at;
using ptx::smem_base;
using ptx::SmemBase;
using ptx::mma_bf16_16816;
using ptx::pack_bf16;

constexpr float kNegInf = -INFINITY;

// One sequence: queries and keys are the same T tokens (Tk = T, k_doc = doc, gap 0). A span pair
// (kernels/retention_spans.h; gated_attention_span below): T queries against Tk keys of the
// same sequence, either the same tokens or a span wholly before them (a rectangle: k_ranges
// set), a query's position being its index + gap, a key's its index; the span forward writes
// out32, the span backward reads out32 and adds to dq32, dk32, dv32 and dlog_beta.
struct Params {
  const bf16* q;         // [T, H, d]
  const bf16* k;         // [Tk, K, d]
  const bf16* v;         // [Tk, K, d]
  const float* log_beta; // [Tk, K]
  const int32_t* doc;    // [T]  the queries' documents
  const int32_t* k_doc;  // [Tk] the keys' documents (one sequence: doc)
  const DocRange* ranges;  // [nb] the query blocks' (one sequence: every block's)
  const DocRange* k_ranges;  // [nkb] a rectangle's key blocks, or nullptr
  const spans::BlockSpan* spans;  // [nb] (kernels/cuda/block_spans.h)
  const float* lbmax;      // [nb, K] per-block max logβ, or nullptr: no weight skip (exact)
  float log_eps;           // the weight skip's log ε (when lbmax is set)
  bf16* out;             // [T, H, d]   forward
  float* lse;            // [T, H]      forward output, backward input
  const bf16* dout;      // [T, H, d]   backward
  const float* delta;    // [T, H]      backward: D = Σ_j dout·out
  bf16* dq;              // [T, H, d]
  bf16* dk;              // [T, K, d]
  bf16* dv;              // [T, K, d]
  float* dlog_beta;      // [Tk, K]
  float* out32;          // span forward: out F32 [T, H, d] (instead of out); span backward: read
  float* dq32;           // span backward: F32 sums added to (instead of dq, dk, dv stored), and
  float* dk32;           //   dlog_beta added to
  float* dv32;
  int64_t T, Tk;
  int64_t gap;           // a query's position minus its index (a rectangle: q_start − k_start)
  int H, K, group, nb, nkb;
  int walk_nb;           // max(nb, nkb): the walk bits' length
  float scale;   // head_dim^-0.5 (or the caller's)
  float scale2;  // scale · log2 e
};

// ---- block-level helpers -----------------------------------------------------------------

// Copies rows [row0, row0 + kBlock) of a [rows, stride] bf16 matrix (columns [0, D) of each
// row, starting at `base`) into a swizzled smem tile with cp.async. Rows at or past `valid` (a
// short last block) are zero-filled, reading row row0 instead (valid ≥ 1 always).
// Thread x copies the 16-byte chunk x % (D/8) of rows x / (D/8) + j·kRowStep, j < kPerThread.
// kRowStep is a multiple of 8, so the swizzle (chunk ^ row % 8) is the same for all of a
// thread's rows and its destinations are one slot plus j·kThreads chunks: the addresses are
// worked out once per CTA and advance by constants, instead of a division, a swizzle and a
// 64-bit row product per chunk in the tile loop (which made the copies cost about as many
// instructions as the tile's mma.sync did, kernels/cuda/sass_report.py).
//
// kPanels selects the layout wgmma reads (wgmma_layout.h): 64-column panels of 128-byte
// swizzled rows instead of whole D-column rows; the same for D = 64. kCopyThreads: the CTA's
// threads, all of which copy.
template <int D, bool kPanels = false, int kCopyThreads = kThreads>
struct TileCopy {
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static constexpr int kRowStep = kCopyThreads / kChunks;
  static constexpr int kPerThread = kBlock / kRowStep;
  static_assert(kCopyThreads % kChunks == 0 && kRowStep % 8 == 0 && kBlock % kRowStep == 0,
                "each thread copies one chunk column of rows kRowStep apart, all with one swizzle");
  // Elements between a thread's destinations (kRowStep rows of a row or of a panel).
  static constexpr int kDestStep = kRowStep * (kPanels ? wgmma::kPanelCols : D);
  int row;   // this thread's first row of the tile
  int col;   // its column (elements): 8 · chunk
  int slot;  // element offset of its first destination chunk in a tile

  __device__ __forceinline__ TileCopy()
      : row(static_cast<int>(threadIdx.x) / kChunks),
        col(8 * (static_cast<int>(threadIdx.x) % kChunks)),
        slot(kPanels ? static_cast<int>(wgmma::tile_offset(kBlock, row, col) / 2)
                     : 8 * swizzled_chunk(row, static_cast<int>(threadIdx.x) % kChunks, kChunks)) {}

  __device__ __forceinline__ void operator()(bf16* tile, const bf16* base, int64_t stride, int64_t row0,
                                             int valid) const {
    const bf16* first = base + row0 * stride + col;  // row row0: the read of zero-filled rows
    const bf16* src = first + row * stride;
    const int64_t step = kRowStep * stride;
    if (valid == kBlock) {  // every block but a short last one: no per-chunk test
#pragma unroll
      for (int j = 0; j < kPerThread; ++j, src += step) cp_async_16(tile + slot + j * kDestStep, src, true);
      return;
    }
#pragma unroll
    for (int j = 0; j < kPerThread; ++j, src += step) {
      const bool in = row + j * kRowStep < valid;
      cp_async_16(tile + slot + j * kDestStep, in ? src : first, in);
    }
  }
};

// This lane's ldmatrix offsets in both patterns, set once per CTA (attention_tiles.h LdsmLane):
// `a` for A operands and .trans B operands, `b` for B operands without .trans.
template <int D>
struct LaneLdsm {
  LdsmLane<D> a, b;
  __device__ __forceinline__ explicit LaneLdsm(int lane)
      : a(ldsm_a_row(lane), ldsm_a_chunk(lane)), b(ldsm_b_row(lane), ldsm_b_chunk(lane)) {}
};

// acc[NT][4] += A(16 rows of `a_tile` from a_row0, all D dims) · B, where B's columns are the
// NT·8 rows of `b_tile` from b_row0 (B = [k = dim][n = row]): S = Q·Kᵀ-shaped products.
// A via ldmatrix (pattern a), B via ldmatrix without .trans (pattern b); rows multiples of 16.
template <int D, int NT>
__device__ __forceinline__ void rows_times_rows_t(float (&acc)[NT][4], SmemBase a_tile, int a_row0, SmemBase b_tile,
                                                  int b_row0, const LaneLdsm<D>& ln) {
  static_assert(NT % 2 == 0, "n-tiles come in pairs (16 rows of B per ldmatrix.x4)");
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t a[4];
    ldmatrix_x4_at(a, a_tile, ln.a.at(a_row0, ks));
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4_at(b, b_tile, ln.b.at(b_row0 + 16 * np, ks));
      mma_bf16_16816(acc[2 * np], a, b[0], b[1]);
      mma_bf16_16816(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// Same with A held in registers (the forward's Q fragments, qf[ks] = k-step ks).
template <int D, int NT>
__device__ __forceinline__ void frags_times_rows_t(float (&acc)[NT][4], const uint32_t (&qf)[D / 16][4],
                                                   SmemBase b_tile, int b_row0, const LaneLdsm<D>& ln) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4_at(b, b_tile, ln.b.at(b_row0 + 16 * np, ks));
      mma_bf16_16816(acc[2 * np], qf[ks], b[0], b[1]);
      mma_bf16_16816(acc[2 * np + 1], qf[ks], b[2], b[3]);
    }
  }
}

// acc[D/8][4] += W · B where W (16 × NT·8, fp32 C fragments, rounded to bf16 here) is the
// left operand with its columns as the k dimension, and B = rows b_row0.. b_row0 + NT·8 of
// `b_tile` ([k = row][n = dim], ldmatrix .trans, pattern a): P·V, dS·K, Pᵀ·dO, dSᵀ·Q.
//
// k-step s of such a W as an A fragment: columns 16s..16s+15 of the fp32 C fragments, rounded
// to bf16 (the same registers feed mma.sync and wgmma's register A).
template <int NT>
__device__ __forceinline__ void c_to_a_fragment(const float (&w)[NT][4], int s, uint32_t (&a)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float(&c)[4] = w[c_to_a_ntile(s, j)];
    a[j] = c_to_a_pair(j) == 0 ? pack_bf16(c[0], c[1]) : pack_bf16(c[2], c[3]);
  }
}

template <int D, int NT>
__device__ __forceinline__ void weights_times_rows(float (&acc)[D / 8][4], const float (&w)[NT][4], SmemBase b_tile,
                                                   int b_row0, const LaneLdsm<D>& ln) {
#pragma unroll
  for (int s = 0; s < NT / 2; ++s) {  // k-step s: columns 16s..16s+15 of W
    uint32_t a[4];
    c_to_a_fragment(w, s, a);
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];
      ldmatrix_x4_trans_at(b, b_tile, ln.a.at(b_row0 + 16 * s, dp));
      mma_bf16_16816(acc[2 * dp], a, b[0], b[1]);
      mma_bf16_16816(acc[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ double quad_sum(double x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Two adjacent output values: rounded to bf16 (the one-sequence outputs), or F32 stored or, with
// kAdd, added to what the pair holds (a span pair's partial outputs and gradient sums).
template <bool kAdd>
__device__ __forceinline__ void put_pair(bf16* at, float a, float b) {
  static_assert(!kAdd, "bf16 outputs are stored, never summed");
  *reinterpret_cast<__nv_bfloat162*>(at) = __floats2bfloat162_rn(a, b);
}
template <bool kAdd>
__device__ __forceinline__ void put_pair(float* at, float a, float b) {
  float2* p = reinterpret_cast<float2*>(at);
  if (kAdd) {
    const float2 old = *p;
    a += old.x;
    b += old.y;
  }
  *p = make_float2(a, b);
}

// Writes a warp's 16 × D fp32 fragment rows (times `mul`) to rows `row[x]` of a [rows, stride]
// matrix starting at `base` (x = 0: this lane's first row, 1: row + 8), for rows whose `ok[x]`
// holds: as bf16, or as F32 (added to with kAdd: each row belongs to one CTA, so no other
// thread touches it meanwhile).
template <int D, bool kAdd = false, typename Out>
__device__ __forceinline__ void store_rows(Out* base, int64_t stride, const int64_t (&row)[2], const bool (&ok)[2],
                                           const float (&acc)[D / 8][4], const float (&mul)[2], int lane) {
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    if (!ok[x]) continue;
    Out* dst = base + row[x] * stride + c_col(lane, 0);
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
      put_pair<kAdd>(dst + 8 * nt, acc[nt][2 * x] * mul[x], acc[nt][2 * x + 1] * mul[x]);
  }
}

// Shared memory of the kernels, in bf16 tiles of kBlock × D plus per-stage float/int rows.
template <int D>
constexpr size_t tile_bytes() {
  return sizeof(bf16) * kBlock * D;
}
// The CTA's walk (attention_tiles.h): visit and full bits of nb blocks.
inline size_t walk_bytes(int64_t nb) { return 2 * sizeof(uint32_t) * static_cast<size_t>(walk_words(nb)); }
// StagedSmem's bytes (below): `held` tiles, two tiles in two stages, two float rows and the
// documents in two stages, the walk.
template <int D>
size_t staged_smem(int held, int64_t nb) {
  return tile_bytes<D>() * (held + 4) + 2 * kBlock * (2 * sizeof(float) + sizeof(int32_t)) + walk_bytes(nb);
}

// Sets the walk bits of blocks [r.lo, r.hi) in shared memory: warp w takes words w, w + kWarps,
// ..., a lane one block (bits(b) → WalkBits), a word by ballot. The caller's barrier follows.
// All the blocks' global loads are issued side by side here, once per CTA, instead of one
// dependent chain per tile in the loop.
template <typename Bits>
__device__ __forceinline__ void fill_walk(uint32_t* visit, uint32_t* full, WalkRange r, Bits bits) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t w = r.lo / 32 + warp; 32 * w < r.hi; w += kWarps) {  // warp-uniform trip count
    const int64_t b = 32 * w + lane;
    WalkBits x{false, false};
    if (b >= r.lo && b < r.hi) x = bits(b);
    const uint32_t v = __ballot_sync(0xffffffffu, x.visit), a = __ballot_sync(0xffffffffu, x.full);
    if (lane == 0) {
      visit[w] = v;
      full[w] = a;
    }
  }
}

// What a query-side CTA stages per key of a tile (thread c < kBlock: key i0 + c), fetched from
// global memory when the tile's copies are issued and written to shared memory only after the
// current tile's math, so the loads' latency hides behind it.
struct KeyRow {
  float log_beta = 0.0f;  // 0 past T (staged as lb2 = 0)
  int32_t doc = -1;
};
// The same for a key-side CTA (thread c: query q0 + c of query head h).
struct QueryRow {
  float lse = kNegInf;  // −inf past T (staged as 0)
  float delta = 0.0f;
  int32_t doc = -1;
};

// A query-side CTA's key stages (forward, dq): K and V tiles, and per key lb2, −c·lb2, doc.
template <int D>
struct KeyStages {
  bf16* k;
  bf16* v;
  float* lb2;
  float* ncl;
  int32_t* doc;

  // Issues the copies of key block kb (KV head kv) into `stage`; returns this thread's key row.
  template <class Copy>
  __device__ __forceinline__ KeyRow fetch(const Params& p, const Copy& copy_tile, int kv, int64_t kb,
                                          int stage) const {
    const int64_t i0 = block_begin(kb);
    const int nk = static_cast<int>(block_size(p.Tk, kb));
    copy_tile(k + stage * kBlock * D, p.k + kv * D, int64_t{p.K} * D, i0, nk);
    copy_tile(v + stage * kBlock * D, p.v + kv * D, int64_t{p.K} * D, i0, nk);
    KeyRow r;
    const int c = threadIdx.x;
    if (c < nk) {  // nk ≤ kBlock ≤ kThreads
      r.log_beta = p.log_beta[(i0 + c) * p.K + kv];
      r.doc = p.k_doc[i0 + c];
    }
    return r;
  }
  __device__ __forceinline__ void store(const KeyRow& r, int stage) const {
    const int c = threadIdx.x;
    if (c < kBlock) {
      const float b = staged_lb2(r.log_beta);
      lb2[stage * kBlock + c] = b;
      ncl[stage * kBlock + c] = staged_neg_c_lb2(c, b);
      doc[stage * kBlock + c] = r.doc;
    }
  }
};
static_assert(kBlock <= kThreads, "one thread stages one key or query of a tile");

// The tile tables of KV head kv (attention_tiles.h TileFilter): document ranges, block spans
// and, with the weight skip, the head's per-block largest logβ.
__device__ __forceinline__ TileFilter tile_filter(const Params& p, int kv) {
  if (p.k_ranges) return rect_tiles(p.ranges, p.nb, p.k_ranges, p.nkb);
  return {p.ranges, p.spans, p.lbmax ? p.lbmax + kv : nullptr, p.K, p.log_eps};
}

// ---- small kernels -----------------------------------------------------------------------

__global__ void doc_ranges_kernel(const int32_t* doc, int64_t T, int64_t nb, DocRange* ranges) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < nb) ranges[b] = block_doc_range(doc, T, b);
}

// ranges[b] = block_doc_range of doc I32 [T]'s nb blocks.
void doc_ranges(const Tensor& doc, int64_t nb, DocRange* ranges) {
  const int threads = 128;
  doc_ranges_kernel<<<static_cast<unsigned>((nb + threads - 1) / threads), threads>>>(doc.data<int32_t>(), doc.dim(0),
                                                                                      nb, ranges);
  CUDA_CHECK(cudaGetLastError());
}

// lbmax[b, kv] = block_max_log_beta (the optional weight skip), one thread per entry.
__global__ void lbmax_kernel(const float* log_beta, const int32_t* doc, int64_t T, int64_t K, int64_t nb,
                             float* lbmax) {
  const int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (x < nb * K) lbmax[x] = block_max_log_beta(log_beta, doc, T, K, x / K, x % K);
}

// D[row] = Σ_j dout[row, j]·out[row, j] over rows of length d (even), one warp per row; out in
// bf16 (one sequence) or F32 (a span pair's merged rows).
__device__ __forceinline__ float2 two_floats(const bf16* x) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(x));
}
__device__ __forceinline__ float2 two_floats(const float* x) { return *reinterpret_cast<const float2*>(x); }
template <typename Out>
__global__ void delta_kernel(const Out* out, const bf16* dout, float* delta, int64_t rows, int d) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps leave together (row is warp-uniform)
  float sum = 0.0f;
  for (int j = 2 * lane; j < d; j += 64) {
    const float2 o = two_floats(out + row * d + j);
    const float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dout + row * d + j));
    sum += o.x * g.x + o.y * g.y;
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) delta[row] = sum;
}

// ---- forward -----------------------------------------------------------------------------

// A lane's two query rows in a forward CTA (fragment rows group and group + 8 of its warp's
// row-block): token, its position (the token + p.gap), document (−1 past the block's nq rows)
// and whether it is a row.
struct ForwardRows {
  int64_t t[2];
  int64_t pos[2];
  int32_t doc_t[2];
  bool in_t[2];
  __device__ __forceinline__ ForwardRows(const Params& p, int64_t q0, int nq, int warp, int lane) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const int r = warp * kRowsPerWarp + c_row(lane, 2 * x);
      t[x] = q0 + r;
      pos[x] = t[x] + p.gap;
      in_t[x] = r < nq;
      doc_t[x] = in_t[x] ? p.doc[t[x]] : -1;
    }
  }
};

// The end of a forward: out = o_acc / l in bf16 and the row's lse. Rows with no allowed key
// (padding, or past T) have l = 0: out 0, lse −inf.
template <int D>
__device__ __forceinline__ void finish_forward(const Params& p, const ForwardRows& q, int h, int lane, const float (&m)[2],
                                               const float (&l)[2], const float (&o_acc)[D / 8][4]) {
  float inv[2];
  int64_t row[2];
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    float lse;
    finish_row(quad_sum(l[x]), m[x], inv[x], lse);
    row[x] = q.t[x] * p.H + h;
    if (q.in_t[x] && lane % 4 == 0) p.lse[row[x]] = lse;
  }
  if (p.out32)
    store_rows<D>(p.out32, D, row, q.in_t, o_acc, inv, lane);
  else
    store_rows<D>(p.out, D, row, q.in_t, o_acc, inv, lane);
}

// One key tile of a forward: the raw scores s (q·k) become the tile's weights P in place —
// gated and masked logits (base 2), the online softmax against the running row max m and sum
// l — and o_acc is rescaled when some row's maximum rose (else α is exactly 1 and the 64
// multiplies per lane at d = 128 are skipped).
template <int D>
__device__ __forceinline__ void softmax_tile(float (&s)[kBlock / 8][4], const ForwardRows& rows, int lane,
                                             const KeyStages<D>& keys, int stage, int64_t i0, bool all_allowed,
                                             float scale2, float (&m)[2], float (&l)[2], float (&o_acc)[D / 8][4]) {
  query_row_logits(s, lane, rows.pos, rows.doc_t, i0, keys.lb2 + stage * kBlock, keys.ncl + stage * kBlock,
                   keys.doc + stage * kBlock, all_allowed, scale2);
  float mx[2], alpha[2];
  lane_row_max(s, mx);
#pragma unroll
  for (int x = 0; x < 2; ++x) mx[x] = quad_max(mx[x]);
  online_softmax_step(s, mx, m, l, alpha);
  if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[nt][e] *= alpha[e / 2];
  }
}

template <int D>
struct QueryStages;

// A CTA's shared memory from `base`, in the order the bytes lie (staged_smem counts them):
//   kHeld tiles kept for the CTA's life   forward: Q;  dq: Q, dO;  dk/dv: K, V
//   two tiles streamed in two stages      forward, dq: K, V (KeyStages);  dk/dv: Q, dO (QueryStages)
//   two float rows per stage              forward, dq: lb2, −c·lb2;  dk/dv: lse·log2e, D
//   the streamed rows' documents per stage, then the walk's visit and full bits.
// One layout for every attention CTA (the 128-row wgmma forward grows it): the backward twins
// differ only in which side stays put.
template <int D, int kHeld>
struct StagedSmem {
  bf16* held;              // [kHeld][kBlock × D]
  bf16 *tile0, *tile1;     // [2][kBlock × D] each
  float *row0, *row1;      // [2][kBlock] each
  int32_t* doc;            // [2][kBlock]
  uint32_t *visit, *full;  // [walk_words(nb)] each
  __device__ __forceinline__ StagedSmem(unsigned char* base, int64_t nb)
      : held(reinterpret_cast<bf16*>(base)),
        tile0(held + kHeld * kBlock * D),
        tile1(tile0 + 2 * kBlock * D),
        row0(reinterpret_cast<float*>(tile1 + 2 * kBlock * D)),
        row1(row0 + 2 * kBlock),
        doc(reinterpret_cast<int32_t*>(row1 + 2 * kBlock)),
        visit(reinterpret_cast<uint32_t*>(doc + 2 * kBlock)),
        full(visit + walk_words(nb)) {}
  __device__ __forceinline__ bf16* kept(int i) const { return held + i * kBlock * D; }
  __device__ __forceinline__ KeyStages<D> keys() const { return {tile0, tile1, row0, row1, doc}; }
  __device__ __forceinline__ QueryStages<D> queries() const { return {tile0, tile1, row0, row1, doc}; }
};
template <int D>
using ForwardSmem = StagedSmem<D, 1>;  // kept(0): Q
template <int D>
using DqSmem = StagedSmem<D, 2>;  // kept(0): Q, kept(1): dO
template <int D>
using DkdvSmem = StagedSmem<D, 2>;  // kept(0): K, kept(1): V

template <int D>
__global__ void __launch_bounds__(kThreads) forward_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const TileCopy<D> copy_tile;
  const ForwardSmem<D> sm(smem, p.walk_nb);

  const int64_t qb = p.nb - 1 - static_cast<int64_t>(blockIdx.x);  // the longest rows first
  const int h = blockIdx.y, kv = h / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const LaneLdsm<D> ldsm(lane);
  const int64_t q0 = block_begin(qb);
  const int nq = static_cast<int>(block_size(p.T, qb));

  const ForwardRows rows(p, q0, nq, warp, lane);
  const KeyStages<D> keys = sm.keys();
  const TileFilter tiles = tile_filter(p, kv);
  const WalkRange walk = key_walk_range(tiles, qb);
  fill_walk(sm.visit, sm.full, walk, [&](int64_t kb) { return walk_bits(tiles, qb, kb); });
  copy_tile(sm.kept(0), p.q + int64_t{h} * D, int64_t{p.H} * D, q0, nq);
  __syncthreads();  // the walk bits
  // Key blocks from the diagonal down: the nearest keys, whose weights decay least, usually
  // hold a row's maximum, so later tiles rarely raise it and the rescale of the output
  // accumulator (64 multiplies per tile and lane at d = 128) is skipped (see below).
  int64_t kb = prev_walk_bit(sm.visit, walk.hi - 1, walk.lo);
  if (kb >= walk.lo) keys.store(keys.fetch(p, copy_tile, kv, kb, 0), 0);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  uint32_t qf[D / 16][4];
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
    ldmatrix_x4_at(qf[ks], smem_base(sm.kept(0)), ldsm.a.at(warp * kRowsPerWarp, ks));

  float o_acc[D / 8][4] = {};
  float m[2] = {kNegInf, kNegInf};  // running row max (base-2 units); -inf: nothing seen yet
  float l[2] = {0.0f, 0.0f};        // running row sum of this lane's columns, relative to m
  int stage = 0;
  while (kb >= walk.lo) {
    const int64_t kb_next = prev_walk_bit(sm.visit, kb - 1, walk.lo);
    const bool prefetch = kb_next >= walk.lo;
    KeyRow next_row;
    if (prefetch) next_row = keys.fetch(p, copy_tile, kv, kb_next, stage ^ 1);  // stage ^ 1: freed by the last barrier
    cp_async_commit();
    cp_async_wait<1>();  // everything but the group just committed: this stage has landed
    __syncthreads();     // ... for every thread, and the plain stores of the staged key rows too

    const bf16* k_s = keys.k + stage * kBlock * D;
    const bf16* v_s = keys.v + stage * kBlock * D;

    float s[kBlock / 8][4] = {};
    frags_times_rows_t<D, kBlock / 8>(s, qf, smem_base(k_s), 0, ldsm);

    softmax_tile(s, rows, lane, keys, stage, block_begin(kb), walk_bit(sm.full, kb), p.scale2, m, l, o_acc);
    weights_times_rows<D, kBlock / 8>(o_acc, s, smem_base(v_s), 0, ldsm);

    if (prefetch) keys.store(next_row, stage ^ 1);
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
    kb = kb_next;
    stage ^= 1;
  }

  finish_forward<D>(p, rows, h, lane, m, l, o_acc);
}

// ---- forward on Hopper's wgmma (RETAIN_ATTENTION_FORWARD=wgmma) -------------------------
//
// forward_kernel's algorithm and register layouts with its two products on wgmma: a
// warpgroup's 4 warps own a 64-row query block as forward_kernel's CTA does, and a warp's share
// of an m64nN product is exactly its mma.sync fragments (16 rows × N as N/8 m16n8 tiles), so
// the masking, gating and online softmax are the same code. S = Q·Kᵀ takes Q and K from shared
// memory (K-major; wgmma_rows_times_rows_t says why not Q from registers), O += P·V takes P
// from registers and V from shared memory (MN-major); no ldmatrix, one instruction per 16-deep
// step for the warpgroup. Tiles are in wgmma's 128-byte-swizzled panel layout at 1,024-aligned
// addresses. Loads stay on cp.async (2 stages), each thread's copies made visible to wgmma's
// async proxy before the barrier. On an H200 (docs/gpu-ledger.md) d = 128 passed from the first
// run, d = 64 once Q left the registers (wgmma_rows_times_rows_t).
//
// Every wgmma kernel starts its shared memory at the first 1,024-aligned byte (wgmma_smem_pad),
// so every tile stays aligned, tile_bytes being a multiple; the launches add kWgmmaSmemPad of
// room to the layout (for dq and dk/dv the mma.sync twin's, the forward's its own).
constexpr size_t kWgmmaSmemPad = wgmma::kAtomBytes;
template <int D>
constexpr uint32_t kTileBytes = sizeof(bf16) * kBlock * D;  // tile_bytes<D>(), on the device
static_assert(kTileBytes<64> % wgmma::kAtomBytes == 0 && kTileBytes<128> % wgmma::kAtomBytes == 0,
              "tiles stay 1,024-aligned");
// The bytes from the dynamic shared memory's start to its first 1,024-aligned byte.
__device__ __forceinline__ uint32_t wgmma_smem_pad(const unsigned char* smem) {
  const uint32_t raw = wgmma::smem_address(smem);
  return ((raw + wgmma::kAtomBytes - 1) & ~(wgmma::kAtomBytes - 1)) - raw;
}

// acc (the warpgroup's 64 rows × NT·8) = A·Bᵀ over D/16 k-steps, both operands 64-row tiles
// read K-major from shared memory (desc_a, desc_b: their descriptors at row 0, column 0):
// S = Q·Kᵀ-shaped products. Issued only; the caller fences, commits and waits.
// The held operand (Q; Q and dO in dq) is read from shared memory on every key tile, not kept in
// registers as wgmma's register A: on an H200 (2026-11-28, nvcc 13.0) ptxas gave the registers
// of a Q held across the key loop to the same iteration's P (and dS) fragments at d = 64, so
// every key tile after the first multiplied by the last tile's weights (docs/gpu-ledger.md,
// the first kernels.gated-attention run); tests/cuda/test_sass_report.py --object fails a build
// whose loops carry a product's register operand that they also overwrite.
template <int D, int NT>
__device__ __forceinline__ void wgmma_rows_times_rows_t(float (&acc)[NT][4], uint64_t desc_a, uint64_t desc_b) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const uint64_t step = wgmma::k_major_step(kBlock, 0, 16 * ks);
    wgmma::mma_ss<false>(acc, desc_a + step, desc_b + step, ks > 0);
  }
}

// The weights W (fp32 C fragments of 64 rows × kBlock columns) as the register A operand of
// wgmma: k-step st is columns 16st..16st+15, rounded to bf16.
__device__ __forceinline__ void weights_to_a(const float (&w)[kBlock / 8][4], uint32_t (&a)[kBlock / 16][4]) {
#pragma unroll
  for (int st = 0; st < kBlock / 16; ++st) c_to_a_fragment(w, st, a[st]);
}

// acc (64 rows × D) += W·B with W from weights_to_a and B the kBlock × D tile at desc_b read
// MN-major (transposed): P·V, dS·K, Pᵀ·dO, dSᵀ·Q. Issued only, as above.
template <int NT>
__device__ __forceinline__ void wgmma_weights_times_rows(float (&acc)[NT][4], const uint32_t (&w)[kBlock / 16][4],
                                                         uint64_t desc_b) {
#pragma unroll
  for (int st = 0; st < kBlock / 16; ++st)
    wgmma::mma_rs<true>(acc, w[st], desc_b + wgmma::mn_major_step(kBlock, 16 * st, 0), true);
}

// The wgmma forward's CTA is two warpgroups over 128 query rows: warpgroup g takes query block
// 2·pair + g and both share each K/V tile, so every tile crosses from L2 to the SM once per
// 128 query rows instead of once per 64: at 32K tokens, 32 heads and d = 128 a 64-row forward
// moves ≈ 138 GB of K and V (4.2 M tiles of 32 KB) for 8.8 TFLOP, ≈ 9 TB/s at 600 TFLOP/s (an
// estimate from the tile counts, not a measurement); 128 rows halve it. The CTA walks the
// union of both blocks' key walks; a warpgroup whose own walk skips a tile (the other block's
// diagonal tile, another document) only helps copy it.
constexpr int kForwardGroups = 2;
constexpr int kForwardThreads = kForwardGroups * kThreads;
constexpr int kForwardWarps = kForwardGroups * kWarps;

// Its shared memory: StagedSmem with a Q tile per warpgroup (kept(g)), the walk bits grown from
// its visit and full to [visit 0][full 0][visit 1][full 1][any] (the union's visit bits).
template <int D>
size_t wgmma_forward_smem(int64_t nb) {
  return staged_smem<D>(kForwardGroups, nb) +
         sizeof(uint32_t) * static_cast<size_t>((2 * kForwardGroups - 1) * walk_words(nb)) + kWgmmaSmemPad;
}
template <int D>
struct WgmmaForwardSmem : StagedSmem<D, kForwardGroups> {
  int64_t words;  // walk_words(nb)
  __device__ __forceinline__ WgmmaForwardSmem(unsigned char* base, int64_t nb)
      : StagedSmem<D, kForwardGroups>(base, nb), words(walk_words(nb)) {}
  __device__ __forceinline__ uint32_t* group_visit(int g) const { return this->visit + 2 * g * words; }
  __device__ __forceinline__ uint32_t* group_full(int g) const { return this->visit + (2 * g + 1) * words; }
  __device__ __forceinline__ uint32_t* any() const { return this->visit + 2 * kForwardGroups * words; }
};

// Sets both warpgroups' walk bits over the union range `all` and the union's visit bits (as
// fill_walk, for kForwardWarps warps): warpgroup g's bits are its own walk's, `own[g]` (empty
// for a warpgroup past the last block), and none outside it.
template <int D>
__device__ __forceinline__ void fill_forward_walks(const WgmmaForwardSmem<D>& sm, const TileFilter& tiles,
                                                   WalkRange all, const WalkRange (&own)[kForwardGroups],
                                                   const int64_t (&qb)[kForwardGroups]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t w = all.lo / 32 + warp; 32 * w < all.hi; w += kForwardWarps) {  // warp-uniform trip count
    const int64_t b = 32 * w + lane;
    uint32_t any = 0;
#pragma unroll
    for (int g = 0; g < kForwardGroups; ++g) {
      WalkBits x{false, false};
      if (b >= own[g].lo && b < own[g].hi) x = walk_bits(tiles, qb[g], b);
      const uint32_t v = __ballot_sync(0xffffffffu, x.visit), a = __ballot_sync(0xffffffffu, x.full);
      any |= v;
      if (lane == 0) {
        sm.group_visit(g)[w] = v;
        sm.group_full(g)[w] = a;
      }
    }
    if (lane == 0) sm.any()[w] = any;
  }
}

template <int D>
__global__ void __launch_bounds__(kForwardThreads) forward_wgmma_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t pad = wgmma_smem_pad(smem);
  const TileCopy<D, true, kForwardThreads> copy_tile;
  const WgmmaForwardSmem<D> sm(smem + pad, p.walk_nb);
  const uint32_t aK = wgmma::smem_address(smem) + pad + kForwardGroups * kTileBytes<D>, aV = aK + 2 * kTileBytes<D>;

  const int64_t pairs = (p.nb + kForwardGroups - 1) / kForwardGroups;
  const int64_t pair = pairs - 1 - static_cast<int64_t>(blockIdx.x);  // the longest rows first
  const int h = blockIdx.y, kv = h / p.group;
  const int group = threadIdx.x / kThreads;  // this thread's warpgroup
  const int warp = (threadIdx.x % kThreads) / 32, lane = threadIdx.x % 32;  // warp within it

  // Both warpgroups' query blocks and walks (block 0 always exists; block 1 not past the end).
  const TileFilter tiles = tile_filter(p, kv);
  int64_t qbs[kForwardGroups];
  WalkRange own[kForwardGroups];
  WalkRange all{0, 0};  // the union; empty when neither block has a key (padding only)
#pragma unroll
  for (int g = 0; g < kForwardGroups; ++g) {
    qbs[g] = kForwardGroups * pair + g;
    own[g] = qbs[g] < p.nb ? key_walk_range(tiles, qbs[g]) : WalkRange{0, 0};
    if (own[g].lo >= own[g].hi) continue;
    all = all.lo < all.hi ? WalkRange{own[g].lo < all.lo ? own[g].lo : all.lo, own[g].hi > all.hi ? own[g].hi : all.hi}
                          : own[g];
  }
  const int64_t qb = kForwardGroups * pair + group;  // qbs[group] (a computed index would put qbs on the stack)
  const int64_t q0 = block_begin(qb);
  const int nq = qb < p.nb ? static_cast<int>(block_size(p.T, qb)) : 0;
  const ForwardRows rows(p, q0, nq, warp, lane);
  const uint32_t* visit = sm.group_visit(group);
  const uint32_t* full = sm.group_full(group);

  const KeyStages<D> keys = sm.keys();
  fill_forward_walks(sm, tiles, all, own, qbs);
#pragma unroll
  for (int g = 0; g < kForwardGroups; ++g)
    if (qbs[g] < p.nb)
      copy_tile(sm.kept(g), p.q + int64_t{h} * D, int64_t{p.H} * D, block_begin(qbs[g]),
                static_cast<int>(block_size(p.T, qbs[g])));
  cp_async_commit();  // Q (the loop's first wait covers it with the first key tile)
  __syncthreads();    // the walk bits
  int64_t kb = prev_walk_bit(sm.any(), all.hi - 1, all.lo);  // from the diagonal down, as forward_kernel
  if (kb >= all.lo) keys.store(keys.fetch(p, copy_tile, kv, kb, 0), 0);
  cp_async_commit();
  const uint64_t desc_q = wgmma::k_major_desc(wgmma::smem_address(sm.kept(group)), kBlock, 0, 0);

  float o_acc[D / 8][4] = {};
  float m[2] = {kNegInf, kNegInf};
  float l[2] = {0.0f, 0.0f};
  int stage = 0;
  while (kb >= all.lo) {
    const int64_t kb_next = prev_walk_bit(sm.any(), kb - 1, all.lo);
    const bool prefetch = kb_next >= all.lo;
    KeyRow next_row;
    if (prefetch) next_row = keys.fetch(p, copy_tile, kv, kb_next, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();          // this stage has landed for this thread ...
    wgmma::fence_proxy_async();  // ... and is visible to wgmma's reads
    __syncthreads();             // ... for every thread

    if (walk_bit(visit, kb)) {  // uniform over the warpgroup, whose wgmma are collective
      const uint32_t k_s = aK + static_cast<uint32_t>(stage) * kTileBytes<D>;
      const uint32_t v_s = aV + static_cast<uint32_t>(stage) * kTileBytes<D>;
      float s[kBlock / 8][4];
      wgmma::fence();
      wgmma_rows_times_rows_t<D>(s, desc_q, wgmma::k_major_desc(k_s, kBlock, 0, 0));  // Q·Kᵀ
      wgmma::commit_group();
      wgmma::wait_group<0>();
      wgmma::fence_operand(s);

      softmax_tile(s, rows, lane, keys, stage, block_begin(kb), walk_bit(full, kb), p.scale2, m, l, o_acc);
      uint32_t pa[kBlock / 16][4];
      weights_to_a(s, pa);
      wgmma::fence_operand(pa);
      wgmma::fence_operand(o_acc);
      wgmma::fence();
      wgmma_weights_times_rows(o_acc, pa, wgmma::mn_major_desc(v_s, kBlock, 0, 0));  // P·V
      wgmma::commit_group();
      wgmma::wait_group<0>();  // V's stage is read before the barrier below lets it be refilled
      wgmma::fence_operand(o_acc);
      wgmma::fence_operand(pa);
    }

    if (prefetch) keys.store(next_row, stage ^ 1);
    __syncthreads();
    kb = kb_next;
    stage ^= 1;
  }
  cp_async_wait<0>();

  finish_forward<D>(p, rows, h, lane, m, l, o_acc);
}

// ---- backward: dq ------------------------------------------------------------------------

// A lane's two query rows in a dq CTA: ForwardRows plus each row's lse (base 2) and D_t.
struct DqRows : ForwardRows {
  float lse2[2], delta[2];
  __device__ __forceinline__ DqRows(const Params& p, int64_t q0, int nq, int h, int warp, int lane)
      : ForwardRows(p, q0, nq, warp, lane) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      lse2[x] = lse_base2(in_t[x] ? p.lse[t[x] * p.H + h] : kNegInf);
      delta[x] = in_t[x] ? p.delta[t[x] * p.H + h] : 0.0f;
    }
  }
};

// The start of a dq CTA: the walk over key blocks, Q and dO copied (one commit group), the first
// key block's copies issued and committed (the next); returns the first key block to visit
// (walk.hi: none).
template <int D, class Copy>
__device__ __forceinline__ int64_t start_dq(const Params& p, const DqSmem<D>& sm, const Copy& copy_tile,
                                            const TileFilter& tiles, const WalkRange& walk, int64_t qb, int h,
                                            int kv) {
  const int64_t q0 = block_begin(qb);
  const int nq = static_cast<int>(block_size(p.T, qb));
  fill_walk(sm.visit, sm.full, walk, [&](int64_t kb) { return walk_bits(tiles, qb, kb); });
  copy_tile(sm.kept(0), p.q + int64_t{h} * D, int64_t{p.H} * D, q0, nq);
  copy_tile(sm.kept(1), p.dout + int64_t{h} * D, int64_t{p.H} * D, q0, nq);
  cp_async_commit();  // Q and dO (the loop's first wait covers them with the first key tile)
  __syncthreads();    // the walk bits
  const int64_t kb = next_walk_bit(sm.visit, walk.lo, walk.hi);
  if (kb < walk.hi) sm.keys().store(sm.keys().fetch(p, copy_tile, kv, kb, 0), 0);
  cp_async_commit();
  return kb;
}

// The end of a dq CTA: dq = scale · Σ dS·K in bf16 (no copy may still be in flight when the
// CTA exits: with no key block visited, Q and dO still are).
template <int D>
__device__ __forceinline__ void finish_dq(const Params& p, const DqRows& q, int h, int lane,
                                          const float (&dq_acc)[D / 8][4]) {
  cp_async_wait<0>();
  int64_t row[2];
  const float mul[2] = {p.scale, p.scale};
#pragma unroll
  for (int x = 0; x < 2; ++x) row[x] = q.t[x] * p.H + h;
  if (p.dq32)
    store_rows<D, true>(p.dq32, D, row, q.in_t, dq_acc, mul, lane);
  else
    store_rows<D>(p.dq, D, row, q.in_t, dq_acc, mul, lane);
}

template <int D>
__global__ void __launch_bounds__(kThreads) dq_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const TileCopy<D> copy_tile;
  const DqSmem<D> sm(smem, p.walk_nb);

  const int64_t qb = p.nb - 1 - static_cast<int64_t>(blockIdx.x);
  const int h = blockIdx.y, kv = h / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const LaneLdsm<D> ldsm(lane);
  const DqRows rows(p, block_begin(qb), static_cast<int>(block_size(p.T, qb)), h, warp, lane);
  const KeyStages<D> keys = sm.keys();
  const TileFilter tiles = tile_filter(p, kv);
  const WalkRange walk = key_walk_range(tiles, qb);
  int64_t kb = start_dq<D>(p, sm, copy_tile, tiles, walk, qb, h, kv);

  float dq_acc[D / 8][4] = {};
  int stage = 0;
  while (kb < walk.hi) {
    const int64_t kb_next = next_walk_bit(sm.visit, kb + 1, walk.hi);
    const bool prefetch = kb_next < walk.hi;
    KeyRow next_row;
    if (prefetch) next_row = keys.fetch(p, copy_tile, kv, kb_next, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    const bf16* k_s = keys.k + stage * kBlock * D;
    const bf16* v_s = keys.v + stage * kBlock * D;
    float s[kBlock / 8][4] = {};
    float dp[kBlock / 8][4] = {};
    rows_times_rows_t<D, kBlock / 8>(s, smem_base(sm.kept(0)), warp * kRowsPerWarp, smem_base(k_s), 0, ldsm);     // Q·Kᵀ
    rows_times_rows_t<D, kBlock / 8>(dp, smem_base(sm.kept(1)), warp * kRowsPerWarp, smem_base(v_s), 0, ldsm);  // dO·Vᵀ
    query_row_dscores(s, dp, lane, rows.pos, rows.doc_t, block_begin(kb), keys.lb2 + stage * kBlock,
                      keys.ncl + stage * kBlock, keys.doc + stage * kBlock, walk_bit(sm.full, kb), p.scale2,
                      rows.lse2, rows.delta);  // s = dS
    weights_times_rows<D, kBlock / 8>(dq_acc, s, smem_base(k_s), 0, ldsm);  // dS·K

    if (prefetch) keys.store(next_row, stage ^ 1);
    __syncthreads();
    kb = kb_next;
    stage ^= 1;
  }
  finish_dq<D>(p, rows, h, lane, dq_acc);
}

// dq_kernel on wgmma (RETAIN_ATTENTION_BACKWARD=wgmma, sm_90), as forward_wgmma_kernel is
// forward_kernel: S = Q·Kᵀ and dP = dO·Vᵀ from shared memory in one commit group, dS in the
// same registers by the same code, dq += dS·K with dS from registers and K read transposed.
// As the forward: on an H200 d = 128 passed from the first run, d = 64 once Q and dO left the
// registers.
template <int D>
__global__ void __launch_bounds__(kThreads) dq_wgmma_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t pad = wgmma_smem_pad(smem);
  const TileCopy<D, true> copy_tile;
  const DqSmem<D> sm(smem + pad, p.walk_nb);
  const uint32_t aK = wgmma::smem_address(smem) + pad + 2 * kTileBytes<D>, aV = aK + 2 * kTileBytes<D>;

  const int64_t qb = p.nb - 1 - static_cast<int64_t>(blockIdx.x);
  const int h = blockIdx.y, kv = h / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const DqRows rows(p, block_begin(qb), static_cast<int>(block_size(p.T, qb)), h, warp, lane);
  const KeyStages<D> keys = sm.keys();
  const TileFilter tiles = tile_filter(p, kv);
  const WalkRange walk = key_walk_range(tiles, qb);
  int64_t kb = start_dq<D>(p, sm, copy_tile, tiles, walk, qb, h, kv);
  const uint64_t desc_q = wgmma::k_major_desc(wgmma::smem_address(sm.kept(0)), kBlock, 0, 0);
  const uint64_t desc_do = wgmma::k_major_desc(wgmma::smem_address(sm.kept(1)), kBlock, 0, 0);

  float dq_acc[D / 8][4] = {};
  int stage = 0;
  while (kb < walk.hi) {
    const int64_t kb_next = next_walk_bit(sm.visit, kb + 1, walk.hi);
    const bool prefetch = kb_next < walk.hi;
    KeyRow next_row;
    if (prefetch) next_row = keys.fetch(p, copy_tile, kv, kb_next, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    wgmma::fence_proxy_async();
    __syncthreads();

    const uint32_t k_s = aK + static_cast<uint32_t>(stage) * kTileBytes<D>;
    const uint32_t v_s = aV + static_cast<uint32_t>(stage) * kTileBytes<D>;
    float s[kBlock / 8][4], dp[kBlock / 8][4];
    wgmma::fence();
    wgmma_rows_times_rows_t<D>(s, desc_q, wgmma::k_major_desc(k_s, kBlock, 0, 0));    // Q·Kᵀ
    wgmma_rows_times_rows_t<D>(dp, desc_do, wgmma::k_major_desc(v_s, kBlock, 0, 0));  // dO·Vᵀ
    wgmma::commit_group();
    wgmma::wait_group<0>();
    wgmma::fence_operand(s);
    wgmma::fence_operand(dp);

    query_row_dscores(s, dp, lane, rows.pos, rows.doc_t, block_begin(kb), keys.lb2 + stage * kBlock,
                      keys.ncl + stage * kBlock, keys.doc + stage * kBlock, walk_bit(sm.full, kb), p.scale2,
                      rows.lse2, rows.delta);  // s = dS
    uint32_t dsa[kBlock / 16][4];
    weights_to_a(s, dsa);
    wgmma::fence_operand(dsa);
    wgmma::fence_operand(dq_acc);
    wgmma::fence();
    wgmma_weights_times_rows(dq_acc, dsa, wgmma::mn_major_desc(k_s, kBlock, 0, 0));  // dS·K
    wgmma::commit_group();
    wgmma::wait_group<0>();  // K's stage is read before the barrier below lets it be refilled
    wgmma::fence_operand(dq_acc);
    wgmma::fence_operand(dsa);

    if (prefetch) keys.store(next_row, stage ^ 1);
    __syncthreads();
    kb = kb_next;
    stage ^= 1;
  }
  finish_dq<D>(p, rows, h, lane, dq_acc);
}

// ---- backward: dk, dv, dlogβ -------------------------------------------------------------

// A lane's two key rows in a dk/dv CTA (fragment rows group and group + 8 of its warp's
// row-block): token, document (−1 past the block's nk rows), staged logβ (base 2) and whether
// it is a row.
struct KeyRows {
  int64_t i[2];
  int32_t doc_i[2];
  bool in_i[2];
  float lb2[2];
  __device__ __forceinline__ KeyRows(const Params& p, int64_t i0, int nk, int kv, int warp, int lane) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const int r = warp * kRowsPerWarp + c_row(lane, 2 * x);
      i[x] = i0 + r;
      in_i[x] = r < nk;
      doc_i[x] = in_i[x] ? p.k_doc[i[x]] : -1;
      lb2[x] = in_i[x] ? staged_lb2(p.log_beta[i[x] * p.K + kv]) : 0.0f;
    }
  }
};

// A key-side CTA's query stages: Q and dO tiles, and per query lse (base 2), D and doc.
template <int D>
struct QueryStages {
  bf16* q;
  bf16* dout;
  float* lse2;
  float* delta;
  int32_t* doc;

  // Issues the copies of query block qb of head h into `stage`; returns this thread's row.
  template <class Copy>
  __device__ __forceinline__ QueryRow fetch(const Params& p, const Copy& copy_tile, int h, int64_t qb,
                                            int stage) const {
    const int64_t q0 = block_begin(qb);
    const int nq = static_cast<int>(block_size(p.T, qb));
    copy_tile(q + stage * kBlock * D, p.q + int64_t{h} * D, int64_t{p.H} * D, q0, nq);
    copy_tile(dout + stage * kBlock * D, p.dout + int64_t{h} * D, int64_t{p.H} * D, q0, nq);
    QueryRow r;
    const int c = threadIdx.x;
    if (c < nq) {  // nq ≤ kBlock ≤ kThreads
      r.lse = p.lse[(q0 + c) * p.H + h];
      r.delta = p.delta[(q0 + c) * p.H + h];
      r.doc = p.doc[q0 + c];
    }
    return r;
  }
  __device__ __forceinline__ void store(const QueryRow& r, int stage) const {
    const int c = threadIdx.x;
    if (c < kBlock) {
      lse2[stage * kBlock + c] = lse_base2(r.lse);
      delta[stage * kBlock + c] = r.delta;
      doc[stage * kBlock + c] = r.doc;
    }
  }
};

// The start of a dk/dv CTA: K and V copied, the walk over query blocks, the first (query
// head, query block) pair's copies issued and committed. The pairs to visit: heads of the
// group in order, and for each the query blocks qb ≥ kb that share a document with kb (the
// walk's set bits). Returns the first pair (h = the group's end: none).
template <int D, class Copy>
__device__ __forceinline__ HeadBlock start_dkdv(const Params& p, const DkdvSmem<D>& sm, const Copy& copy_tile,
                                                const TileFilter& tiles, const WalkRange& walk, int64_t kb, int kv) {
  const int64_t i0 = block_begin(kb);
  const int nk = static_cast<int>(block_size(p.Tk, kb));
  copy_tile(sm.kept(0), p.k + int64_t{kv} * D, int64_t{p.K} * D, i0, nk);
  copy_tile(sm.kept(1), p.v + int64_t{kv} * D, int64_t{p.K} * D, i0, nk);
  fill_walk(sm.visit, sm.full, walk, [&](int64_t qb) { return walk_bits(tiles, qb, kb); });
  __syncthreads();  // the walk bits
  const int64_t first_qb = next_walk_bit(sm.visit, walk.lo, walk.hi);
  const int h_end = (kv + 1) * p.group;
  const int h = first_qb < walk.hi ? kv * p.group : h_end;
  if (h < h_end) sm.queries().store(sm.queries().fetch(p, copy_tile, h, first_qb, 0), 0);
  cp_async_commit();
  return {h, first_qb};
}

// The end of a dk/dv CTA: dk = scale · Σ dSᵀ·Q and dv = Σ Pᵀ·dO in bf16, dlogβ in fp32.
template <int D>
__device__ __forceinline__ void finish_dkdv(const Params& p, const KeyRows& k, int kv, int lane, double (&dlb)[2],
                                            const float (&dk_acc)[D / 8][4], const float (&dv_acc)[D / 8][4]) {
  cp_async_wait<0>();  // no copy may be in flight when the CTA exits (nothing visited: K, V still are)
  int64_t row[2];
  const float mul_k[2] = {p.scale, p.scale}, mul_v[2] = {1.0f, 1.0f};
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    row[x] = k.i[x] * p.K + kv;
    dlb[x] = quad_sum(dlb[x]);
    if (k.in_i[x] && lane % 4 == 0)
      p.dlog_beta[row[x]] = static_cast<float>(dlb[x]) + (p.dk32 ? p.dlog_beta[row[x]] : 0.0f);
  }
  if (p.dk32) {
    store_rows<D, true>(p.dk32, D, row, k.in_i, dk_acc, mul_k, lane);
    store_rows<D, true>(p.dv32, D, row, k.in_i, dv_acc, mul_v, lane);
    return;
  }
  store_rows<D>(p.dk, D, row, k.in_i, dk_acc, mul_k, lane);
  store_rows<D>(p.dv, D, row, k.in_i, dv_acc, mul_v, lane);
}

template <int D>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(const Params p) {
  // Queries are taken kSub at a time inside a tile, which keeps the transposed score and dP
  // fragments at kSub/8 n-tiles beside the dk and dv accumulators (2·D/2 fp32 registers):
  // with kSub = 32, d = 128 spills under ptxas' 255-register cap; 16 does not.
  constexpr int kSub = D == 128 ? 16 : 32;
  constexpr int kSubTiles = kSub / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  const TileCopy<D> copy_tile;
  const DkdvSmem<D> sm(smem, p.walk_nb);

  const int64_t kb = blockIdx.x;  // early key blocks meet the most query blocks: first
  const int kv = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const LaneLdsm<D> ldsm(lane);
  const KeyRows rows(p, block_begin(kb), static_cast<int>(block_size(p.Tk, kb)), kv, warp, lane);
  const QueryStages<D> queries = sm.queries();
  const TileFilter tiles = tile_filter(p, kv);
  const WalkRange walk = query_walk_range(tiles, kb);
  const HeadBlock first = start_dkdv<D>(p, sm, copy_tile, tiles, walk, kb, kv);
  const int h_end = (kv + 1) * p.group;
  int h = first.h;
  int64_t qb = first.qb;

  float dk_acc[D / 8][4] = {};
  float dv_acc[D / 8][4] = {};
  // dlogβ sums up to T·group terms per key: fp32 within a tile (16 per lane and row), fp64
  // across tiles, so the error does not grow with T (two fp64 adds per lane per tile).
  double dlb[2] = {0.0, 0.0};
  int stage = 0;
  while (h < h_end) {
    const HeadBlock next = next_walk_head_block(sm.visit, walk, first.qb, {h, qb});
    const bool prefetch = next.h < h_end;
    QueryRow next_row;
    if (prefetch) next_row = queries.fetch(p, copy_tile, next.h, next.qb, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    const bf16* q_s = queries.q + stage * kBlock * D;
    const bf16* do_s = queries.dout + stage * kBlock * D;
    const bool all_allowed = walk_bit(sm.full, qb);

    float dlb_tile[2] = {0.0f, 0.0f};
#pragma unroll 1
    for (int sub = 0; sub < kBlock / kSub; ++sub) {
      const int c0 = sub * kSub;  // query columns c0 .. c0 + kSub of the tile
      float s[kSubTiles][4] = {};
      float dp[kSubTiles][4] = {};
      rows_times_rows_t<D, kSubTiles>(s, smem_base(sm.kept(0)), warp * kRowsPerWarp, smem_base(q_s), c0, ldsm);    // K·Qᵀ
      rows_times_rows_t<D, kSubTiles>(dp, smem_base(sm.kept(1)), warp * kRowsPerWarp, smem_base(do_s), c0, ldsm);  // V·dOᵀ
      key_row_grads(s, dp, lane, rows.i, rows.doc_i, rows.lb2, block_begin(qb) + p.gap, c0, queries.lse2 + stage * kBlock,
                    queries.delta + stage * kBlock, queries.doc + stage * kBlock, all_allowed, p.scale2, dlb_tile);
      weights_times_rows<D, kSubTiles>(dv_acc, s, smem_base(do_s), c0, ldsm);  // Pᵀ·dO
      weights_times_rows<D, kSubTiles>(dk_acc, dp, smem_base(q_s), c0, ldsm);  // dSᵀ·Q
    }
    dlb[0] += static_cast<double>(dlb_tile[0]);
    dlb[1] += static_cast<double>(dlb_tile[1]);

    if (prefetch) queries.store(next_row, stage ^ 1);
    __syncthreads();
    h = next.h;
    qb = next.qb;
    stage ^= 1;
  }
  finish_dkdv<D>(p, rows, kv, lane, dlb, dk_acc, dv_acc);
}

// dkdv_kernel on wgmma (RETAIN_ATTENTION_BACKWARD=wgmma, sm_90). The warpgroup's 64 rows are
// the key block: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ over a whole 64-query tile (no sub-tiles: the
// operands come from shared memory, not ldmatrix registers, which leaves room for both 64-column
// fragments beside dk and dv) in one commit group, P and dS by key_row_grads, then
// dv += Pᵀ·dO and dk += dSᵀ·Q with Pᵀ, dSᵀ from registers and dO, Q read transposed.
// Unverified on a GPU (emulated only).
template <int D>
__global__ void __launch_bounds__(kThreads) dkdv_wgmma_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t pad = wgmma_smem_pad(smem);
  const TileCopy<D, true> copy_tile;
  const DkdvSmem<D> sm(smem + pad, p.walk_nb);
  const uint32_t aK = wgmma::smem_address(smem) + pad, aV = aK + kTileBytes<D>, aQ = aV + kTileBytes<D>, adO = aQ + 2 * kTileBytes<D>;
  const uint64_t desc_k = wgmma::k_major_desc(aK, kBlock, 0, 0), desc_v = wgmma::k_major_desc(aV, kBlock, 0, 0);

  const int64_t kb = blockIdx.x;
  const int kv = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const KeyRows rows(p, block_begin(kb), static_cast<int>(block_size(p.Tk, kb)), kv, warp, lane);
  const QueryStages<D> queries = sm.queries();
  const TileFilter tiles = tile_filter(p, kv);
  const WalkRange walk = query_walk_range(tiles, kb);
  const HeadBlock first = start_dkdv<D>(p, sm, copy_tile, tiles, walk, kb, kv);
  const int h_end = (kv + 1) * p.group;
  int h = first.h;
  int64_t qb = first.qb;

  float dk_acc[D / 8][4] = {};
  float dv_acc[D / 8][4] = {};
  double dlb[2] = {0.0, 0.0};  // as dkdv_kernel: fp32 within a tile, fp64 across tiles
  int stage = 0;
  while (h < h_end) {
    const HeadBlock next = next_walk_head_block(sm.visit, walk, first.qb, {h, qb});
    const bool prefetch = next.h < h_end;
    QueryRow next_row;
    if (prefetch) next_row = queries.fetch(p, copy_tile, next.h, next.qb, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    wgmma::fence_proxy_async();
    __syncthreads();

    const uint32_t q_s = aQ + static_cast<uint32_t>(stage) * kTileBytes<D>;
    const uint32_t do_s = adO + static_cast<uint32_t>(stage) * kTileBytes<D>;
    float s[kBlock / 8][4], dp[kBlock / 8][4];
    wgmma::fence();
    wgmma_rows_times_rows_t<D>(s, desc_k, wgmma::k_major_desc(q_s, kBlock, 0, 0));    // K·Qᵀ
    wgmma_rows_times_rows_t<D>(dp, desc_v, wgmma::k_major_desc(do_s, kBlock, 0, 0));  // V·dOᵀ
    wgmma::commit_group();
    wgmma::wait_group<0>();
    wgmma::fence_operand(s);
    wgmma::fence_operand(dp);

    float dlb_tile[2] = {0.0f, 0.0f};
    key_row_grads(s, dp, lane, rows.i, rows.doc_i, rows.lb2, block_begin(qb) + p.gap, 0, queries.lse2 + stage * kBlock,
                  queries.delta + stage * kBlock, queries.doc + stage * kBlock, walk_bit(sm.full, qb), p.scale2,
                  dlb_tile);  // s = P, dp = dS
    uint32_t pa[kBlock / 16][4], dsa[kBlock / 16][4];
    weights_to_a(s, pa);
    weights_to_a(dp, dsa);
    wgmma::fence_operand(pa);
    wgmma::fence_operand(dsa);
    wgmma::fence_operand(dv_acc);
    wgmma::fence_operand(dk_acc);
    wgmma::fence();
    wgmma_weights_times_rows(dv_acc, pa, wgmma::mn_major_desc(do_s, kBlock, 0, 0));  // Pᵀ·dO
    wgmma_weights_times_rows(dk_acc, dsa, wgmma::mn_major_desc(q_s, kBlock, 0, 0));  // dSᵀ·Q
    wgmma::commit_group();
    wgmma::wait_group<0>();  // Q's and dO's stage are read before the barrier lets them be refilled
    wgmma::fence_operand(dv_acc);
    wgmma::fence_operand(dk_acc);
    wgmma::fence_operand(pa);
    wgmma::fence_operand(dsa);
    dlb[0] += static_cast<double>(dlb_tile[0]);
    dlb[1] += static_cast<double>(dlb_tile[1]);

    if (prefetch) queries.store(next_row, stage ^ 1);
    __syncthreads();
    h = next.h;
    qb = next.qb;
    stage ^= 1;
  }
  finish_dkdv<D>(p, rows, kv, lane, dlb, dk_acc, dv_acc);
}

// ---- host side ---------------------------------------------------------------------------

// Scratch device memory from the stream-ordered pool (kept by the pool between calls, so
// repeated calls do not pay cudaMalloc), freed in stream order after the kernels using it.
class Scratch {
 public:
  explicit Scratch(size_t bytes) {
    if (bytes == 0) return;
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    cudaMemPool_t pool;
    CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    uint64_t keep = UINT64_MAX;
    CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    CUDA_CHECK(cudaMallocAsync(&p_, bytes, 0));
  }
  ~Scratch() {
    if (p_) cudaFreeAsync(p_, 0);  // an error here would already have surfaced from the kernels
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
};

const char* kForward = "gated_attention";
const char* kBackward = "gated_attention_backward";

void check_aligned(const char* op, const char* what, const Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.raw()) % 16 != 0) fail("{}: {} is not 16-byte aligned on the device", op, what);
}

// The per-call tile tables on the device: each block's document range, its span of blocks
// that may share a document (kernels/cuda/block_spans.h), and, with the optional weight skip
// (0 < ε < 1), each (block, KV head)'s largest logβ.
class TileTables {
 public:
  TileTables(const char* op, const Tensor& log_beta, const Tensor& doc, float skip_weight_below)
      : T_(doc.dim(0)),
        K_(log_beta.dim(1)),
        nb_(block_count(T_)),
        skip_(skip_weight_below > 0.0f),
        ranges_(sizeof(DocRange) * static_cast<size_t>(nb_)),
        spans_(sizeof(spans::BlockSpan) * static_cast<size_t>(nb_)),
        lbmax_(skip_ ? sizeof(float) * static_cast<size_t>(nb_ * K_) : 0) {
    if (!(skip_weight_below >= 0.0f && skip_weight_below < 1.0f))
      fail("{}: skip_weight_below = {} is not in [0, 1) (0 = exact)", op, skip_weight_below);
    doc_ranges(doc, nb_, ranges_.as<DocRange>());
    const DocRange* r = ranges_.as<DocRange>();
    spans::device_block_spans(&r->lo, &r->hi, sizeof(DocRange) / sizeof(int32_t), static_cast<int32_t>(nb_),
                              spans_.as<spans::BlockSpan>());
    if (skip_) {
      const int threads = 128;
      log_eps_ = std::log(skip_weight_below);
      lbmax_kernel<<<static_cast<unsigned>((nb_ * K_ + threads - 1) / threads), threads>>>(
          log_beta.data<float>(), doc.data<int32_t>(), T_, K_, nb_, lbmax_.as<float>());
      CUDA_CHECK(cudaGetLastError());
    }
  }
  void fill(Params& p) const {
    p.ranges = ranges_.as<DocRange>();
    p.spans = spans_.as<spans::BlockSpan>();
    p.lbmax = skip_ ? lbmax_.as<float>() : nullptr;
    p.log_eps = log_eps_;
  }

 private:
  int64_t T_, K_, nb_;
  bool skip_;
  float log_eps_ = 0.0f;
  Scratch ranges_, spans_, lbmax_;
};

// A span pair's tile tables (kernels/retention_spans.h): the queries' own tokens (the
// one-sequence tables of q_doc: ranges and spans; no weight skip), or a wholly earlier key span
// (a rectangle: each side's block ranges, no spans).
class SpanTables {
 public:
  SpanTables(const char* op, bool rect, const Tensor& log_beta, const Tensor& q_doc, const Tensor& k_doc)
      : rect_(rect),
        nqb_(block_count(q_doc.dim(0))),
        nkb_(block_count(k_doc.dim(0))),
        q_ranges_(rect ? sizeof(DocRange) * static_cast<size_t>(nqb_) : 0),
        k_ranges_(rect ? sizeof(DocRange) * static_cast<size_t>(nkb_) : 0) {
    if (!rect) {
      self_.emplace(op, log_beta, q_doc, 0.0f);
      return;
    }
    doc_ranges(q_doc, nqb_, q_ranges_.as<DocRange>());
    doc_ranges(k_doc, nkb_, k_ranges_.as<DocRange>());
  }
  void fill(Params& p) const {
    if (!rect_) return self_->fill(p);
    p.ranges = q_ranges_.as<DocRange>();
    p.k_ranges = k_ranges_.as<DocRange>();
    p.spans = nullptr;
    p.lbmax = nullptr;
  }

 private:
  bool rect_;
  int64_t nqb_, nkb_;
  Scratch q_ranges_, k_ranges_;
  std::optional<TileTables> self_;
};

Params base_params(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& log_beta,
                   const Tensor& doc, float scale) {
  for (auto [name, t] : {std::pair<const char*, const Tensor*>{"q", &q}, {"k", &k}, {"v", &v}})
    check_aligned(op, name, *t);
  Params p{};
  p.q = static_cast<const bf16*>(q.raw());
  p.k = static_cast<const bf16*>(k.raw());
  p.v = static_cast<const bf16*>(v.raw());
  p.log_beta = log_beta.data<float>();
  p.doc = doc.data<int32_t>();
  p.k_doc = p.doc;
  p.T = q.dim(0);
  p.Tk = k.dim(0);
  p.H = static_cast<int>(q.dim(1));
  p.K = static_cast<int>(k.dim(1));
  p.group = p.H / p.K;
  p.nb = static_cast<int>(block_count(p.T));
  p.nkb = static_cast<int>(block_count(p.Tk));
  p.walk_nb = std::max(p.nb, p.nkb);
  p.scale = scale;
  p.scale2 = scale * kLog2e;
  return p;
}

int head_dim(const char* op, const Tensor& q) {
  const int64_t d = q.dim(2);
  if (d != 64 && d != 128) fail("{}: head_dim {} has no CUDA kernel (64 and 128 have)", op, d);
  if (q.dim(1) > 65535) fail("{}: {} query heads exceed the CUDA grid's 65535", op, q.dim(1));
  return static_cast<int>(d);
}

template <typename Kernel>
void launch(Kernel kernel, unsigned grid_x, unsigned grid_y, size_t smem, const Params& p, int threads = kThreads) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<dim3(grid_x, grid_y), threads, smem>>>(p);
  CUDA_CHECK(cudaGetLastError());
}

// RETAIN_ATTENTION_FORWARD and RETAIN_ATTENTION_BACKWARD pick the kernels of each pass: "mma"
// (mma.sync, sm_80 and up), "wgmma" (the *_wgmma_kernel ones, sm_90 only) or "auto" (unset:
// wgmma where it runs, else mma). On an H200 wgmma did gated fwd+bwd at 32K in 98 ms against
// mma's 145 (docs/benchmarks.md), both passing their tests there. On the CUDA emulator auto
// stays mma: its tests pin wgmma where they test it, and CI's time stays where it is.
bool use_wgmma(const char* op, const char* variable) {
  const char* e = std::getenv(variable);
  const std::string v = e && *e ? e : "auto";
  if (v == "mma") return false;
#if defined(RETAIN_CUDA_EMU)
  if (v == "auto") return false;
#else
  if (v == "auto") return wgmma_supported();
#endif
  if (v != "wgmma") fail("{}: {} must be mma, wgmma or auto, not '{}'", op, variable, v);
  if (const std::string why = wgmma_unavailable_reason(); !why.empty())
    fail("{}: {}=wgmma cannot run: {}", op, variable, why);
  return true;
}

template <int D>
void forward(const Params& p) {
  if (use_wgmma(kForward, "RETAIN_ATTENTION_FORWARD"))
    launch(forward_wgmma_kernel<D>, static_cast<unsigned>((p.nb + kForwardGroups - 1) / kForwardGroups),
           static_cast<unsigned>(p.H), wgmma_forward_smem<D>(p.walk_nb), p, kForwardThreads);
  else
    launch(forward_kernel<D>, static_cast<unsigned>(p.nb), static_cast<unsigned>(p.H), staged_smem<D>(1, p.walk_nb),
           p);
}

// The head_dim's instance (head_dim() allows 64 and 128 only).
void run_forward(int d, const Params& p) { d == 64 ? forward<64>(p) : forward<128>(p); }

template <int D>
void backward(const Params& p) {
  const bool wgmma = use_wgmma(kBackward, "RETAIN_ATTENTION_BACKWARD");
  const int64_t rows = p.T * p.H;
  const int warps_per_cta = 8;
  const auto delta_blocks = static_cast<unsigned>((rows + warps_per_cta - 1) / warps_per_cta);
  if (p.out32)
    delta_kernel<float><<<delta_blocks, 32 * warps_per_cta>>>(p.out32, p.dout, const_cast<float*>(p.delta), rows, D);
  else
    delta_kernel<bf16><<<delta_blocks, 32 * warps_per_cta>>>(p.out, p.dout, const_cast<float*>(p.delta), rows, D);
  CUDA_CHECK(cudaGetLastError());
  const auto nb = static_cast<unsigned>(p.nb), nkb = static_cast<unsigned>(p.nkb);
  const size_t smem = staged_smem<D>(2, p.walk_nb);
  if (wgmma) {
    launch(dq_wgmma_kernel<D>, nb, static_cast<unsigned>(p.H), smem + kWgmmaSmemPad, p);
    launch(dkdv_wgmma_kernel<D>, nkb, static_cast<unsigned>(p.K), smem + kWgmmaSmemPad, p);
    return;
  }
  launch(dq_kernel<D>, nb, static_cast<unsigned>(p.H), smem, p);
  launch(dkdv_kernel<D>, nkb, static_cast<unsigned>(p.K), smem, p);
}
void run_backward(int d, const Params& p) { d == 64 ? backward<64>(p) : backward<128>(p); }

}  // namespace

namespace {

// Writes 1 where the code the device loaded for this file has sm_90a's features (wgmma), 0
// where it does not: a build for plain sm_90, or the compute_90 PTX the build also embeds for
// newer GPUs JIT-compiled, turns every wgmma into a trap (wgmma.cuh's RETAIN_SM90A_ASM). The
// probe lives in this file so that the device loads it from the same fatbinary entry as the
// wgmma kernels.
__global__ void sm90a_probe_kernel(int* has_sm90a) {
#if defined(RETAIN_CUDA_EMU) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *has_sm90a = 1;
#else
  *has_sm90a = 0;
#endif
}

// The probe's answer for `device`, asked once per device and process (the launch and its copy
// back synchronize; every later call reads the cache).
bool sm90a_code_loaded(int device) {
  static std::atomic<int> cache[64];  // 0 unknown, 1 no, 2 yes
  if (device < 0 || device >= 64) return false;
  if (const int known = cache[device].load(std::memory_order_acquire)) return known == 2;
  int* flag = nullptr;
  int has = 0;
  CUDA_CHECK(cudaMalloc(&flag, sizeof(int)));
  CUDA_CHECK(cudaMemset(flag, 0, sizeof(int)));
  sm90a_probe_kernel<<<1, 1>>>(flag);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaMemcpy(&has, flag, sizeof(int), cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaFree(flag));
  cache[device].store(has == 1 ? 2 : 1, std::memory_order_release);
  return has == 1;
}

}  // namespace

// Two attribute reads, not cudaGetDeviceProperties: this runs on every attention call that asks
// for wgmma, and the whole property struct costs far more than the two fields it needs.
std::string wgmma_unavailable_reason() {
  int device = 0, major = 0, minor = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major != 9 || minor != 0)
    return fmt::format("it needs an sm_90 GPU (H100/H200); this device is sm_{}{}", major, minor);
  if (!sm90a_code_loaded(device))
    return "this build of retain has no sm_90a code for the attention kernels (configure with "
           "CMAKE_CUDA_ARCHITECTURES including 90a; plain 90 compiles every wgmma to a trap)";
  return {};
}

bool wgmma_supported() { return wgmma_unavailable_reason().empty(); }

std::string attention_kernels(bool backward) {
  return use_wgmma(backward ? kBackward : kForward, backward ? "RETAIN_ATTENTION_BACKWARD" : "RETAIN_ATTENTION_FORWARD")
             ? "wgmma"
             : "mma";
}

void gated_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& log_beta, const Tensor& doc,
                     float scale, Tensor& out, Tensor& lse, float skip_weight_below) {
  const int d = head_dim(kForward, q);
  if (q.dim(0) == 0) return;
  check_aligned(kForward, "out", out);
  const TileTables tables(kForward, log_beta, doc, skip_weight_below);
  Params p = base_params(kForward, q, k, v, log_beta, doc, scale);
  tables.fill(p);
  p.out = static_cast<bf16*>(out.raw());
  p.lse = lse.data<float>();
  run_forward(d, p);
}

void gated_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& log_beta,
                              const Tensor& doc, float scale, const Tensor& out, const Tensor& lse,
                              const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dlog_beta,
                              float skip_weight_below) {
  const int d = head_dim(kBackward, q);
  const int64_t T = q.dim(0);
  if (T == 0) return;
  for (auto [name, t] : {std::pair<const char*, const Tensor*>{"out", &out}, {"dout", &dout}, {"dq", &dq},
                         {"dk", &dk}, {"dv", &dv}})
    check_aligned(kBackward, name, *t);
  const TileTables tables(kBackward, log_beta, doc, skip_weight_below);
  Scratch delta(sizeof(float) * static_cast<size_t>(T * q.dim(1)));
  Params p = base_params(kBackward, q, k, v, log_beta, doc, scale);
  tables.fill(p);
  p.out = const_cast<bf16*>(static_cast<const bf16*>(out.raw()));  // read only (delta_kernel)
  p.lse = const_cast<float*>(lse.data<float>());                     // read only in backward
  p.dout = static_cast<const bf16*>(dout.raw());
  p.delta = delta.as<float>();
  p.dq = static_cast<bf16*>(dq.raw());
  p.dk = static_cast<bf16*>(dk.raw());
  p.dv = static_cast<bf16*>(dv.raw());
  p.dlog_beta = dlog_beta.data<float>();
  run_backward(d, p);
}

// ---- span pairs (context parallelism; kernels/retention_spans.h) -------------------------

namespace {

const char* kSpanForward = "gated_attention_span";
const char* kSpanBackward = "gated_attention_span_backward";

// The pair's Params: base_params over the queries, then the keys' side and the position gap.
Params span_params(const char* op, SpanPair kind, const Tensor& q, const Tensor& q_doc, int64_t q_start,
                   const Tensor& k, const Tensor& v, const Tensor& log_beta, const Tensor& k_doc, int64_t k_start,
                   float scale, const SpanTables& tables) {
  Params p = base_params(op, q, k, v, log_beta, q_doc, scale);
  tables.fill(p);
  p.k_doc = k_doc.data<int32_t>();
  p.gap = kind == SpanPair::earlier ? q_start - k_start : 0;
  return p;
}

}  // namespace

void gated_attention_span(const Tensor& q, const Tensor& q_doc, int64_t q_start, const Tensor& k, const Tensor& v,
                          const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, float scale, Tensor& out,
                          Tensor& lse) {
  const char* op = kSpanForward;
  const int d = head_dim(op, q);
  check_aligned(op, "out", out);
  const SpanPair kind = span_pair(op, q_start, q.dim(0), k_start, k.dim(0));
  if (kind == SpanPair::none) {  // no allowed key for any row: out 0, lse −inf
    ops::fill(out, 0.0);
    ops::fill(lse, kNegInf);
    return;
  }
  const SpanTables tables(op, kind == SpanPair::earlier, log_beta, q_doc, k_doc);
  Params p = span_params(op, kind, q, q_doc, q_start, k, v, log_beta, k_doc, k_start, scale, tables);
  p.out32 = out.data<float>();
  p.lse = lse.data<float>();
  run_forward(d, p);
}

void gated_attention_span_backward(const Tensor& q, const Tensor& q_doc, int64_t q_start, const Tensor& k,
                                   const Tensor& v, const Tensor& log_beta, const Tensor& k_doc, int64_t k_start,
                                   float scale, const Tensor& out, const Tensor& lse, const Tensor& dout, Tensor& dq,
                                   Tensor& dk, Tensor& dv, Tensor& dlog_beta) {
  const char* op = kSpanBackward;
  const int d = head_dim(op, q);
  for (auto [name, t] : {std::pair<const char*, const Tensor*>{"out", &out}, {"dout", &dout}, {"dq", &dq},
                         {"dk", &dk}, {"dv", &dv}})
    check_aligned(op, name, *t);
  const SpanPair kind = span_pair(op, q_start, q.dim(0), k_start, k.dim(0));
  if (kind == SpanPair::none) return;  // the pair adds nothing
  const SpanTables tables(op, kind == SpanPair::earlier, log_beta, q_doc, k_doc);
  Scratch delta(sizeof(float) * static_cast<size_t>(q.dim(0) * q.dim(1)));
  Params p = span_params(op, kind, q, q_doc, q_start, k, v, log_beta, k_doc, k_start, scale, tables);
  p.out32 = const_cast<float*>(out.data<float>());  // read only (delta_kernel)
  p.lse = const_cast<float*>(lse.data<float>());    // read only in backward
  p.dout = static_cast<const bf16*>(dout.raw());
  p.delta = delta.as<float>();
  p.dq32 = dq.data<float>();
  p.dk32 = dk.data<float>();
  p.dv32 = dv.data<float>();
  p.dlog_beta = dlog_beta.data<float>();
  run_backward(d, p);
}

}  // namespace retain::cuda
