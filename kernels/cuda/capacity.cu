// CUDA capacity sums, capacity hinge and its gradient (DESIGN §4; the CPU reference is
// kernels/cpu/capacity.cpp, formulas in docs/math.md "Capacity"). The tile schedule and the
// per-lane arithmetic live in kernels/cuda/capacity_tiles.h (shared with a CPU emulation test);
// this file adds shared memory, barriers, reductions and launches.
//
// Kernels (all on the default stream, every launch checked):
//   tile_info   per (layer, key tile): max logβ over the tile's non-padding keys per head
//               (the e^-60 skip) and, for layer 0, the tile's document range.
//   sums        block = (query tile qb, layer l, head group z): a warp per KV head, a lane per
//               4 consecutive rows; loops over key tiles kb = span..qb (never above the diagonal,
//               never before the first tile that may share a document: kernels/cuda/block_spans.h),
//               skipping tiles with no shared document or (per head) no term above e^-60; the
//               key tile (logβ, β = e^logβ, doc) is staged in shared memory and read by
//               broadcast. Per row: float32 partials of ≤ 64 terms added into float64. Then,
//               as asked: S (float32), the local hinge (sum, count) as per-block partials, the
//               local slope g = ∂ℓ/∂S and per-tile "any g ≠ 0" flags, or Σ_κ S per row (float64,
//               for the global hinge).
//   totals      global mode: Σ_{l,κ} S per row in a fixed order, the global hinge and slope.
//   grads       block = (key tile kb, layer l, head group z): a lane per 4 consecutive keys,
//               loops over query tiles qb = kb.. (up to the tile's span end); the transposed pass
//               dlogβ_i = scale·Σ_{t>i} g_t·(t − i)·e^{(t−i)·logβ_i}, float64 per key.
//   reduce      the per-block loss partials summed in a fixed order (deterministic results).
// Memory besides inputs and outputs: O(L·T·K/128) tile data, g (L·T·K floats local, T global),
// and Σ_κ S per (layer, head group, row) in float64 in global mode — O(T) per layer, no T×T.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cuda/block_spans_cuda.h"
#include "kernels/cuda/capacity_tiles.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/retention_cuda.h"
#include "kernels/cuda/span_pair.h"

namespace retain::cuda {

namespace {

using namespace capacity;
static_assert(kNegligibleExponent == ops::kExactSkipExponent, "one default skip exponent on both devices");

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kReduceThreads = 256;

#define RETAIN_LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

// ---- tile_info ---------------------------------------------------------------------------
// The TileDocs of one tile from its kTile threads, thread j holding token j's document d (−1:
// padding or past T); thread 0 writes *out. Every thread of the block calls it.
__device__ void reduce_tile_docs(int32_t d, TileDocs* out) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __shared__ int32_t s_lo[kTile / 32], s_hi[kTile / 32], s_pad[kTile / 32];
  const bool real = d >= 0;
  int32_t lo = real ? d : INT32_MAX, hi = real ? d : INT32_MIN, pad = real ? 0 : 1;
  for (int o = 16; o > 0; o >>= 1) {
    lo = min(lo, __shfl_xor_sync(kFullMask, lo, o));
    hi = max(hi, __shfl_xor_sync(kFullMask, hi, o));
    pad = max(pad, __shfl_xor_sync(kFullMask, pad, o));
  }
  if (lane == 0) {
    s_lo[warp] = lo;
    s_hi[warp] = hi;
    s_pad[warp] = pad;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    TileDocs r{s_lo[0], s_hi[0], s_pad[0]};
    for (int w = 1; w < kTile / 32; ++w) {
      r.lo = min(r.lo, s_lo[w]);
      r.hi = max(r.hi, s_hi[w]);
      r.padded = max(r.padded, s_pad[w]);
    }
    *out = r;
  }
}

// grid (nb, L), kTile threads: thread j looks at key i = kb·kTile + j.
__global__ void __launch_bounds__(kTile) tile_info_kernel(const float* __restrict__ lb, const int32_t* __restrict__ doc,
                                                          int64_t T, int K, int64_t nb, float* __restrict__ tile_max,
                                                          TileDocs* __restrict__ docs) {
  const int64_t kb = blockIdx.x, l = blockIdx.y;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t i = kb * kTile + threadIdx.x;
  const int32_t d = i < T ? doc[i] : -1;
  const bool real = d >= 0;
  __shared__ float s_max[kTile / 32];
  for (int k = 0; k < K; ++k) {
    float v = real ? lb[(l * T + i) * K + k] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
    if (lane == 0) s_max[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
      float m = s_max[0];
      for (int w = 1; w < kTile / 32; ++w) m = fmaxf(m, s_max[w]);
      tile_max[(l * nb + kb) * K + k] = m;
    }
    __syncthreads();  // s_max is reused by the next head
  }
  if (l != 0) return;  // the document ranges do not depend on the layer
  reduce_tile_docs(d, docs + kb);
}

// grid (nb), kTile threads: the TileDocs of a document array alone (a rectangle's rows).
__global__ void __launch_bounds__(kTile) tile_docs_kernel(const int32_t* __restrict__ doc, int64_t T,
                                                          TileDocs* __restrict__ docs) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kTile + threadIdx.x;
  reduce_tile_docs(t < T ? doc[t] : -1, docs + blockIdx.x);
}

