// The KVPOP scorer ops of DESIGN §5, forward and backward, for ONE KV head of one layer (the
// caller loops over layers and heads; parameters are stored stacked [K, ...], and
// Tensor::rows(κ, κ + 1) gives one head's slice). Like kernels/retention.h each function
// checks shapes and dtypes and dispatches on the device; kernels/cpu/kvpop_*.cpp hold the
// float32 references (float64 accumulation). future_attention_target and mlstm_scores[_backward]
// run CUDA tensors on kernels/cuda/kvpop.cu (all of a call's tensors on one device; checked
// against these references by host emulation, not yet run on a GPU); for the other ops a CUDA
// tensor is a retain::Error ("no CUDA implementation of this op yet").
//
// Shapes: T tokens of one packed sequence, d head_dim, r = d / 2, H query heads and K KV heads
// of the frozen model (H % K == 0). doc I32 [T]: document id per token, −1 = padding. A
// document must be ONE contiguous run (an id that reappears after another id is an error):
// the recurrent state restarts at each run's first token (DESIGN §5).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/tensor.h"

namespace retain::kvpop {

inline constexpr float kGateCap = 15.0f;  // c of the soft-capped gates
inline constexpr float kReadoutEps = 1e-6f;

// One KV head's scorer parameters, all F32: W_q, W_k, W_v [r, 2d]; w_i, w_f [2d];
// b_i, b_f [1]; w_o [r]; b_o [1]; theta [1] (the decay parameter θ).
struct HeadParams {
  Tensor W_q, W_k, W_v, w_i, w_f, b_i, b_f, w_o, b_o, theta;
};

// The per-token scorer inputs after the projections (a.): q̃, k̃ [T, d] (Hedgehog features),
// ṽ [T, r], ĩ [T] (capped input gate), log_f [T] (= logsigmoid(f̃)), all F32.
struct Projected {
  Tensor q, k, v, igate, log_f;
};

// (a.) x F32 [T, 2d] = [k_t; v_t] of the frozen model → Projected:
//   q̃ = φ(W_q x), k̃ = φ(W_k x), φ(z) = [softmax(z); softmax(−z)]; ṽ = W_v x;
//   ĩ = c·tanh((w_i·x + b_i)/c); f̃ = c·tanh((w_f·x + b_f)/c); log_f = logsigmoid(f̃).
Projected project(const Tensor& x, const HeadParams& p);
// Gradients of the projections given dP (same shapes as Projected; any field may be an
// undefined Tensor() meaning zero). Overwrites g.W_q, g.W_k, g.W_v, g.w_i, g.w_f, g.b_i, g.b_f
// (allocating them); leaves g.w_o, g.b_o, g.theta alone. x gets no gradient (frozen model).
void project_backward(const Tensor& x, const HeadParams& p, const Projected& dP, HeadParams& g);

// True when token u gets a score with window w: u is not padding and u + w − 1 is in the
// same document run (the readout state exists inside this sequence).
bool has_score(const int32_t* doc, int64_t T, int64_t w, int64_t u);

// (b.) Stabilized mLSTM with per-document resets and the delayed readout: score F32 [T],
// score_u = w_o·silu(h_u) + b_o with h_u read from the state at t = u + w − 1 with q̂_u = q̃_u/√d;
// 0 for tokens without a score (has_score false). Chunkwise-parallel (64-token chunks),
// O(T·d·r + T·64·d) work, O((T/64)·d·r + T) extra memory forward and O((T/64)·d·r + T·d)
// backward, no T×T buffer. w ≥ 1. Deterministic (independent of the OpenMP thread count).
Tensor mlstm_scores(const Projected& P, const Tensor& doc, int64_t w, const Tensor& w_o, const Tensor& b_o);
// Gradients given dscore F32 [T] (entries of unscored tokens are ignored): returns dP (every
// field defined) and overwrites dw_o [r], db_o [1].
Projected mlstm_scores_backward(const Projected& P, const Tensor& doc, int64_t w, const Tensor& w_o,
                                const Tensor& b_o, const Tensor& dscore, Tensor& dw_o, Tensor& db_o);

// (c.) Future-attention targets: log_m F32 [K, T],
//   log_m[κ, t] = max_{h in group κ} LSE_{d ≥ t + w, doc[d] = doc[t]} (q_d·k_t·scale − lse[d, h]),
// −inf where that d-range is empty (no target) or t is padding. q F32 [T, H, hd], k F32
// [T, K, hd] (as cached: after k_norm and RoPE), lse F32 [T, H] the dense causal attention's
// log-sum-exp per query row (ops::gated_attention with log_beta ≡ 0). A transposed pass over
// 64-key tiles with an online log-sum-exp per (key, head): O(T·H) memory, no T×T buffer.
Tensor future_attention_target(const Tensor& q, const Tensor& k, const Tensor& lse, const Tensor& doc,
                               int64_t w, float scale);

// The same target split by token spans (context parallelism, trainer/context_parallel.h: the
// keys stay, the queries travel). The running log-sum-exp of every (key, query head), mx and
// sum F64 [T_k, H], starts at future_attention_start (−inf, 0); future_attention_sums adds the
// queries q F32 [T_q, H, hd], lse F32 [T_q, H], document ids q_doc I32 [T_q] at global tokens
// [q_start, q_start + T_q) to the keys k F32 [T_k, K, hd], k_doc I32 [T_k] at [k_start, …)
// (the pairs d ≥ t + w of one document, in increasing d); future_attention_finish gives log_m
// F32 [K, T_k]. One span of each over the whole sequence is future_attention_target, bit for
// bit (it is that code). Each span's documents must be contiguous runs, as in the whole
// sequence (checked on the CPU; on CUDA the caller checks the whole sequence's). On CUDA
// (start's device) the same walk in target_kernel's tiles (unverified on a GPU, emulated).
std::pair<Tensor, Tensor> future_attention_start(int64_t T_k, int64_t H, Device device = Device::CPU);
void future_attention_sums(const Tensor& q, const Tensor& lse, const Tensor& q_doc, int64_t q_start, const Tensor& k,
                           const Tensor& k_doc, int64_t k_start, int64_t w, float scale, Tensor& mx, Tensor& sum);
Tensor future_attention_finish(const Tensor& mx, const Tensor& sum, int64_t K);

// The decay of the effective score (DESIGN §5; KVPOP paper §2 and Table 2):
//   log γ(θ) = log γ_min + (log γ_max − log γ_min)·σ(θ),   ŝ_i(q) = score_i + ⌊(q − i)/every⌋·log γ.
// The defaults are the paper's range [0.999, 0.999999] and every = 1 (retain's rule before
// --decay-every: (q − i)·log γ). retain-train's --decay-every, --decay-min, --decay-max.
struct Decay {
  int64_t every = 1;
  double gamma_min = 0.999, gamma_max = 0.999999;
  // Spelled out: kernels/cuda/kvpop.cu includes this header as C++17.
  bool operator==(const Decay& o) const {
    return every == o.every && gamma_min == o.gamma_min && gamma_max == o.gamma_max;
  }
  bool operator!=(const Decay& o) const { return !(*this == o); }
};
// "" when usable (every ≥ 1, 0 < gamma_min ≤ gamma_max ≤ 1, all finite), else what is wrong.
std::string decay_problem(const Decay& decay);
// ⌊(q − i)/every⌋ for a key i ≤ q.
inline int64_t decay_steps(int64_t q, int64_t i, int64_t every) { return (q - i) / every; }

// Which target the boundary decision ranks by (retain-train --target-cutoff). raw: log m_i;
// effective (the KVPOP paper §2.1, "computed from target effective scores"): log m_i +
// ⌊(q − i)/every⌋·log_gamma, the same decay as the predicted scores with the scorer's current
// log γ (no gradient through it); y and the margin are then taken on these effective targets.
struct TargetRule {
  bool effective = false;
  double log_gamma = 0;
  int64_t every = 1;
};

// (d.) One boundary decision of DESIGN §5 (sequence indices).
struct Decision {
  int64_t q;      // the query
  int64_t t_new;  // = q − w, the key that becomes eligible
  int64_t b;      // the k-th best other eligible key by target log m
  int32_t y;      // +1 if log_m[t_new] > log_m[b], else −1 (effective targets under TargetRule::effective)
  float margin;   // |log_m[t_new] − log_m[b]| (likewise)
};
// For every query q whose t_new = q − w is in q's document with position ≥ sinks and has at
// least k other eligible keys (positions sinks ≤ p(i) < p(t_new)), in increasing q. log_m F32
// [T] (one head's row of future_attention_target). A Fenwick tree over the ranks of log m:
// O(T log T). k ≥ 1, sinks ≥ 0, w ≥ 1. With rule.effective the ranking at q depends on q only
// through q mod every: one Fenwick pass per residue, O(every·T log T).
std::vector<Decision> select_decisions(const Tensor& log_m, const Tensor& doc, int64_t w, int64_t sinks,
                                       int64_t k, const TargetRule& rule = {});

// log γ(θ) = log γ_min + (log γ_max − log γ_min)·σ(θ) (the defaults: log 0.999, log 0.999999).
double log_gamma(double theta, const Decay& decay = {});
// d log γ / dθ = (log γ_max − log γ_min)·σ(θ)·(1 − σ(θ)).
double log_gamma_derivative(double theta, const Decay& decay = {});

// Σ over decisions of ℓ = a·softplus(−y·(ŝ_new(q) − ŝ_b(q))/τ), ŝ_i(q) = score_i +
// ⌊(q − i)/decay.every⌋·log γ(θ), with a = margin·margin_scale when margin_scale > 0 (the trainer
// passes 1 / the global batch's mean margin) and a = 1 when margin_scale == 0 (--no-margin-weight).
// score F32 [T].
double pair_loss(const Tensor& score, const Tensor& theta, const std::vector<Decision>& decisions,
                 double margin_scale, double tau, const Decay& decay = {});
// grad_scale·∂(Σℓ)/∂score → dscore F32 [T] (overwritten), and ∂/∂θ → dtheta F32 [1] (overwritten).
void pair_loss_backward(const Tensor& score, const Tensor& theta, const std::vector<Decision>& decisions,
                        double margin_scale, double tau, double grad_scale, Tensor& dscore, Tensor& dtheta,
                        const Decay& decay = {});

}  // namespace retain::kvpop
