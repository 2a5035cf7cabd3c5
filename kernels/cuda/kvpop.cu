// CUDA KVPOP ops (DESIGN §5; CPU references kernels/cpu/kvpop_target.cpp and kvpop_mlstm.cpp).
// The per-thread math lives in kernels/cuda/kvpop_tiles.h, shared with a CPU emulation test
// (tests/cuda/test_kvpop_tiles.cpp); this file adds shared memory, barriers and launches.
// Not yet run on a GPU (none has been lent); tests/cuda/test_kvpop_cuda.cpp is the GPU check.
//
// Target (future_attention_target): one block per (64-key tile, KV head), a thread per key;
// query tiles of 64 staged in shared memory per query head of the group, an online float64
// log-sum-exp per (key, head) fed by ≤ 64-term float32 partials, the max over the group.
//
// mLSTM (mlstm_scores, mlstm_scores_backward), every value float64 as the CPU reference:
//   scan       per chunk of 64 tokens a summary (one thread each), the carries (one thread,
//              O(T/64) steps), then per token start/F/m/branch/readout (one thread per chunk).
//   states     chunk c's own terms Σ_j a_{e,j} k̃_j ṽ_jᵀ (a block per chunk, a thread per entry),
//              then the chain state_c = factor_c·state_{c−1} + terms_c (a thread per entry,
//              sequential over chunks). O((T/64)·d·r) memory.
//   readout    a block per readout token: Q, the intra-chunk key weights, num/den, the score.
//   backward   readout_backward (a block per readout: gnum, gden, the readout's ∂F/∂m terms,
//              dq̃), the reverse chain of ∂/∂state (as the forward chain, reversed), key_grads
//              (a block per key: dk̃, dṽ, k̃·dk̃), the two reverse O(T) recurrences of the gate
//              gradients as chunked scans, and dw_o, db_o as column sums in a fixed order.
// No atomics anywhere: every sum has a fixed order, so results are bitwise repeatable.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/base/error.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/kvpop_cuda.h"
#include "kernels/cuda/kvpop_tiles.h"