// ---- sums --------------------------------------------------------------------------------
// What both kernels read of one log_beta [L, T, K] and its documents (Plan::tiles fills it):
// the sums kernel's rows, the grads kernel's keys.
struct TileArgs {
  const float* lb;       // [L, T, K]
  const int32_t* doc;    // [T]
  int64_t T, nb;
  int K, W;              // heads, heads per block (= blockDim.x / 32)
  const float* tile_max;  // [L, nb, K]
  const TileDocs* docs;  // [nb]
  const spans::BlockSpan* spans;  // [nb]
  double skip;                    // the skip exponent E
};

struct SumsArgs : TileArgs {
  const int32_t* pos;    // [T], needed by the hinge outputs only
  double M;
  float* S;                       // [L, T, K] or null
  double* part_sum;               // local hinge partials, one per block, or null
  unsigned long long* part_count;
  float* g;                       // local slopes [L, T, K] or null
  uint8_t* g_any;                 // [L, nb, K]: some slope of the (layer, query tile, head) ≠ 0
  double* head_totals;            // [L·Z, T]: Σ_κ S over the block's heads, or null
  // The keys: the rows' own tokens (one sequence, and a span with itself: the same TileArgs), or
  // in a rectangle (rect; capacity_sums_span) a wholly earlier span whose positions are `gap`
  // before the rows' (a row's position is its index + gap, a key's its index).
  TileArgs keys;
  int64_t gap;
  bool rect;
  double* S64;                    // [L, T, K]: S added to (a span's sums), or null
};

