// The per-thread math of the CUDA KVPOP kernels (kernels/cuda/kvpop.cu), written as
// __host__ __device__ functions so that tests/cuda/test_kvpop_tiles.cpp runs the very same code
// on the CPU (each kernel's grid, block phases and threads emulated in order) against the CPU
// references kernels/cpu/kvpop_target.cpp and kvpop_mlstm.cpp in every CI build, GPU or not.
// Plain C++ when not compiled by nvcc (and C++17: nvcc compiles it as such). Every function
// is one thread's work between two barriers of its kernel; the kernels add shared memory,
// barriers and launches. The multiply-adds of the sums are explicit fma/fmaf, so that host and
// device round them alike (nvcc may still fuse a few other products: float64 rounding-order
// differences only, far inside the tests' tolerances).
//
// None of this has run on a GPU yet (no GPU has been lent): the host emulation is what checks
// it; tests/cuda/test_kvpop_cuda.cpp is the GPU check for when one is.
#pragma once
#include <math.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/host_device.h"

#include "kernels/kvpop.h"

namespace retain::cuda::kvpop_tiles {

// ================= future-attention target (kvpop::future_attention_target) =================
// A block owns a tile of kKeyTile keys and one KV head κ, a thread one key t. Per query head h
// of κ's group it walks the queries d ≥ t0 + w (t0: the tile's first key) in tiles of
// kQueryTile staged in shared memory, and keeps per key an online log-sum-exp of
// s = q_d·k_t·scale − lse[d, h] (log p_{d→t}); log m[κ, t] is the max over the group's heads.
// Memory: the output and shared tiles, no T×T buffer. Work: Σ_docs len²·H·hd / 2 FMAs.
//
// Accuracy (what the tests' per-key bound spells out). s is a float32 dot product of hd FMA
// steps (error ≤ γ_hd·scale·Σ_x |q_x k_x|, γ_n = n·u/(1 − n·u), u = 2^-24) plus the one
// rounding of s = fmaf(dot, scale, −lse) ≤ u·|s|. Per query tile the exp-sum relative to the
// tile max m is a float32 sum of ≤ 64 terms expf(s − m) ∈ [0, 1] (each ≤ 2 ulp from expf, its
// argument rounded by ≤ u·|s − m|; the sum ≤ 63u relative), merged into a float64 (max, sum):
// |Δ log m| ≤ max over terms of the score error + ~70u. The CPU reference computes the dot
// products and sums in float64. On the GPU the lse input itself comes from the bf16 attention
// kernel, whose error is far larger than this.
inline constexpr int kKeyTile = 64;        // keys per block = threads per block
inline constexpr int kQueryTile = 64;      // queries staged per step
inline constexpr int kKeyStride = kKeyTile + 1;  // shared keys are [hd][kKeyStride]: the +1
                                                 // keeps both the staging writes and the
                                                 // per-thread reads free of bank conflicts
inline constexpr int32_t kNoDoc = -1;      // padding or beyond T: never a key's document

RETAIN_HD int64_t key_tile_count(int64_t T) { return (T + kKeyTile - 1) / kKeyTile; }

// Dynamic shared memory of the target kernel: keys [hd][kKeyStride], queries [kQueryTile][hd],
// lse [kQueryTile] (floats), then key and query documents (int32).
RETAIN_HD size_t target_shared_bytes(int64_t hd) {
  return sizeof(float) * static_cast<size_t>(hd * kKeyStride + kQueryTile * hd + kQueryTile) +
         sizeof(int32_t) * static_cast<size_t>(kKeyTile + kQueryTile);
}

// The document of token t as a key or query: kNoDoc for padding and for t ≥ T.
RETAIN_HD int32_t token_doc(const int32_t* doc, int64_t T, int64_t t) {
  return t < T && doc[t] >= 0 ? doc[t] : kNoDoc;
}

// The tile's last key that is not padding (index in the tile, −1 when there is none).
RETAIN_HD int last_real_key(const int32_t* key_docs) {
  for (int j = kKeyTile - 1; j >= 0; --j)
    if (key_docs[j] >= 0) return j;
  return -1;
}

// Whether the query tile starting at q0 can hold a query of one of the key tile's documents.
// Documents are contiguous runs, and the tile's last real key (position last_key, document
// last_doc) has the run that ends last: once q0 is past last_key and outside that run, no later
// query belongs to any of the tile's documents. Uniform over the block (no thread-local input).
RETAIN_HD bool query_tile_needed(const int32_t* doc, int64_t T, int64_t q0, int64_t last_key, int32_t last_doc) {
  if (last_key < 0 || q0 >= T) return false;
  return q0 <= last_key || doc[q0] == last_doc;
}

// One key against the staged query tile (queries q0 .. q0 + kQueryTile − 1): s[i] = q_i·k·scale −
// lse_i where the pair counts (same document, dq ≥ t + w), −inf elsewhere; returns max_i s[i].
// tile_q [kQueryTile][hd]; key: the thread's key in shared memory, element x at key[x·kKeyStride].
RETAIN_HD float key_scores(const float* tile_q, const float* tile_lse, const int32_t* tile_doc, int64_t q0,
                                 const float* key, int64_t hd, int64_t t, int32_t key_doc, int64_t w, float scale,
                                 float* s) {
  float mx = -INFINITY;
  for (int i = 0; i < kQueryTile; ++i) {
    if (key_doc < 0 || tile_doc[i] != key_doc || q0 + i < t + w) {
      s[i] = -INFINITY;
      continue;
    }
    const float* qi = tile_q + i * hd;
    float dot = 0.0f;
    for (int64_t x = 0; x < hd; ++x) dot = fmaf(qi[x], key[x * kKeyStride], dot);
    s[i] = fmaf(dot, scale, -tile_lse[i]);
    mx = fmaxf(mx, s[i]);
  }
  return mx;
}

// Adds a query tile's terms (scores s, their max mx) to the running float64 log-sum-exp (M, S)
// of one (key, head): a float32 partial Σ expf(s_i − mx) of ≤ 64 terms in [0, 1], rescaled once.
RETAIN_HD void lse_add_tile(const float* s, float mx, double& M, double& S) {
  if (mx == -INFINITY) return;  // no pair in this tile
  float p = 0.0f;
  for (int i = 0; i < kQueryTile; ++i) p += expf(s[i] - mx);  // expf(−inf) = 0
  const double m = mx;
  if (m > M) {
    S = S * exp(M - m) + static_cast<double>(p);  // M = −inf at first: S = 0·0
    M = m;
  } else {
    S += static_cast<double>(p) * exp(m - M);
  }
}

// log Σ = M + log S, −inf when no term was added (the key has no target for this head).
RETAIN_HD double lse_value(double M, double S) { return S > 0 ? M + log(S) : -INFINITY; }

// ======================= chunkwise mLSTM (kvpop::mlstm_scores[_backward]) ======================
// The CPU reference's scheme (kernels/cpu/kvpop_mlstm.cpp; docs/math.md "KVPOP"), every value
// in float64 as there: a scan gives per token the run start, F_t (cumulative log f in the run),
// the stabilizer m_t, which branch of its max was taken, and whether t reads out u = t − w + 1.
// The stabilized state after each 64-token chunk's last token e, C_e [d, r] and n_e [d] (one
// "state" of S = d·r + d doubles), is the previous chunk's state times exp(F_e − F_ep + m_ep −
// m_e) plus the chunk's own keys: the chunk terms are parallel over chunks, the chain over
// chunks is sequential per state entry. Readouts combine the previous chunk's state with the
// keys of their own chunk. The backward mirrors the CPU's four passes; its two O(T) reverse
// recurrences are chunked scans like the forward scan. All reductions run in a fixed order:
// results are deterministic.
inline constexpr int kChunk = 64;         // tokens per chunk (as the CPU reference)
inline constexpr int kThreads = 64;       // threads of the per-token and per-chunk blocks
inline constexpr int kMaxHeadDim = 256;   // largest d (static shared arrays of the readouts)
static_assert(kThreads == kChunk, "one thread per token of a chunk");

RETAIN_HD int64_t chunk_count(int64_t T) { return (T + kChunk - 1) / kChunk; }
RETAIN_HD int64_t chunk_end(int64_t T, int64_t c) {  // the chunk's last token
  const int64_t e = (c + 1) * kChunk;
  return (e < T ? e : T) - 1;
}

// Tokens [lo, hi).
struct Range {
  int64_t lo, hi;
};

// ---- the scan ------------------------------------------------------------------------------
// The state after a token: its run's first token, F and m; `restarts` records whether a run
// started (or padding occurred) inside the scanned tokens, in which case the state does not
// depend on what came before them. 32 bytes (stored as F64 [nc, 4] on the device).
struct ScanState {
  int64_t start;
  double F, m;
  int32_t restarts, unused;
};

// Where scan_tokens writes the per-token results (all [T]).
struct ScanOut {
  int64_t* start;
  double* F;
  double* m;
  uint8_t* forget_branch;  // m_t took log f_t + m_{t−1} (else ĩ_t)
  uint8_t* readout;        // t reads out u = t − w + 1
};

// The CPU scan's recurrence over tokens [c0, c1), starting from `in` (the state after c0 − 1,
// used only when c0 continues that token's run). Writes per-token results when out != nullptr.
RETAIN_HD ScanState scan_tokens(const int32_t* doc, const float* log_f, const float* igate, int64_t c0,
                                      int64_t c1, int64_t w, ScanState in, const ScanOut* out) {
  ScanState s = in;
  s.restarts = 0;
  for (int64_t t = c0; t < c1; ++t) {
    const bool first = t == 0 || doc[t] != doc[t - 1] || doc[t] < 0;
    if (first) {
      s.start = t;
      s.restarts = 1;
    }
    bool branch = false, reads = false;
    if (doc[t] < 0) {
      s.F = 0.0;
      s.m = 0.0;
    } else {
      const double F_prev = first ? 0.0 : s.F, m_prev = first ? 0.0 : s.m;
      s.F = F_prev + log_f[t];
      const double keep = log_f[t] + m_prev;
      branch = keep >= igate[t];
      s.m = keep > static_cast<double>(igate[t]) ? keep : static_cast<double>(igate[t]);
      const int64_t u = t - w + 1;
      reads = u >= 0 && u >= s.start;
    }
    if (out) {
      out->start[t] = s.start;
      out->F[t] = s.F;
      out->m[t] = s.m;
      out->forget_branch[t] = branch;
      out->readout[t] = reads;
    }
  }
  return s;
}

// A chunk's summary for the carry pass: the scan from the neutral state (F = 0, m = −inf), so
// that, if no run starts in the chunk, its end state from any `before` is
// F = before.F + A, m = max(before.m + A, B) (the max-plus form of m_t = max(log f_t + m_{t−1}, ĩ_t)).
RETAIN_HD ScanState scan_summary(const int32_t* doc, const float* log_f, const float* igate, int64_t c0,
                                       int64_t c1, int64_t w) {
  return scan_tokens(doc, log_f, igate, c0, c1, w, ScanState{-1, 0.0, -INFINITY, 0, 0}, nullptr);
}
RETAIN_HD ScanState scan_compose(const ScanState& before, const ScanState& chunk) {
  if (chunk.restarts) return chunk;
  const double keep = before.m + chunk.F;
  return ScanState{before.start, before.F + chunk.F, keep > chunk.m ? keep : chunk.m, before.restarts, 0};
}
// The carry pass (one thread, over the nc chunk summaries in order): carry_in[c] = the state
// after chunk c − 1's last token. O(T/64) sequential steps.
RETAIN_HD void scan_carries(const ScanState* summary, int64_t nc, ScanState* carry_in) {
  ScanState s{0, 0.0, 0.0, 1, 0};  // before token 0: never used (token 0 starts a run)
  for (int64_t c = 0; c < nc; ++c) {
    carry_in[c] = s;
    s = scan_compose(s, summary[c]);
  }
}

// The per-token scan results, read by every later kernel.
struct ScanView {
  const int32_t* doc;
  const int64_t* start;
  const double* F;
  const double* m;
  const uint8_t* forget_branch;
  const uint8_t* readout;
};

RETAIN_HD bool same_run(const ScanView& s, int64_t a, int64_t b) {
  return s.doc[a] >= 0 && s.start[a] == s.start[b];
}
// exp(F_t − F_p + m_p − m_t) ≤ 1: carries the stabilized state after token p to t (same run).
RETAIN_HD double carry_factor(const ScanView& s, int64_t p, int64_t t) {
  return exp(s.F[t] - s.F[p] + s.m[p] - s.m[t]);
}
// a_{t,j} = exp(F_t − F_j + ĩ_j − m_t) ≤ 1: the weight of key j in the state at t.
RETAIN_HD double a_weight(const ScanView& s, const float* igate, int64_t t, int64_t j) {
  return exp(s.F[t] - s.F[j] + static_cast<double>(igate[j]) - s.m[t]);
}
// The factor that carries the previous chunk's end state into token t, or 0 when t's run
// starts inside t's chunk (the CPU's `carried`); `on` tells the two apart.
struct Carry {
  bool on;
  double g;
};
RETAIN_HD Carry chunk_carry(const ScanView& s, int64_t t) {
  const int64_t c = t / kChunk, ep = c * kChunk - 1;
  if (c == 0 || !same_run(s, ep, t)) return Carry{false, 0.0};
  return Carry{true, carry_factor(s, ep, t)};
}

// The chain factors: state_c = factor_c·state_{c−1} + (chunk c's terms), factor_c = the carry
// into chunk c's end token (0 when its run starts in the chunk, or it is padding); and backwards
// dstate_c = rfactor_c·dstate_{c+1} + (terms of the readouts in chunk c + 1), rfactor_c = the
// carry from e to chunk c + 1's end when that is in e's run.
RETAIN_HD double chunk_factor(const ScanView& s, int64_t T, int64_t c) {
  const Carry cc = chunk_carry(s, chunk_end(T, c));
  return cc.on ? cc.g : 0.0;
}
RETAIN_HD double reverse_factor(const ScanView& s, int64_t T, int64_t c) {
  if ((c + 1) * kChunk >= T) return 0.0;
  const int64_t e = chunk_end(T, c), e1 = chunk_end(T, c + 1);
  return same_run(s, e, e1) ? carry_factor(s, e, e1) : 0.0;
}

// Keys of chunk c in its end state: [max(c0, start_e), e], empty when e is padding.
RETAIN_HD Range chunk_sources(const ScanView& s, int64_t T, int64_t c) {
  const int64_t c0 = c * kChunk, e = chunk_end(T, c);
  if (s.doc[e] < 0) return Range{e + 1, e + 1};
  return Range{s.start[e] > c0 ? s.start[e] : c0, e + 1};
}
// Keys that readout t takes from its own chunk: [max(c0, start_t), t].
RETAIN_HD Range readout_keys(const ScanView& s, int64_t t) {
  const int64_t c0 = t / kChunk * kChunk;
  return Range{s.start[t] > c0 ? s.start[t] : c0, t + 1};
}
// Tokens of chunk c + 1 in chunk c's end token e's run (the readouts there read e's state).
RETAIN_HD Range chunk_readers(const ScanView& s, int64_t T, int64_t c) {
  const int64_t e = chunk_end(T, c);
  int64_t hi = e + 1;
  const int64_t e1 = (c + 1) * kChunk < T ? chunk_end(T, c + 1) : e;
  while (hi <= e1 && same_run(s, e, hi)) ++hi;
  return Range{e + 1, hi};
}
// Tokens of j's chunk at or after j in j's run (the readouts there take key j directly).
RETAIN_HD Range key_readers(const ScanView& s, int64_t T, int64_t j) {
  const int64_t e = chunk_end(T, j / kChunk);
  int64_t hi = j;
  while (hi <= e && same_run(s, j, hi)) ++hi;
  return Range{j, hi};
}

// ---- chunk states ----------------------------------------------------------------------------
// Entry idx of a state: C[x, y] at x·r + y (idx < d·r), n[x] at d·r + x.
// The chunk's own term of entry idx: Σ_{j ∈ src} aw_j·k_j[x]·v_j[y] (or ·1 for n), aw_j =
// a_{e,j} staged per j (aw[j − src.lo]).
RETAIN_HD double state_term(const float* k, const float* v, int64_t d, int64_t r, const double* aw, Range src,
                                  int64_t idx) {
  double acc = 0.0;
  if (idx < d * r) {
    const int64_t x = idx / r, y = idx % r;
    for (int64_t j = src.lo; j < src.hi; ++j) acc = fma(aw[j - src.lo] * k[j * d + x], static_cast<double>(v[j * r + y]), acc);
  } else {
    const int64_t x = idx - d * r;
    for (int64_t j = src.lo; j < src.hi; ++j) acc = fma(aw[j - src.lo], static_cast<double>(k[j * d + x]), acc);
  }
  return acc;
}
// The same for the backward's reverse state of chunk c: Σ over readers t of wt_t·Q_t[x]·gnum_t[y]
// (gden_t for n), wt_t = exp(F_t − F_e + m_e − m_t) for readouts (0 otherwise), Q_t = q̃_u/√d.
RETAIN_HD double reverse_state_term(const uint8_t* readout, const float* q, const double* gnum,
                                          const double* gden, int64_t d, int64_t r, int64_t w, double inv_sqrt_d,
                                          const double* wt, Range readers, int64_t idx) {
  double acc = 0.0;
  const bool C = idx < d * r;
  const int64_t x = C ? idx / r : idx - d * r, y = C ? idx % r : 0;
  for (int64_t t = readers.lo; t < readers.hi; ++t) {
    if (!readout[t]) continue;  // (and u = t − w + 1 may lie before the sequence)
    const double wq = wt[t - readers.lo] * (q[(t - w + 1) * d + x] * inv_sqrt_d);
    acc = fma(wq, C ? gnum[t * r + y] : gden[t], acc);
  }
  return acc;
}
// One step of the chain over chunks: state_c = factor_c·state_{c∓1} + term_c.
RETAIN_HD double chain_step(double factor, double previous, double term) { return fma(factor, previous, term); }
// The chain of one state entry (one thread): state [nc, S] holds the chunk terms and is
// overwritten with the states, in increasing c (forward) or decreasing c (reverse).
RETAIN_HD void chain_entry(double* state, const double* factor, int64_t nc, int64_t S, int64_t idx,
                                 bool reverse) {
  double previous = 0.0;
  for (int64_t n = 0; n < nc; ++n) {
    const int64_t c = reverse ? nc - 1 - n : n;
    double& x = state[c * S + idx];
    x = chain_step(factor[c], previous, x);
    previous = x;
  }
}

// ---- readouts ----------------------------------------------------------------------------------
// Q[x] = q̃_u[x]/√d, one x per thread.
RETAIN_HD double query_entry(const float* q, int64_t u, int64_t d, double inv_sqrt_d, int64_t x) {
  return q[u * d + x] * inv_sqrt_d;
}
// a_{t,j}·(k_j·Q): key j's weight in readout t's sums (one j per thread).
RETAIN_HD double readout_key_weight(const ScanView& s, const float* k, const float* igate, int64_t d,
                                          const double* Q, int64_t t, int64_t j) {
  double z = 0.0;
  for (int64_t x = 0; x < d; ++x) z = fma(static_cast<double>(k[j * d + x]), Q[x], z);
  return a_weight(s, igate, t, j) * z;
}
// num[y] = g·Σ_x Q[x]·C_prev[x, y] + Σ_j az_j·v_j[y] (prev = the previous chunk's state, or
// null when not carried); y = r gives den = g·Σ_x Q[x]·n_prev[x] + Σ_j az_j.
RETAIN_HD double readout_sum(const double* prev, double g, const double* Q, const double* az, const float* v,
                                   Range keys, int64_t d, int64_t r, int64_t y) {
  double acc = 0.0;
  if (prev)
    for (int64_t x = 0; x < d; ++x) acc = fma(g * Q[x], y < r ? prev[x * r + y] : prev[d * r + x], acc);
  for (int64_t j = keys.lo; j < keys.hi; ++j)
    acc = fma(az[j - keys.lo], y < r ? static_cast<double>(v[j * r + y]) : 1.0, acc);
  return acc;
}

// The readout's denominator D = max(|den|, e^{−m_t}) + ε and which side of the max won.
struct Norm {
  double D, em;
  bool den_branch;
};
RETAIN_HD Norm readout_norm(double den, double m_t) {
  const double em = exp(-m_t), a = fabs(den);
  const bool den_branch = a >= em;
  return Norm{(den_branch ? a : em) + static_cast<double>(retain::kvpop::kReadoutEps), em, den_branch};
}
RETAIN_HD double silu(double x) { return x / (1.0 + exp(-x)); }
RETAIN_HD double silu_grad(double x) {
  const double sg = 1.0 / (1.0 + exp(-x));
  return sg * (1.0 + x * (1.0 - sg));
}
// w_o[y]·silu(num[y]/D): one term of the score (summed after b_o in increasing y, as the CPU).
RETAIN_HD double score_term(float w_o, double num, const Norm& nrm) {
  return static_cast<double>(w_o) * silu(num / nrm.D);
}
RETAIN_HD double score_value(float b_o, const double* terms, int64_t r) {
  double out = b_o;
  for (int64_t y = 0; y < r; ++y) out += terms[y];
  return out;
}

// ---- readout backward (the CPU's pass 1) --------------------------------------------------------
// Per y, given ds = dscore_u: dw_o's part ds·silu(h), gnum = gh/D with gh = ds·w_o·silu'(h), and
// the two products that the block then sums in increasing y: gh·h and gnum·num.
struct ReadoutGradY {
  double dwo, gnum, gh_h, gnum_num;
};
RETAIN_HD ReadoutGradY readout_grad_y(double ds, float w_o, double num, const Norm& nrm) {
  const double h = num / nrm.D, gh = ds * static_cast<double>(w_o) * silu_grad(h), gn = gh / nrm.D;
  return ReadoutGradY{ds * silu(h), gn, gh * h, gn * num};
}
// Thread 0 after the y pass: gden and the readout's own terms of ∂/∂F_t and ∂/∂m_t (num and den
// are sums of a_{t,s}(…), ∂ log a / ∂F_t = 1, ∂/∂m_t = −1; the e^{−m_t} side of the max adds
// its own ∂/∂m_t).
struct ReadoutGrad {
  double gden, gF, gm;
};
RETAIN_HD ReadoutGrad readout_grad(const double* gh_h, const double* gnum_num, int64_t r, double den,
                                         const Norm& nrm) {
  double gh_dot_h = 0.0, R = 0.0;
  for (int64_t y = 0; y < r; ++y) {
    gh_dot_h += gh_h[y];
    R += gnum_num[y];
  }
  const double gM = -gh_dot_h / nrm.D;
  const double gden = nrm.den_branch ? gM * (den >= 0 ? 1.0 : -1.0) : 0.0;
  R += gden * den;
  return ReadoutGrad{gden, R, -R + (nrm.den_branch ? 0.0 : -gM * nrm.em)};
}
// a_{t,j}·(gden + Σ_y gnum[y]·v_j[y]): key j's coefficient in dQ (one j per thread).
RETAIN_HD double readout_key_coef(const ScanView& s, const float* v, const float* igate, int64_t r,
                                        const double* gn, double gd, int64_t t, int64_t j) {
  double coef = gd;
  for (int64_t y = 0; y < r; ++y) coef = fma(gn[y], static_cast<double>(v[j * r + y]), coef);
  return a_weight(s, igate, t, j) * coef;
}
// dQ[x] = g·(n_prev[x]·gden + Σ_y C_prev[x, y]·gnum[y]) + Σ_j coef_j·k_j[x] (one x per thread).
RETAIN_HD double readout_dq(const double* prev, double g, const double* gn, double gd, const double* coef,
                                  const float* k, Range keys, int64_t d, int64_t r, int64_t x) {
  double acc = 0.0;
  if (prev) {
    double p = prev[d * r + x] * gd;
    for (int64_t y = 0; y < r; ++y) p = fma(prev[x * r + y], gn[y], p);
    acc = g * p;
  }
  for (int64_t j = keys.lo; j < keys.hi; ++j) acc = fma(coef[j - keys.lo], static_cast<double>(k[j * d + x]), acc);
  return acc;
}

// ---- key gradients (the CPU's pass 3) -------------------------------------------------------------
// Per reader t of key j (one t per thread): a_{t,j}·coef_{t,j} and a_{t,j}·(k_j·Q_t); zeros for
// tokens that do not read out.
struct KeyReader {
  double ac, az;
};
RETAIN_HD KeyReader key_reader(const ScanView& s, const float* q, const float* k, const float* v,
                                     const float* igate, const double* gnum, const double* gden, int64_t d, int64_t r,
                                     int64_t w, double inv_sqrt_d, int64_t t, int64_t j) {
  if (!s.readout[t]) return KeyReader{0.0, 0.0};
  const int64_t u = t - w + 1;
  double z = 0.0, coef = gden[t];
  for (int64_t x = 0; x < d; ++x) z = fma(static_cast<double>(k[j * d + x]), q[u * d + x] * inv_sqrt_d, z);
  for (int64_t y = 0; y < r; ++y) coef = fma(gnum[t * r + y], static_cast<double>(v[j * r + y]), coef);
  const double a = a_weight(s, igate, t, j);
  return KeyReader{a * coef, a * z};
}
// dk_j[x] = Σ_t ac_t·Q_t[x] + b·(dn_e[x] + Σ_y dC_e[x, y]·v_j[y]), b = a_{e,j}, e = the chunk's end
// (dstate = its reverse state, null when e is outside j's run). One x per thread.
RETAIN_HD double key_dk(const uint8_t* readout, const float* q, const float* v, const double* ac,
                              Range readers, const double* dstate, double b, int64_t d, int64_t r, int64_t w,
                              double inv_sqrt_d, int64_t j, int64_t x) {
  double acc = 0.0;
  for (int64_t t = readers.lo; t < readers.hi; ++t)
    if (readout[t]) acc = fma(ac[t - readers.lo], q[(t - w + 1) * d + x] * inv_sqrt_d, acc);
  if (dstate) {
    double p = dstate[d * r + x];
    for (int64_t y = 0; y < r; ++y) p = fma(dstate[x * r + y], static_cast<double>(v[j * r + y]), p);
    acc = fma(b, p, acc);
  }
  return acc;
}
// dv_j[y] = Σ_t az_t·gnum_t[y] + b·Σ_x dC_e[x, y]·k_j[x]. One y per thread.
RETAIN_HD double key_dv(const uint8_t* readout, const float* k, const double* gnum, const double* az,
                              Range readers, const double* dstate, double b, int64_t d, int64_t r, int64_t j,
                              int64_t y) {
  double acc = 0.0;
  for (int64_t t = readers.lo; t < readers.hi; ++t)
    if (readout[t]) acc = fma(az[t - readers.lo], gnum[t * r + y], acc);
  if (dstate) {
    double p = 0.0;
    for (int64_t x = 0; x < d; ++x) p = fma(dstate[x * r + y], static_cast<double>(k[j * d + x]), p);
    acc = fma(b, p, acc);
  }
  return acc;
}
// k̃_j·dk_j: ∂/∂ĩ_j from the key side (and −∂/∂F_j), summed in increasing x by thread 0.
RETAIN_HD double key_dot(const float* k, const double* dk, int64_t d, int64_t j) {
  double acc = 0.0;
  for (int64_t x = 0; x < d; ++x) acc = fma(static_cast<double>(k[j * d + x]), dk[x], acc);
  return acc;
}

// ---- gate gradients (the CPU's pass 4) ----------------------------------------------------------
// Two reverse recurrences over tokens, S[t] = v[t] + (link[t+1] ? S[t+1] : 0), computed per chunk
// like the forward scan: channel m (∂/∂m_t flows to m_{t−1} where m_t took the forget branch
// inside a run) and channel F (∂/∂F_t summed backwards over the run: F_t = Σ_{j ≤ t} log f_j).
struct Suffix {
  double m, F;           // the sums at the chunk's first token (with nothing carried in)
  int32_t through_m, through_F;  // every link from the chunk's end + 1 back to its first token
};
RETAIN_HD bool link_m(const ScanView& s, int64_t T, int64_t t) {
  return t < T && s.doc[t] >= 0 && s.forget_branch[t] && s.start[t] != t;
}
RETAIN_HD bool link_F(const ScanView& s, int64_t T, int64_t t) {
  return t < T && s.doc[t] >= 0 && s.start[t] != t;
}
// The recurrences over [c0, c1) from the carried sums at c1 (in.m, in.F: S at token c1), in
// decreasing t. Writes the gate gradients when d_igate is not null: dĩ_t = kdk_t + (forget
// branch ? 0 : S_m[t]), d log f_t = (forget branch ? S_m[t] : 0) + S_F[t] (0 for padding).
// The per-token values: gm (∂/∂m_t from t's readout) and gF − kdk (∂/∂F_t: the readout side
// minus the key side), all zero where they do not apply.
RETAIN_HD Suffix suffix_tokens(const ScanView& s, int64_t T, const double* gm, const double* gF,
                                     const double* kdk, int64_t c0, int64_t c1, Suffix in, float* d_igate,
                                     float* d_log_f) {
  double Sm = in.m, SF = in.F;
  bool through_m = true, through_F = true;
  for (int64_t t = c1 - 1; t >= c0; --t) {
    const bool lm = link_m(s, T, t + 1), lF = link_F(s, T, t + 1);
    through_m = through_m && lm;
    through_F = through_F && lF;
    Sm = gm[t] + (lm ? Sm : 0.0);
    SF = (lF ? SF : 0.0) + (gF[t] - kdk[t]);
    if (d_igate) {
      const bool real = s.doc[t] >= 0, branch = s.forget_branch[t];
      d_igate[t] = real ? static_cast<float>(kdk[t] + (branch ? 0.0 : Sm)) : 0.0f;
      d_log_f[t] = real ? static_cast<float>((branch ? Sm : 0.0) + SF) : 0.0f;
    }
  }
  return Suffix{Sm, SF, through_m, through_F};
}
// The carry pass (one thread, decreasing c): the sums at chunk c + 1's first token.
RETAIN_HD Suffix suffix_compose(const Suffix& later_in, const Suffix& chunk) {
  return Suffix{chunk.m + (chunk.through_m ? later_in.m : 0.0), chunk.F + (chunk.through_F ? later_in.F : 0.0), 0, 0};
}
RETAIN_HD void suffix_carries(const Suffix* summary, int64_t nc, Suffix* carry_in) {
  if (nc == 0) return;
  carry_in[nc - 1] = Suffix{0.0, 0.0, 0, 0};  // nothing after the last chunk
  for (int64_t c = nc - 2; c >= 0; --c) carry_in[c] = suffix_compose(carry_in[c + 1], summary[c + 1]);
}

// ---- dw_o, db_o: column sums in a fixed order ---------------------------------------------------
// Σ_{t ∈ [t0, t1)} part[t, col] in increasing t (part [T, cols]).
RETAIN_HD double column_sum(const double* part, int64_t cols, int64_t t0, int64_t t1, int64_t col) {
  double acc = 0.0;
  for (int64_t t = t0; t < t1; ++t) acc += part[t * cols + col];
  return acc;
}

}  // namespace retain::cuda::kvpop_tiles