namespace retain::cuda {

namespace {

using namespace kvpop_tiles;

#define RETAIN_LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

constexpr int kEntryThreads = 256;  // per-entry kernels (state terms, chains, column sums)
constexpr int kChunkThreads = 128;  // one-thread-per-chunk kernels

template <typename T> T* ptr(Tensor& t) { return static_cast<T*>(t.raw()); }
template <typename T> const T* ptr(const Tensor& t) { return static_cast<const T*>(t.raw()); }

unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

// ================================ future-attention target ================================

struct TargetArgs {
  const float* q;    // [T, H, hd]
  const float* k;    // [T, K, hd]
  const float* lse;  // [T, H]
  const int32_t* doc;
  float* log_m;      // [K, T]
  int64_t T, H, K, hd, w;
  float scale;
};

static_assert(kQueryTile == kKeyTile, "thread j stages query j of a tile");

// The target kernels' dynamic shared memory (target_shared_bytes(hd) bytes).
struct TargetSmem {
  float* k;        // [hd][kKeyStride]
  float* q;        // [kQueryTile][hd]
  float* lse;      // [kQueryTile]
  int32_t* kdoc;   // [kKeyTile]
  int32_t* qdoc;   // [kQueryTile]
  __device__ TargetSmem(float* smem, int64_t hd)
      : k(smem),
        q(k + hd * kKeyStride),
        lse(q + kQueryTile * hd),
        kdoc(reinterpret_cast<int32_t*>(lse + kQueryTile)),
        qdoc(kdoc + kKeyTile) {}
};

// Stages rows [a0, a0 + kKeyTile) of KV head kv of k [Tk, K, hd] (zeros past Tk) and their
// documents; returns the tile's last real key (index in the tile, −1: none), after a barrier.
__device__ int stage_key_tile(const TargetSmem& sm, const float* k, const int32_t* doc, int64_t Tk, int64_t K,
                              int64_t hd, int64_t kv, int64_t a0) {
  const int j = threadIdx.x;
  for (int64_t idx = j; idx < kKeyTile * hd; idx += kKeyTile) {  // coalesced over x
    const int64_t jj = idx / hd, x = idx % hd, row = a0 + jj;
    sm.k[x * kKeyStride + jj] = row < Tk ? k[(row * K + kv) * hd + x] : 0.0f;
  }
  sm.kdoc[j] = token_doc(doc, Tk, a0 + j);
  __syncthreads();
  return last_real_key(sm.kdoc);
}

// Stages the query tile of rows [r0, r0 + kQueryTile) of head h (q [Tq, H, hd], lse [Tq, H],
// documents; zeros and no document past Tq), between two barriers: the previous tile's readers
// are done before, this tile is complete for every thread after.
__device__ void stage_query_tile(const TargetSmem& sm, const float* q, const float* lse, const int32_t* doc, int64_t Tq,
                                 int64_t H, int64_t hd, int64_t h, int64_t r0) {
  const int j = threadIdx.x;
  __syncthreads();
  for (int64_t idx = j; idx < kQueryTile * hd; idx += kKeyTile) {
    const int64_t row = r0 + idx / hd;
    sm.q[idx] = row < Tq ? q[(row * H + h) * hd + idx % hd] : 0.0f;
  }
  sm.lse[j] = r0 + j < Tq ? lse[(r0 + j) * H + h] : 0.0f;
  sm.qdoc[j] = token_doc(doc, Tq, r0 + j);
  __syncthreads();
}

// grid (key tiles, K), kKeyTile threads, target_shared_bytes(hd) of dynamic shared memory.
__global__ void __launch_bounds__(kKeyTile) target_kernel(TargetArgs a) {
  extern __shared__ float smem[];
  const TargetSmem sm(smem, a.hd);
  const int j = threadIdx.x;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kKeyTile, kv = blockIdx.y, t = t0 + j;
  const int64_t G = a.H / a.K;
  const int last = stage_key_tile(sm, a.k, a.doc, a.T, a.K, a.hd, kv, t0);
  const int64_t last_key = last < 0 ? -1 : t0 + last;
  const int32_t last_doc = last < 0 ? kNoDoc : sm.kdoc[last];
  float s[kQueryTile];  // this key's scores against the current query tile
  double best = -INFINITY;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = kv * G + g;
    double M = -INFINITY, S = 0.0;
    for (int64_t q0 = t0 + a.w; query_tile_needed(a.doc, a.T, q0, last_key, last_doc); q0 += kQueryTile) {
      stage_query_tile(sm, a.q, a.lse, a.doc, a.T, a.H, a.hd, h, q0);
      const float mx = key_scores(sm.q, sm.lse, sm.qdoc, q0, sm.k + j, a.hd, t, sm.kdoc[j], a.w, a.scale, s);
      lse_add_tile(s, mx, M, S);
    }
    const double v = lse_value(M, S);
    best = v > best ? v : best;
  }
  if (t < a.T) a.log_m[kv * a.T + t] = static_cast<float>(best);
}

// ---- the target by spans (context parallelism; kernels/kvpop.h future_attention_sums) -------
// target_kernel's walk with the keys and queries in two spans of one sequence, at global
// positions (keys [k_start, k_start + Tk), queries [q_start, q_start + Tq)), each (key, head)'s
// running float64 log-sum-exp read from and written back to mx, sum [Tk, H] (the CPU's layout),
// so that any number of query spans add up in turn.
struct SpanTargetArgs {
  const float* q;    // [Tq, H, hd]
  const float* lse;  // [Tq, H]
  const int32_t* q_doc;
  const float* k;    // [Tk, K, hd]
  const int32_t* k_doc;
  double* mx;        // [Tk, H]
  double* sum;       // [Tk, H]
  int64_t Tq, Tk, q_start, k_start, H, K, hd, w;
  float scale;
};

// Whether the query tile at global q0 can hold a query of the key tile's documents (as
// query_tile_needed, on the query span's documents).
__device__ bool span_query_tile_needed(const SpanTargetArgs& a, int64_t q0, int64_t last_key, int32_t last_doc) {
  if (last_key < 0 || q0 >= a.q_start + a.Tq) return false;
  return q0 <= last_key || a.q_doc[q0 - a.q_start] == last_doc;
}

// grid (key tiles of the key span, K), kKeyTile threads, target_shared_bytes(hd).
__global__ void __launch_bounds__(kKeyTile) span_target_kernel(SpanTargetArgs a) {
  extern __shared__ float smem[];
  const TargetSmem sm(smem, a.hd);
  const int j = threadIdx.x;
  const int64_t a0 = static_cast<int64_t>(blockIdx.x) * kKeyTile, kv = blockIdx.y, row = a0 + j;  // rows of k
  const int64_t t0 = a.k_start + a0, t = t0 + j;  // ... as global tokens
  const int64_t G = a.H / a.K;
  const int last = stage_key_tile(sm, a.k, a.k_doc, a.Tk, a.K, a.hd, kv, a0);
  const int64_t last_key = last < 0 ? -1 : t0 + last;
  const int32_t last_doc = last < 0 ? kNoDoc : sm.kdoc[last];
  float s[kQueryTile];
  const int64_t q_first = t0 + a.w > a.q_start ? t0 + a.w : a.q_start;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = kv * G + g;
    double M = row < a.Tk ? a.mx[row * a.H + h] : -INFINITY, S = row < a.Tk ? a.sum[row * a.H + h] : 0.0;
    for (int64_t q0 = q_first; span_query_tile_needed(a, q0, last_key, last_doc); q0 += kQueryTile) {
      stage_query_tile(sm, a.q, a.lse, a.q_doc, a.Tq, a.H, a.hd, h, q0 - a.q_start);  // rows of q from q0's
      const float mx = key_scores(sm.q, sm.lse, sm.qdoc, q0, sm.k + j, a.hd, t, sm.kdoc[j], a.w, a.scale, s);
      lse_add_tile(s, mx, M, S);
    }
    if (row < a.Tk) {
      a.mx[row * a.H + h] = M;
      a.sum[row * a.H + h] = S;
    }
  }
}