__global__ void __launch_bounds__(32 * kHeadsPerBlock) sums_kernel(SumsArgs a) {
  const int64_t nb = a.nb, T = a.T;
  const int64_t qb = nb - 1 - blockIdx.x;  // the longest rows start first
  const int64_t l = blockIdx.y;
  const int z = blockIdx.z, W = a.W, K = a.K;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kappa = z * W + warp;
  const bool active = kappa < K;  // the last head group may be partial
  __shared__ float s_lb[kHeadsPerBlock][kTile];  // staged_lb2: logβ·log2 e
  __shared__ float s_beta[kHeadsPerBlock][kTile];
  __shared__ int32_t s_doc[kTile];
  __shared__ double s_tot[kHeadsPerBlock][kTile];
  __shared__ double s_sum[kHeadsPerBlock];
  __shared__ unsigned long long s_count[kHeadsPerBlock];

  const int64_t row0 = qb * kTile + lane * kRun;  // the lane's first row
  const int64_t t0 = row0 + a.gap;                // and its position
  int32_t rdoc[kRun];
  for (int r = 0; r < kRun; ++r) rdoc[r] = row0 + r < T ? row_doc(a.doc[row0 + r]) : kPadRow;
  double acc[kRun] = {0, 0, 0, 0};
  const TileDocs qd = a.docs[qb];
  const float* head_max = a.keys.tile_max + l * a.keys.nb * K;
  const int64_t Tk = a.keys.T;

  // Key tiles from the first that may share a document up to the diagonal (a rectangle: all).
  const int64_t kb_end = a.rect ? a.keys.nb : qb + 1;
  for (int64_t kb = a.rect ? 0 : a.spans[qb].key_begin; kb < kb_end; ++kb) {
    const TileDocs kd = a.keys.docs[kb];
    const float key_max = active ? head_max[kb * K + kappa] : -INFINITY;
    const bool negligible =
        a.rect ? rect_tile_negligible(a.gap, qb, kb, key_max, a.skip) : tile_negligible(qb, kb, key_max, a.skip);
    const bool mine = active && tiles_may_meet(qd, kd) && !negligible;
    // Also the barrier after the previous tile's reads: shared memory may be overwritten.
    if (!__syncthreads_or(mine)) continue;
    const int64_t i0 = kb * kTile;
    for (int x = threadIdx.x; x < W * kTile; x += blockDim.x) {
      const int j = x / W, w = x % W;  // neighbouring threads read neighbouring heads of a key
      const int64_t i = i0 + j;
      const int k = z * W + w;
      const float v = i < Tk && k < K ? a.keys.lb[(l * Tk + i) * K + k] : -INFINITY;
      s_lb[w][j] = staged_lb2(v);
      s_beta[w][j] = expf(v);
    }
    for (int j = threadIdx.x; j < kTile; j += blockDim.x) s_doc[j] = i0 + j < Tk ? key_doc(a.keys.doc[i0 + j]) : kPadKey;
    __syncthreads();
    if (mine) {
      if (!a.rect && kb == qb)
        lane_sums_diagonal(s_lb[warp], s_doc, i0, kTile, t0, rdoc, acc);
      else
        lane_sums_off_diagonal(s_lb[warp], s_beta[warp], s_doc, i0, kTile, t0, rdoc, tile_one_document(qd, kd), acc);
    }
  }
  if (!a.rect) lane_self_terms(rdoc, acc);  // a rectangle holds no row's own key

  // Outputs of the lane's rows for head kappa.
  double ell_sum = 0;
  unsigned long long ell_count = 0;
  bool slope_any = false;
  for (int r = 0; r < kRun; ++r) {
    const int64_t t = row0 + r;
    const double s = rdoc[r] >= 0 ? acc[r] : 0.0;  // padding rows: S = 0, no ℓ
    if (a.head_totals) s_tot[warp][lane * kRun + r] = active ? s : 0.0;
    if (!active || t >= T) continue;
    const int64_t out = (l * T + t) * K + kappa;
    if (a.S) a.S[out] = static_cast<float>(s);
    if (a.S64) a.S64[out] += s;  // the row belongs to this lane alone
    if (a.part_sum || a.g) {
      double ell = 0, slope = 0;
      if (rdoc[r] >= 0) {
        const double den = local_denominator(a.pos[t], a.M);
        ell = hinge(s - a.M, den);
        slope = hinge_slope(s - a.M, den);
      }
      if (ell > 0) {
        ell_sum += ell;
        ++ell_count;
      }
      if (a.g) a.g[out] = static_cast<float>(slope);
      slope_any = slope_any || slope != 0;
    }
  }
  if (a.g) {
    const bool any = __any_sync(kFullMask, slope_any);  // whole warps: all lanes share `active`
    if (active && lane == 0) a.g_any[(l * nb + qb) * K + kappa] = any ? 1 : 0;
  }
  if (a.part_sum) {
    for (int o = 16; o > 0; o >>= 1) {
      ell_sum += __shfl_xor_sync(kFullMask, ell_sum, o);
      ell_count += __shfl_xor_sync(kFullMask, ell_count, o);
    }
    if (lane == 0) {
      s_sum[warp] = ell_sum;
      s_count[warp] = ell_count;
    }
  }
  __syncthreads();
  if (a.part_sum && threadIdx.x == 0) {
    double sum = 0;
    unsigned long long count = 0;
    for (int w = 0; w < W; ++w) {  // a fixed order: the result does not depend on scheduling
      sum += s_sum[w];
      count += s_count[w];
    }
    const int64_t block = (static_cast<int64_t>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    a.part_sum[block] = sum;
    a.part_count[block] = count;
  }
  if (a.head_totals) {
    const int Z = gridDim.z;
    for (int j = threadIdx.x; j < kTile; j += blockDim.x) {
      const int64_t t = qb * kTile + j;
      if (t >= T) continue;
      double tot = 0;
      for (int w = 0; w < W; ++w) tot += s_tot[w][j];
      a.head_totals[(l * Z + z) * T + t] = tot;
    }
  }
}

// ---- totals (global hinge) ---------------------------------------------------------------
// grid (nb), kTile threads: row t = qb·kTile + thread.
__global__ void __launch_bounds__(kTile) totals_kernel(const double* __restrict__ head_totals, int64_t parts,
                                                       const int32_t* __restrict__ doc, const int32_t* __restrict__ pos,
                                                       int64_t T, double M, double N, double* part_sum,
                                                       unsigned long long* part_count, float* g, uint8_t* g_any) {
  const int64_t qb = blockIdx.x, t = qb * kTile + threadIdx.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __shared__ double s_sum[kTile / 32];
  __shared__ unsigned long long s_count[kTile / 32];
  double ell = 0, slope = 0;
  if (t < T && doc[t] >= 0) {
    double total = 0;
    for (int64_t x = 0; x < parts; ++x) total += head_totals[x * T + t];  // layers, then head groups
    const double den = global_denominator(pos[t], M, N);
    ell = hinge(total - M * N, den);
    slope = hinge_slope(total - M * N, den);
  }
  if (g && t < T) g[t] = static_cast<float>(slope);
  double sum = ell;
  unsigned long long count = ell > 0 ? 1 : 0;
  for (int o = 16; o > 0; o >>= 1) {
    sum += __shfl_xor_sync(kFullMask, sum, o);
    count += __shfl_xor_sync(kFullMask, count, o);
  }
  if (lane == 0) {
    s_sum[warp] = sum;
    s_count[warp] = count;
  }
  const int any = __syncthreads_or(slope != 0);  // also publishes s_sum / s_count
  if (threadIdx.x == 0) {
    if (g_any) g_any[qb] = any ? 1 : 0;
    if (part_sum) {
      double total_sum = 0;
      unsigned long long total_count = 0;
      for (int w = 0; w < kTile / 32; ++w) {
        total_sum += s_sum[w];
        total_count += s_count[w];
      }
      part_sum[qb] = total_sum;
      part_count[qb] = total_count;
    }
  }
}

// ---- grads -------------------------------------------------------------------------------
struct GradArgs : TileArgs {
  const float* g;        // local: [L, T, K]; global: [T]
  const uint8_t* g_any;  // local: [L, nb, K]; global: [nb]
  bool per_head;         // local (true) or global (false) slopes
  double scale;
  float* dlb;  // [L, T, K]
  // The queries (g's rows; their doc, T, nb, docs): the keys' own tokens (one sequence, a span
  // with itself: the same TileArgs), or in a rectangle (rect; capacity_grad_span) a wholly later
  // span whose positions are `gap` past the keys'. dlb64: the gradient added to (a span's), or null.
  TileArgs rows;
  int64_t gap;
  bool rect;
  double* dlb64;  // [L, T, K]
};

__global__ void __launch_bounds__(32 * kHeadsPerBlock) grads_kernel(GradArgs a) {
  const int64_t nb = a.nb, T = a.T;
  const int64_t kb = blockIdx.x;  // the longest columns (small kb) start first
  const int64_t l = blockIdx.y;
  const int z = blockIdx.z, W = a.W, K = a.K;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kappa = z * W + warp;
  const bool active = kappa < K;
  __shared__ float s_g[kHeadsPerBlock][kTile];
  __shared__ int32_t s_doc[kTile];

  // The lane's keys stay in registers for the whole column.
  const int64_t i0 = kb * kTile + lane * kRun;
  float lbk[kRun], bk[kRun];
  int32_t kdoc[kRun];
  for (int j = 0; j < kRun; ++j) {
    const int64_t i = i0 + j;
    const bool real = active && i < T;
    const float v = real ? a.lb[(l * T + i) * K + kappa] : -INFINITY;
    lbk[j] = staged_lb2(v);
    bk[j] = expf(v);
    kdoc[j] = real ? key_doc(a.doc[i]) : kPadKey;
  }
  double acc[kRun] = {0, 0, 0, 0};
  const TileDocs kd = a.docs[kb];
  const float key_max = active ? a.tile_max[(l * nb + kb) * K + kappa] : -INFINITY;

  const int64_t Tq = a.rows.T, nqb = a.rows.nb;
  // Query tiles from the diagonal to the last that may share a document (a rectangle: all).
  const int64_t qb_end = a.rect ? nqb : a.spans[kb].query_end;
  for (int64_t qb = a.rect ? 0 : kb; qb < qb_end; ++qb) {
    const bool negligible =
        a.rect ? rect_tile_negligible(a.gap, qb, kb, key_max, a.skip) : tile_negligible(qb, kb, key_max, a.skip);
    const bool live = active && !negligible;
    // Negligibility is monotone in qb: once no head of the block is live, none will be.
    if (!__syncthreads_or(live)) break;
    const TileDocs qd = a.rows.docs[qb];
    const uint8_t any = a.per_head ? (live ? a.g_any[(l * nqb + qb) * K + kappa] : 0) : a.g_any[qb];
    const bool mine = live && any != 0 && tiles_may_meet(qd, kd);
    if (!__syncthreads_or(mine)) continue;
    const int64_t r0 = qb * kTile;  // the tile's first row; its position r0 + gap
    for (int x = threadIdx.x; x < W * kTile; x += blockDim.x) {
      const int j = x / W, w = x % W;
      const int64_t t = r0 + j;
      const int k = z * W + w;
      float gv = 0;
      if (t < Tq && k < K) gv = a.per_head ? a.g[(l * Tq + t) * K + k] : a.g[t];
      s_g[w][j] = gv;
    }
    for (int j = threadIdx.x; j < kTile; j += blockDim.x) s_doc[j] = r0 + j < Tq ? row_doc(a.rows.doc[r0 + j]) : kPadRow;
    __syncthreads();
    if (mine) {
      const int64_t t0 = r0 + a.gap;
      if (!a.rect && qb == kb)
        lane_grads_diagonal(s_g[warp], s_doc, t0, kTile, i0, lbk, kdoc, acc);
      else
        lane_grads_off_diagonal(s_g[warp], s_doc, t0, kTile, i0, lbk, bk, kdoc, tile_one_document(qd, kd), acc);
    }
  }
  if (!active) return;
  for (int j = 0; j < kRun; ++j) {
    const int64_t i = i0 + j;
    if (i >= T) continue;
    const double v = kdoc[j] >= 0 ? a.scale * acc[j] : 0.0;
    if (a.dlb64)
      a.dlb64[(l * T + i) * K + kappa] += v;  // the key belongs to this lane alone
    else
      a.dlb[(l * T + i) * K + kappa] = static_cast<float>(v);
  }
}

// ---- reduce ------------------------------------------------------------------------------
// Each thread's (sum, count) added over the kReduceThreads threads of a block in a fixed tree;
// thread 0 writes the totals. Every thread of the block calls it.
__device__ void block_sum_pairs(double s, unsigned long long c, double* out_sum, unsigned long long* out_count) {
  __shared__ double s_sum[kReduceThreads];
  __shared__ unsigned long long s_count[kReduceThreads];
  s_sum[threadIdx.x] = s;
  s_count[threadIdx.x] = c;
  __syncthreads();
  for (int half = kReduceThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) {
      s_sum[threadIdx.x] += s_sum[threadIdx.x + half];
      s_count[threadIdx.x] += s_count[threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *out_sum = s_sum[0];
    *out_count = s_count[0];
  }
}

// One block: the partials in a fixed order (thread x takes x, x + 256, ...; then the tree).
__global__ void __launch_bounds__(kReduceThreads) reduce_kernel(const double* sum, const unsigned long long* count,
                                                                int64_t n, double* out_sum,
                                                                unsigned long long* out_count) {
  double s = 0;
  unsigned long long c = 0;
  for (int64_t x = threadIdx.x; x < n; x += kReduceThreads) {
    s += sum[x];
    c += count[x];
  }
  block_sum_pairs(s, c, out_sum, out_count);
}

// ---- host side ---------------------------------------------------------------------------
template <typename T> T* ptr(Tensor& t) { return static_cast<T*>(t.raw()); }
template <typename T> const T* ptr(const Tensor& t) { return static_cast<const T*>(t.raw()); }

// Launch geometry and the tile data of one log_beta [L, T, K].
struct Plan {
  int64_t L, T, nb;
  int K, W, Z;
  double skip;  // the skip exponent E
  Tensor tile_max;  // F32 [L, nb, K]
  Tensor docs;      // I32 [nb, 3] = TileDocs
  Tensor span_table;  // I32 [nb, 2] = spans::BlockSpan

  Plan(const Tensor& log_beta, const Tensor& doc, double skip_exponent)
      : L(log_beta.dim(0)),
        T(log_beta.dim(1)),
        nb(tile_count(log_beta.dim(1))),
        K(static_cast<int>(log_beta.dim(2))),
        skip(skip_exponent) {
    W = K < kHeadsPerBlock ? K : kHeadsPerBlock;
    Z = (K + W - 1) / W;
    tile_max = Tensor::empty({L, nb, K}, DType::F32, Device::CUDA);
    docs = Tensor::empty({nb, 3}, DType::I32, Device::CUDA);
    static_assert(sizeof(TileDocs) == 3 * sizeof(int32_t), "TileDocs is stored as 3 int32");
    tile_info_kernel<<<dim3(static_cast<unsigned>(nb), static_cast<unsigned>(L)), kTile>>>(
        ptr<float>(log_beta), ptr<int32_t>(doc), T, K, nb, ptr<float>(tile_max), tile_docs());
    RETAIN_LAUNCH_CHECK();
    static_assert(sizeof(spans::BlockSpan) == 2 * sizeof(int32_t), "BlockSpan is stored as 2 int32");
    span_table = Tensor::empty({nb, 2}, DType::I32, Device::CUDA);
    spans::device_block_spans(&tile_docs()->lo, &tile_docs()->hi, 3, static_cast<int32_t>(nb), tile_spans());
  }
  TileDocs* tile_docs() { return reinterpret_cast<TileDocs*>(docs.raw()); }
  spans::BlockSpan* tile_spans() { return reinterpret_cast<spans::BlockSpan*>(span_table.raw()); }

  TileArgs tiles(const Tensor& log_beta, const Tensor& doc) {
    return {ptr<float>(log_beta), ptr<int32_t>(doc), T, nb, K, W, ptr<float>(tile_max), tile_docs(), tile_spans(), skip};
  }
  SumsArgs sums_args(const Tensor& log_beta, const Tensor& doc) {
    SumsArgs a{};
    static_cast<TileArgs&>(a) = tiles(log_beta, doc);
    a.keys = tiles(log_beta, doc);
    return a;
  }
  // A rectangle's rows (their documents q_doc and row_tile_docs q_docs) beside these keys: no
  // spans table, no logβ or tile maxima of their own (the kernels read the keys' for those).
  TileArgs rect_rows(const Tensor& q_doc, const Tensor& q_docs) const {
    return {nullptr, ptr<int32_t>(q_doc), q_doc.dim(0), tile_count(q_doc.dim(0)), K, W, nullptr,
            reinterpret_cast<const TileDocs*>(q_docs.raw()), nullptr, skip};
  }
  // The grads kernel's arguments for these keys, the rows being the same tokens (a rectangle's
  // caller sets the rows' side).
  GradArgs grad_args(const Tensor& log_beta, const Tensor& doc) {
    GradArgs b{};
    static_cast<TileArgs&>(b) = tiles(log_beta, doc);
    b.rows = tiles(log_beta, doc);
    return b;
  }
  void launch_grads(const GradArgs& b) const {
    grads_kernel<<<dim3(static_cast<unsigned>(nb), static_cast<unsigned>(L), static_cast<unsigned>(Z)), 32 * W>>>(b);
    RETAIN_LAUNCH_CHECK();
  }
  void launch_sums(const SumsArgs& a) const {
    sums_kernel<<<dim3(static_cast<unsigned>(nb), static_cast<unsigned>(L), static_cast<unsigned>(Z)), 32 * W>>>(a);
    RETAIN_LAUNCH_CHECK();
  }
  int64_t sum_blocks() const { return nb * L * Z; }
};

// Σ of n per-block partials → (sum, count) on the host.
ops::CapacityLoss reduce_to_host(const Tensor& part_sum, const Tensor& part_count, int64_t n) {
  Tensor out = Tensor::empty({2}, DType::F64, Device::CUDA);  // [sum, count bits]
  double* o = ptr<double>(out);
  reduce_kernel<<<1, kReduceThreads>>>(ptr<double>(part_sum), ptr<unsigned long long>(part_count), n, o,
                                       reinterpret_cast<unsigned long long*>(o + 1));
  RETAIN_LAUNCH_CHECK();
  double host[2];
  CUDA_CHECK(cudaMemcpy(host, o, sizeof(host), cudaMemcpyDeviceToHost));
  unsigned long long count = 0;
  static_assert(sizeof(count) == sizeof(double));
  std::memcpy(&count, &host[1], sizeof(count));
  return {host[0], static_cast<int64_t>(count)};
}

// Global mode: Σ_κ S per (layer, head group, row), then totals_kernel. Fills g / g_any when
// given, and returns the loss partials (nb of them) in part_sum / part_count when given.
void global_totals(Plan& plan, const Tensor& log_beta, const Tensor& doc, const Tensor& positions, double M,
                   double* part_sum, unsigned long long* part_count, float* g, uint8_t* g_any) {
  Tensor head_totals = Tensor::empty({plan.L * plan.Z, plan.T}, DType::F64, Device::CUDA);
  SumsArgs a = plan.sums_args(log_beta, doc);
  a.head_totals = ptr<double>(head_totals);
  plan.launch_sums(a);
  const double N = static_cast<double>(plan.L * plan.K);
  totals_kernel<<<static_cast<unsigned>(plan.nb), kTile>>>(ptr<double>(head_totals), plan.L * plan.Z,
                                                           ptr<int32_t>(doc), ptr<int32_t>(positions), plan.T, M, N,
                                                           part_sum, part_count, g, g_any);
  RETAIN_LAUNCH_CHECK();
}

}  // namespace

void capacity_sums(const Tensor& log_beta, const Tensor& doc, Tensor& S, double skip_exponent) {
  if (log_beta.numel() == 0) return;
  Plan plan(log_beta, doc, skip_exponent);
  SumsArgs a = plan.sums_args(log_beta, doc);
  a.S = ptr<float>(S);
  plan.launch_sums(a);
}

ops::CapacityLoss capacity_loss(const Tensor& log_beta, const Tensor& doc, const Tensor& positions, double memory,
                                ops::CapacityMode mode, double skip_exponent) {
  if (log_beta.numel() == 0) return {};
  Plan plan(log_beta, doc, skip_exponent);
  if (mode == ops::CapacityMode::local) {
    Tensor part_sum = Tensor::empty({plan.sum_blocks()}, DType::F64, Device::CUDA);
    Tensor part_count = Tensor::empty({plan.sum_blocks()}, DType::I64, Device::CUDA);
    SumsArgs a = plan.sums_args(log_beta, doc);
    a.pos = ptr<int32_t>(positions);
    a.M = memory;
    a.part_sum = ptr<double>(part_sum);
    a.part_count = static_cast<unsigned long long*>(part_count.raw());
    plan.launch_sums(a);
    return reduce_to_host(part_sum, part_count, plan.sum_blocks());
  }
  Tensor part_sum = Tensor::empty({plan.nb}, DType::F64, Device::CUDA);
  Tensor part_count = Tensor::empty({plan.nb}, DType::I64, Device::CUDA);
  global_totals(plan, log_beta, doc, positions, memory, ptr<double>(part_sum),
                static_cast<unsigned long long*>(part_count.raw()), nullptr, nullptr);
  return reduce_to_host(part_sum, part_count, plan.nb);
}

void capacity_loss_backward(const Tensor& log_beta, const Tensor& doc, const Tensor& positions, double memory,
                            ops::CapacityMode mode, double scale, Tensor& dlog_beta, double skip_exponent) {
  if (log_beta.numel() == 0) return;
  Plan plan(log_beta, doc, skip_exponent);
  const bool local = mode == ops::CapacityMode::local;
  Tensor g = local ? Tensor::empty(log_beta.shape(), DType::F32, Device::CUDA)
                   : Tensor::empty({plan.T}, DType::F32, Device::CUDA);
  Tensor g_any = local ? Tensor::empty({plan.L, plan.nb, plan.K}, DType::U8, Device::CUDA)
                       : Tensor::empty({plan.nb}, DType::U8, Device::CUDA);
  if (local) {
    SumsArgs a = plan.sums_args(log_beta, doc);
    a.pos = ptr<int32_t>(positions);
    a.M = memory;
    a.g = ptr<float>(g);
    a.g_any = ptr<uint8_t>(g_any);
    plan.launch_sums(a);
  } else {
    global_totals(plan, log_beta, doc, positions, memory, nullptr, nullptr, ptr<float>(g), ptr<uint8_t>(g_any));
  }
  GradArgs b = plan.grad_args(log_beta, doc);
  b.g = ptr<float>(g);
  b.g_any = ptr<uint8_t>(g_any);
  b.per_head = local;
  b.scale = scale;
  b.dlb = ptr<float>(dlog_beta);
  plan.launch_grads(b);
}

// ---- span pairs (context parallelism; kernels/retention_spans.h) -------------------------

namespace {

// The hinge of capacity_hinge from S F64 [L, T, K] (all of the rows' key spans added), the
// CPU's formulas and summation orders per row; g F64 = ∂(Σℓ)/∂S (0 on padding rows and where
// the hinge is flat) when given. Local mode: a thread per element of S; global: a thread per
// row, its Σ_{l,κ} S layer by layer as the CPU adds it. Per-block partials of (Σℓ, #ℓ > 0) in a
// fixed tree order, summed by reduce_kernel: the result does not depend on scheduling.
__global__ void __launch_bounds__(kReduceThreads) hinge_kernel(const double* __restrict__ S,
                                                               const int32_t* __restrict__ doc,
                                                               const int32_t* __restrict__ pos, int64_t L, int64_t T,
                                                               int64_t K, double M, bool local, double* g,
                                                               double* part_sum, unsigned long long* part_count) {
  const int64_t x = static_cast<int64_t>(blockIdx.x) * kReduceThreads + threadIdx.x;
  double ell = 0;
  if (local && x < L * T * K) {
    const int64_t t = (x / K) % T;
    double slope = 0;
    if (doc[t] >= 0) {
      const double den = local_denominator(pos[t], M);
      ell = hinge(S[x] - M, den);
      slope = hinge_slope(S[x] - M, den);
    }
    if (g) g[x] = slope;
  } else if (!local && x < T) {
    const int64_t t = x;
    double slope = 0;
    if (doc[t] >= 0) {
      double total = 0;  // layer by layer, κ within (the CPU's order)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t k = 0; k < K; ++k) total += S[(l * T + t) * K + k];
      const double N = static_cast<double>(L * K);
      const double den = global_denominator(pos[t], M, N);
      ell = hinge(total - M * N, den);
      slope = hinge_slope(total - M * N, den);
    }
    if (g)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t k = 0; k < K; ++k) g[(l * T + t) * K + k] = slope;
  }
  block_sum_pairs(ell, ell > 0 ? 1 : 0, part_sum + blockIdx.x, part_count + blockIdx.x);
}

// grid (nqb, L), kTile threads: g F64 [L, T, K] → the grads kernel's F32 per-head slopes and
// their per-(layer, query tile, head) "any slope ≠ 0" flags.
__global__ void __launch_bounds__(kTile) slopes_kernel(const double* __restrict__ g64, int64_t T, int K, int64_t nqb,
                                                       float* __restrict__ g, uint8_t* __restrict__ g_any) {
  const int64_t qb = blockIdx.x, l = blockIdx.y;
  const int64_t t = qb * kTile + threadIdx.x;
  for (int k = 0; k < K; ++k) {
    const double v = t < T ? g64[(l * T + t) * K + k] : 0.0;
    if (t < T) g[(l * T + t) * K + k] = static_cast<float>(v);
    const int any = __syncthreads_or(v != 0.0);
    if (threadIdx.x == 0) g_any[(l * nqb + qb) * K + k] = any ? 1 : 0;
  }
}

// A rectangle's row side: its tiles' document ranges.
Tensor row_tile_docs(const Tensor& q_doc) {
  const int64_t T = q_doc.dim(0), nb = tile_count(T);
  Tensor docs = Tensor::empty({nb, 3}, DType::I32, Device::CUDA);
  tile_docs_kernel<<<static_cast<unsigned>(nb), kTile>>>(ptr<int32_t>(q_doc), T, reinterpret_cast<TileDocs*>(docs.raw()));
  RETAIN_LAUNCH_CHECK();
  return docs;
}

}  // namespace