// log_m [K, Tk] = max over the group's heads of lse_value(mx, sum), a thread per (κ, key).
__global__ void span_target_finish_kernel(const double* mx, const double* sum, int64_t Tk, int64_t H, int64_t K,
                                          float* log_m) {
  const int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (x >= K * Tk) return;
  const int64_t kv = x / Tk, t = x % Tk, G = H / K;
  double best = -INFINITY;
  for (int64_t g = 0; g < G; ++g) {
    const double v = lse_value(mx[t * H + kv * G + g], sum[t * H + kv * G + g]);
    best = v > best ? v : best;
  }
  log_m[x] = static_cast<float>(best);
}

// ==================================== chunkwise mLSTM ====================================

struct MlstmArgs {
  const float *q, *k, *v, *igate, *log_f;  // Projected: [T, d], [T, d], [T, r], [T], [T]
  const int32_t* doc;
  const float* w_o;  // [r]
  const float* b_o;  // [1]
  int64_t T, d, r, w, nc, S;  // S = d·r + d doubles per state
  double inv_sqrt_d;
};

// ---- scan -------------------------------------------------------------------------------
__global__ void scan_summary_kernel(MlstmArgs a, ScanState* summary) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c < a.nc) summary[c] = scan_summary(a.doc, a.log_f, a.igate, c * kChunk, chunk_end(a.T, c) + 1, a.w);
}

__global__ void scan_carry_kernel(const ScanState* summary, int64_t nc, ScanState* carry_in) {
  scan_carries(summary, nc, carry_in);  // <<<1, 1>>>
}

__global__ void scan_tokens_kernel(MlstmArgs a, const ScanState* carry_in, ScanOut out) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c < a.nc) scan_tokens(a.doc, a.log_f, a.igate, c * kChunk, chunk_end(a.T, c) + 1, a.w, carry_in[c], &out);
}

// ---- chunk states ---------------------------------------------------------------------------
// grid nc, kEntryThreads: chunk c's own terms of its end state, and its chain factor.
__global__ void __launch_bounds__(kEntryThreads) state_terms_kernel(MlstmArgs a, ScanView s, double* state,
                                                                    double* factor) {
  __shared__ double aw[kChunk];
  const int64_t c = blockIdx.x, e = chunk_end(a.T, c);
  const Range src = chunk_sources(s, a.T, c);
  if (threadIdx.x < kChunk) {
    const int64_t j = src.lo + threadIdx.x;
    aw[threadIdx.x] = j < src.hi ? a_weight(s, a.igate, e, j) : 0.0;
  }
  if (threadIdx.x == 0) factor[c] = chunk_factor(s, a.T, c);
  __syncthreads();
  for (int64_t idx = threadIdx.x; idx < a.S; idx += blockDim.x) state[c * a.S + idx] = state_term(a.k, a.v, a.d, a.r, aw, src, idx);
}

// grid nc, kEntryThreads: chunk c's terms of the reverse state (the readouts in chunk c + 1 that
// read chunk c's end state), and its reverse chain factor.
__global__ void __launch_bounds__(kEntryThreads) reverse_terms_kernel(MlstmArgs a, ScanView s, const double* gnum,
                                                                      const double* gden, double* dstate,
                                                                      double* factor) {
  __shared__ double wt[kChunk];
  const int64_t c = blockIdx.x, e = chunk_end(a.T, c);
  const Range readers = chunk_readers(s, a.T, c);
  if (threadIdx.x < kChunk) {
    const int64_t t = readers.lo + threadIdx.x;
    wt[threadIdx.x] = t < readers.hi && s.readout[t] ? carry_factor(s, e, t) : 0.0;
  }
  if (threadIdx.x == 0) factor[c] = reverse_factor(s, a.T, c);
  __syncthreads();
  for (int64_t idx = threadIdx.x; idx < a.S; idx += blockDim.x)
    dstate[c * a.S + idx] = reverse_state_term(s.readout, a.q, gnum, gden, a.d, a.r, a.w, a.inv_sqrt_d, wt, readers, idx);
}

// A thread per state entry, sequential over the chunks.
__global__ void __launch_bounds__(kEntryThreads) chain_kernel(double* state, const double* factor, int64_t nc,
                                                              int64_t S, bool reverse) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx < S) chain_entry(state, factor, nc, S, idx, reverse);
}

// ---- readouts ---------------------------------------------------------------------------------
// What the forward and backward readout blocks share: Q, the key weights and num/den (sums[r]).
struct ReadoutShared {
  double Q[kMaxHeadDim];
  double az[kChunk];
  double sums[kMaxHeadDim / 2 + 1];
};

// Fills sh for readout t (kThreads threads; ends after a barrier). Returns the carried state.
__device__ const double* readout_sums(const MlstmArgs& a, const ScanView& s, const double* state, int64_t t,
                                      ReadoutShared& sh, Carry& cc, Range& keys) {
  const int64_t u = t - a.w + 1;
  for (int64_t x = threadIdx.x; x < a.d; x += blockDim.x) sh.Q[x] = query_entry(a.q, u, a.d, a.inv_sqrt_d, x);
  __syncthreads();
  keys = readout_keys(s, t);
  if (threadIdx.x < keys.hi - keys.lo)
    sh.az[threadIdx.x] = readout_key_weight(s, a.k, a.igate, a.d, sh.Q, t, keys.lo + threadIdx.x);
  cc = chunk_carry(s, t);
  const double* prev = cc.on ? state + (t / kChunk - 1) * a.S : nullptr;
  __syncthreads();
  for (int64_t y = threadIdx.x; y <= a.r; y += blockDim.x) sh.sums[y] = readout_sum(prev, cc.g, sh.Q, sh.az, a.v, keys, a.d, a.r, y);
  __syncthreads();
  return prev;
}

// grid T, kThreads: score_u for readout t (other blocks return at once).
__global__ void __launch_bounds__(kThreads) readout_kernel(MlstmArgs a, ScanView s, const double* state,
                                                           float* score) {
  const int64_t t = blockIdx.x;
  if (!s.readout[t]) return;  // uniform over the block
  __shared__ ReadoutShared sh;
  __shared__ double terms[kMaxHeadDim / 2];
  Carry cc;
  Range keys;
  readout_sums(a, s, state, t, sh, cc, keys);
  const Norm nrm = readout_norm(sh.sums[a.r], s.m[t]);
  for (int64_t y = threadIdx.x; y < a.r; y += blockDim.x) terms[y] = score_term(a.w_o[y], sh.sums[y], nrm);
  __syncthreads();
  if (threadIdx.x == 0) score[t - a.w + 1] = static_cast<float>(score_value(a.b_o[0], terms, a.r));
}

// Outputs of readout_backward_kernel, per readout t ([T] or [T, ·]; zero elsewhere).
struct ReadoutGrads {
  double* gnum;   // [T, r]
  double* gden;   // [T]
  double* gF;     // [T] the readout's ∂/∂F_t
  double* gm;     // [T] the readout's ∂/∂m_t
  double* parts;  // [T, r + 1]: ds·silu(h_y) (dw_o), then ds (db_o)
  float* dq;      // dP.q [T, d], row u
};