void capacity_sums_span(const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, const Tensor& q_doc,
                        int64_t q_start, Tensor& S, double skip_exponent) {
  const SpanPair kind = span_pair("capacity_sums_span", q_start, q_doc.dim(0), k_start, k_doc.dim(0));
  if (kind == SpanPair::none || log_beta.numel() == 0) return;
  if (kind == SpanPair::self) {  // one sequence: the rows' own sums, added to S
    Plan plan(log_beta, k_doc, skip_exponent);
    SumsArgs a = plan.sums_args(log_beta, k_doc);
    a.S64 = ptr<double>(S);
    plan.launch_sums(a);
    return;
  }
  Plan keys(log_beta, k_doc, skip_exponent);  // the key tiles' maxima and documents
  Tensor q_docs = row_tile_docs(q_doc);
  SumsArgs a = keys.sums_args(log_beta, k_doc);  // a.keys: these keys
  static_cast<TileArgs&>(a) = keys.rect_rows(q_doc, q_docs);
  a.gap = q_start - k_start;
  a.rect = true;
  a.S64 = ptr<double>(S);
  sums_kernel<<<dim3(static_cast<unsigned>(a.nb), static_cast<unsigned>(keys.L), static_cast<unsigned>(keys.Z)),
                32 * keys.W>>>(a);
  RETAIN_LAUNCH_CHECK();
}