// grid T, kThreads: the CPU's pass 1 for readout t.
__global__ void __launch_bounds__(kThreads) readout_backward_kernel(MlstmArgs a, ScanView s, const double* state,
                                                                    const float* dscore, ReadoutGrads o) {
  const int64_t t = blockIdx.x;
  if (!s.readout[t]) return;
  __shared__ ReadoutShared sh;
  __shared__ double gn[kMaxHeadDim / 2], gh_h[kMaxHeadDim / 2], gn_num[kMaxHeadDim / 2], coef[kChunk];
  __shared__ double gd;
  Carry cc;
  Range keys;
  const double* prev = readout_sums(a, s, state, t, sh, cc, keys);
  const int64_t u = t - a.w + 1, r = a.r;
  const double ds = dscore[u];
  const Norm nrm = readout_norm(sh.sums[r], s.m[t]);
  for (int64_t y = threadIdx.x; y < r; y += blockDim.x) {
    const ReadoutGradY g = readout_grad_y(ds, a.w_o[y], sh.sums[y], nrm);
    gn[y] = g.gnum;
    gh_h[y] = g.gh_h;
    gn_num[y] = g.gnum_num;
    o.gnum[t * r + y] = g.gnum;
    o.parts[t * (r + 1) + y] = g.dwo;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const ReadoutGrad g = readout_grad(gh_h, gn_num, r, sh.sums[r], nrm);
    gd = g.gden;
    o.gden[t] = g.gden;
    o.gF[t] = g.gF;
    o.gm[t] = g.gm;
    o.parts[t * (r + 1) + r] = ds;
  }
  __syncthreads();
  if (threadIdx.x < keys.hi - keys.lo)
    coef[threadIdx.x] = readout_key_coef(s, a.v, a.igate, r, gn, gd, t, keys.lo + threadIdx.x);
  __syncthreads();
  for (int64_t x = threadIdx.x; x < a.d; x += blockDim.x)
    o.dq[u * a.d + x] = static_cast<float>(readout_dq(prev, cc.g, gn, gd, coef, a.k, keys, a.d, r, x) * a.inv_sqrt_d);
}

// grid T, kThreads: the CPU's pass 3 for key j: dk̃_j, dṽ_j and k̃_j·dk̃_j.
__global__ void __launch_bounds__(kThreads) key_grads_kernel(MlstmArgs a, ScanView s, const double* dstate,
                                                             const double* gnum, const double* gden, float* dk_out,
                                                             float* dv_out, double* kdk) {
  const int64_t j = blockIdx.x;
  if (a.doc[j] < 0) return;  // padding: zero gradients (the outputs start zeroed)
  __shared__ double ac[kChunk], az[kChunk], dk[kMaxHeadDim];
  const Range readers = key_readers(s, a.T, j);
  if (threadIdx.x < readers.hi - readers.lo) {
    const KeyReader kr = key_reader(s, a.q, a.k, a.v, a.igate, gnum, gden, a.d, a.r, a.w, a.inv_sqrt_d,
                                    readers.lo + threadIdx.x, j);
    ac[threadIdx.x] = kr.ac;
    az[threadIdx.x] = kr.az;
  }
  __syncthreads();
  const int64_t c = j / kChunk, e = chunk_end(a.T, c);
  const bool to_end = same_run(s, j, e);
  const double* ds = to_end ? dstate + c * a.S : nullptr;
  const double b = to_end ? a_weight(s, a.igate, e, j) : 0.0;
  for (int64_t x = threadIdx.x; x < a.d; x += blockDim.x) {
    dk[x] = key_dk(s.readout, a.q, a.v, ac, readers, ds, b, a.d, a.r, a.w, a.inv_sqrt_d, j, x);
    dk_out[j * a.d + x] = static_cast<float>(dk[x]);
  }
  for (int64_t y = threadIdx.x; y < a.r; y += blockDim.x)
    dv_out[j * a.r + y] = static_cast<float>(key_dv(s.readout, a.k, gnum, az, readers, ds, b, a.d, a.r, j, y));
  __syncthreads();
  if (threadIdx.x == 0) kdk[j] = key_dot(a.k, dk, a.d, j);
}

// ---- gate gradients: two reverse recurrences as a chunked scan ---------------------------------
struct GateValues {
  const double *gm, *gF, *kdk;  // [T]
};

__global__ void suffix_summary_kernel(MlstmArgs a, ScanView s, GateValues g, Suffix* summary) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c < a.nc)
    summary[c] = suffix_tokens(s, a.T, g.gm, g.gF, g.kdk, c * kChunk, chunk_end(a.T, c) + 1, Suffix{0.0, 0.0, 0, 0},
                               nullptr, nullptr);
}

__global__ void suffix_carry_kernel(const Suffix* summary, int64_t nc, Suffix* carry_in) {
  suffix_carries(summary, nc, carry_in);  // <<<1, 1>>>
}

__global__ void suffix_tokens_kernel(MlstmArgs a, ScanView s, GateValues g, const Suffix* carry_in, float* d_igate,
                                     float* d_log_f) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c < a.nc)
    suffix_tokens(s, a.T, g.gm, g.gF, g.kdk, c * kChunk, chunk_end(a.T, c) + 1, carry_in[c], d_igate, d_log_f);
}

// ---- dw_o, db_o ---------------------------------------------------------------------------------
// grid nc: per chunk, the column sums of parts [T, cols] (cols = r + 1).
__global__ void __launch_bounds__(kEntryThreads) column_partials_kernel(const double* parts, int64_t T, int64_t cols,
                                                                        double* partial) {
  const int64_t c = blockIdx.x;
  for (int64_t col = threadIdx.x; col < cols; col += blockDim.x)
    partial[c * cols + col] = column_sum(parts, cols, c * kChunk, chunk_end(T, c) + 1, col);
}

// One block: the chunk partials in increasing c → dw_o [r] (columns < r), db_o [1] (column r).
__global__ void __launch_bounds__(kEntryThreads) column_totals_kernel(const double* partial, int64_t nc, int64_t r,
                                                                      float* dw_o, float* db_o) {
  for (int64_t col = threadIdx.x; col <= r; col += blockDim.x) {
    const float total = static_cast<float>(column_sum(partial, r + 1, 0, nc, col));
    if (col < r)
      dw_o[col] = total;
    else
      db_o[0] = total;
  }
}

// ---- host side ----------------------------------------------------------------------------------

// The scan and the forward chunk states of one call, on the device.
struct MlstmPlan {
  MlstmArgs a{};
  Tensor start, F, m, branch, readout;  // [T]
  Tensor state, factor;                 // [nc, S], [nc]

  // b_o may be null (the backward never reads it).
  MlstmPlan(const kvpop::Projected& P, const Tensor& doc, int64_t w, const Tensor& w_o, const float* b_o) {
    a.q = ptr<float>(P.q);
    a.k = ptr<float>(P.k);
    a.v = ptr<float>(P.v);
    a.igate = ptr<float>(P.igate);
    a.log_f = ptr<float>(P.log_f);
    a.doc = ptr<int32_t>(doc);
    a.w_o = ptr<float>(w_o);
    a.b_o = b_o;
    a.T = P.q.dim(0);
    a.d = P.q.dim(1);
    a.r = P.v.dim(1);
    a.w = w;
    a.nc = chunk_count(a.T);
    a.S = a.d * a.r + a.d;
    a.inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(a.d));
    if (a.d > kMaxHeadDim)  // the readout blocks' static shared arrays
      fail("kvpop::mlstm_scores: d = {} is above the CUDA kernels' limit {}", a.d, kMaxHeadDim);
    const Device cuda = Device::CUDA;
    start = Tensor::empty({a.T}, DType::I64, cuda);
    F = Tensor::empty({a.T}, DType::F64, cuda);
    m = Tensor::empty({a.T}, DType::F64, cuda);
    branch = Tensor::empty({a.T}, DType::U8, cuda);
    readout = Tensor::empty({a.T}, DType::U8, cuda);
    state = Tensor::empty({a.nc, a.S}, DType::F64, cuda);
    factor = Tensor::empty({a.nc}, DType::F64, cuda);
    if (a.T == 0) return;
    scan();
    const ScanView s = view();
    state_terms_kernel<<<static_cast<unsigned>(a.nc), kEntryThreads>>>(a, s, ptr<double>(state), ptr<double>(factor));
    RETAIN_LAUNCH_CHECK();
    chain_kernel<<<blocks_for(a.S, kEntryThreads), kEntryThreads>>>(ptr<double>(state), ptr<double>(factor), a.nc,
                                                                     a.S, false);
    RETAIN_LAUNCH_CHECK();
  }

  void scan() {
    static_assert(sizeof(ScanState) == 4 * sizeof(double), "ScanState is stored as 4 doubles");
    Tensor summary = Tensor::empty({a.nc, 4}, DType::F64, Device::CUDA);
    Tensor carry = Tensor::empty({a.nc, 4}, DType::F64, Device::CUDA);
    auto* sum_p = static_cast<ScanState*>(summary.raw());
    auto* carry_p = static_cast<ScanState*>(carry.raw());
    const unsigned grid = blocks_for(a.nc, kChunkThreads);
    scan_summary_kernel<<<grid, kChunkThreads>>>(a, sum_p);
    RETAIN_LAUNCH_CHECK();
    scan_carry_kernel<<<1, 1>>>(sum_p, a.nc, carry_p);
    RETAIN_LAUNCH_CHECK();
    const ScanOut out{ptr<int64_t>(start), ptr<double>(F), ptr<double>(m), ptr<uint8_t>(branch), ptr<uint8_t>(readout)};
    scan_tokens_kernel<<<grid, kChunkThreads>>>(a, carry_p, out);
    RETAIN_LAUNCH_CHECK();
  }

  ScanView view() const {
    return ScanView{a.doc, ptr<int64_t>(start), ptr<double>(F), ptr<double>(m), ptr<uint8_t>(branch),
                    ptr<uint8_t>(readout)};
  }
};

}  // namespace