ops::CapacityLoss capacity_hinge(const Tensor& S, const Tensor& doc, const Tensor& positions, double memory,
                                 ops::CapacityMode mode, Tensor* g) {
  const int64_t L = S.dim(0), T = S.dim(1), K = S.dim(2);
  const bool local = mode == ops::CapacityMode::local;
  const int64_t threads = local ? L * T * K : T;
  if (threads == 0) return {};
  const int64_t blocks = (threads + kReduceThreads - 1) / kReduceThreads;
  Tensor part_sum = Tensor::empty({blocks}, DType::F64, Device::CUDA);
  Tensor part_count = Tensor::empty({blocks}, DType::I64, Device::CUDA);
  hinge_kernel<<<static_cast<unsigned>(blocks), kReduceThreads>>>(
      ptr<double>(S), ptr<int32_t>(doc), ptr<int32_t>(positions), L, T, K, memory, local,
      g ? ptr<double>(*g) : nullptr, ptr<double>(part_sum), static_cast<unsigned long long*>(part_count.raw()));
  RETAIN_LAUNCH_CHECK();
  return reduce_to_host(part_sum, part_count, blocks);
}

void capacity_grad_span(const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, const Tensor& q_doc,
                        int64_t q_start, const Tensor& g, Tensor& dlog_beta, double skip_exponent) {
  const SpanPair kind = span_pair("capacity_grad_span", q_start, q_doc.dim(0), k_start, k_doc.dim(0));
  if (kind == SpanPair::none || log_beta.numel() == 0) return;
  Plan keys(log_beta, k_doc, skip_exponent);
  const int64_t Tq = q_doc.dim(0), nqb = tile_count(Tq);
  Tensor g32 = Tensor::empty({keys.L, Tq, keys.K}, DType::F32, Device::CUDA);
  Tensor g_any = Tensor::empty({keys.L, nqb, keys.K}, DType::U8, Device::CUDA);
  slopes_kernel<<<dim3(static_cast<unsigned>(nqb), static_cast<unsigned>(keys.L)), kTile>>>(
      ptr<double>(g), Tq, keys.K, nqb, ptr<float>(g32), ptr<uint8_t>(g_any));
  RETAIN_LAUNCH_CHECK();
  Tensor q_docs = kind == SpanPair::earlier ? row_tile_docs(q_doc) : Tensor();
  GradArgs b = keys.grad_args(log_beta, k_doc);
  b.g = ptr<float>(g32);
  b.g_any = ptr<uint8_t>(g_any);
  b.per_head = true;
  b.scale = 1.0;
  if (kind == SpanPair::earlier) {
    b.rows = keys.rect_rows(q_doc, q_docs);
    b.gap = q_start - k_start;
    b.rect = true;
  }
  b.dlb64 = ptr<double>(dlog_beta);
  keys.launch_grads(b);
}

}  // namespace retain::cuda