// The target kernels' dynamic shared memory for head_dim hd, the kernel opted in to it (above the
// 48 KiB default, hd ≥ 94); fails when the device allows less per block.
template <typename Kernel>
size_t target_smem(const char* op, Kernel kernel, int64_t hd) {
  const size_t smem = target_shared_bytes(hd);
  int device = 0, optin = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (smem > static_cast<size_t>(optin))
    fail("{}: head_dim {} needs {} bytes of shared memory per block, the device allows {}", op, hd, smem, optin);
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  return smem;
}

Tensor kvpop_future_attention_target(const Tensor& q, const Tensor& k, const Tensor& lse, const Tensor& doc, int64_t w,
                                     float scale) {
  const int64_t T = q.dim(0), H = q.dim(1), hd = q.dim(2), K = k.dim(1);
  Tensor log_m = Tensor::empty({K, T}, DType::F32, Device::CUDA);
  if (T == 0) return log_m;
  const size_t smem = target_smem("kvpop::future_attention_target", target_kernel, hd);
  const TargetArgs a{ptr<float>(q), ptr<float>(k), ptr<float>(lse), ptr<int32_t>(doc), ptr<float>(log_m), T, H, K, hd,
                     w, scale};
  target_kernel<<<dim3(static_cast<unsigned>(key_tile_count(T)), static_cast<unsigned>(K)), kKeyTile, smem>>>(a);
  RETAIN_LAUNCH_CHECK();
  return log_m;
}

void kvpop_future_attention_sums(const Tensor& q, const Tensor& lse, const Tensor& q_doc, int64_t q_start,
                                 const Tensor& k, const Tensor& k_doc, int64_t k_start, int64_t w, float scale, Tensor& mx,
                                 Tensor& sum) {
  const int64_t Tq = q.dim(0), H = q.dim(1), hd = q.dim(2), Tk = k.dim(0), K = k.dim(1);
  if (Tq == 0 || Tk == 0) return;
  const size_t smem = target_smem("kvpop::future_attention_sums", span_target_kernel, hd);
  const SpanTargetArgs a{ptr<float>(q), ptr<float>(lse), ptr<int32_t>(q_doc), ptr<float>(k), ptr<int32_t>(k_doc),
                         ptr<double>(mx), ptr<double>(sum), Tq, Tk, q_start, k_start, H, K, hd, w, scale};
  span_target_kernel<<<dim3(static_cast<unsigned>(key_tile_count(Tk)), static_cast<unsigned>(K)), kKeyTile, smem>>>(a);
  RETAIN_LAUNCH_CHECK();
}

Tensor kvpop_future_attention_finish(const Tensor& mx, const Tensor& sum, int64_t K) {
  const int64_t Tk = mx.dim(0), H = mx.dim(1);
  Tensor log_m = Tensor::empty({K, Tk}, DType::F32, Device::CUDA);
  if (Tk == 0) return log_m;
  span_target_finish_kernel<<<blocks_for(K * Tk, 256), 256>>>(ptr<double>(mx), ptr<double>(sum), Tk, H, K,
                                                              ptr<float>(log_m));
  RETAIN_LAUNCH_CHECK();
  return log_m;
}

Tensor kvpop_mlstm_scores(const kvpop::Projected& P, const Tensor& doc, int64_t w, const Tensor& w_o,
                          const Tensor& b_o) {
  const MlstmPlan plan(P, doc, w, w_o, ptr<float>(b_o));
  Tensor score = Tensor::zeros({plan.a.T}, DType::F32, Device::CUDA);  // 0 for unscored tokens
  if (plan.a.T == 0) return score;
  readout_kernel<<<static_cast<unsigned>(plan.a.T), kThreads>>>(plan.a, plan.view(), ptr<double>(plan.state),
                                                                 ptr<float>(score));
  RETAIN_LAUNCH_CHECK();
  return score;
}

kvpop::Projected kvpop_mlstm_scores_backward(const kvpop::Projected& P, const Tensor& doc, int64_t w, const Tensor& w_o,
                                             const Tensor& dscore, Tensor& dw_o, Tensor& db_o) {
  const MlstmPlan plan(P, doc, w, w_o, nullptr);
  const MlstmArgs& a = plan.a;
  const int64_t T = a.T, d = a.d, r = a.r, nc = a.nc;
  const Device cuda = Device::CUDA;
  kvpop::Projected dP{Tensor::zeros({T, d}, DType::F32, cuda), Tensor::zeros({T, d}, DType::F32, cuda),
                      Tensor::zeros({T, r}, DType::F32, cuda), Tensor::zeros({T}, DType::F32, cuda),
                      Tensor::zeros({T}, DType::F32, cuda)};
  dw_o = Tensor::zeros({r}, DType::F32, cuda);
  db_o = Tensor::zeros({1}, DType::F32, cuda);
  if (T == 0) return dP;
  const ScanView s = plan.view();

  // Pass 1: per readout (every buffer zero where no readout writes: later passes read them).
  Tensor gnum = Tensor::zeros({T, r}, DType::F64, cuda), gden = Tensor::zeros({T}, DType::F64, cuda);
  Tensor gF = Tensor::zeros({T}, DType::F64, cuda), gm = Tensor::zeros({T}, DType::F64, cuda);
  Tensor parts = Tensor::zeros({T, r + 1}, DType::F64, cuda);
  const ReadoutGrads o{ptr<double>(gnum), ptr<double>(gden), ptr<double>(gF), ptr<double>(gm), ptr<double>(parts),
                       ptr<float>(dP.q)};
  readout_backward_kernel<<<static_cast<unsigned>(T), kThreads>>>(a, s, ptr<double>(plan.state), ptr<float>(dscore), o);
  RETAIN_LAUNCH_CHECK();

  // Pass 2: the reverse chunk-end states.
  Tensor dstate = Tensor::empty({nc, a.S}, DType::F64, cuda), rfactor = Tensor::empty({nc}, DType::F64, cuda);
  reverse_terms_kernel<<<static_cast<unsigned>(nc), kEntryThreads>>>(a, s, ptr<double>(gnum), ptr<double>(gden),
                                                                     ptr<double>(dstate), ptr<double>(rfactor));
  RETAIN_LAUNCH_CHECK();
  chain_kernel<<<blocks_for(a.S, kEntryThreads), kEntryThreads>>>(ptr<double>(dstate), ptr<double>(rfactor), nc, a.S,
                                                                   true);
  RETAIN_LAUNCH_CHECK();

  // Pass 3: per key.
  Tensor kdk = Tensor::zeros({T}, DType::F64, cuda);
  key_grads_kernel<<<static_cast<unsigned>(T), kThreads>>>(a, s, ptr<double>(dstate), ptr<double>(gnum),
                                                           ptr<double>(gden), ptr<float>(dP.k), ptr<float>(dP.v),
                                                           ptr<double>(kdk));
  RETAIN_LAUNCH_CHECK();

  // Pass 4: the gate gradients, then dw_o and db_o.
  static_assert(sizeof(Suffix) == 3 * sizeof(double), "Suffix is stored as 3 doubles");
  Tensor summary = Tensor::empty({nc, 3}, DType::F64, cuda), carry = Tensor::empty({nc, 3}, DType::F64, cuda);
  auto* sum_p = static_cast<Suffix*>(summary.raw());
  auto* carry_p = static_cast<Suffix*>(carry.raw());
  const GateValues g{ptr<double>(gm), ptr<double>(gF), ptr<double>(kdk)};
  const unsigned grid = blocks_for(nc, kChunkThreads);
  suffix_summary_kernel<<<grid, kChunkThreads>>>(a, s, g, sum_p);
  RETAIN_LAUNCH_CHECK();
  suffix_carry_kernel<<<1, 1>>>(sum_p, nc, carry_p);
  RETAIN_LAUNCH_CHECK();
  suffix_tokens_kernel<<<grid, kChunkThreads>>>(a, s, g, carry_p, ptr<float>(dP.igate), ptr<float>(dP.log_f));
  RETAIN_LAUNCH_CHECK();
  Tensor partial = Tensor::empty({nc, r + 1}, DType::F64, cuda);
  column_partials_kernel<<<static_cast<unsigned>(nc), kEntryThreads>>>(ptr<double>(parts), T, r + 1,
                                                                       ptr<double>(partial));
  RETAIN_LAUNCH_CHECK();
  column_totals_kernel<<<1, kEntryThreads>>>(ptr<double>(partial), nc, r, ptr<float>(dw_o), ptr<float>(db_o));
  RETAIN_LAUNCH_CHECK();
  return dP;
}

}  // namespace retain::cuda
