// The retention ops of DESIGN §4 (TRIM-KV / DBTrimKV): retention-gated attention and the
// capacity loss, forward and backward. Like kernels/ops.h, each function checks shapes and
// dtypes and dispatches on the device; kernels/cpu/ holds the float32 reference (float64
// accumulation where it matters). Shapes: T tokens, H query heads, K KV heads (H % K == 0,
// query head h reads KV head h / (H/K)), d head_dim, L layers. Pairs (t, i) are allowed iff
// i ≤ t and doc[i] == doc[t] >= 0; tokens with doc < 0 are padding and enter no sum.
#pragma once
#include <cstdint>

#include "kernels/tensor.h"

namespace retain::ops {

// Retention-gated causal attention:
//   score(t, i) = (q_t·k_i)·scale + (t − i)·log_beta[i, κ(h)],  softmax over allowed i.
// q F32 [T, H, d]; k, v F32 [T, K, d]; log_beta F32 [T, K]; doc I32 [T].
// out F32 [T, H, d]; lse F32 [T, H] (per-row log-sum-exp of the scores, kept for backward).
// Padding rows: out = 0, lse = -inf. log_beta ≡ 0 is plain attention.
void gated_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& log_beta,
                     const Tensor& doc, float scale, Tensor& out, Tensor& lse);

// Gradients of the above given dout F32 [T, H, d] (recomputes the probabilities from q, k,
// log_beta and lse). dq [T, H, d], dk, dv [T, K, d], dlog_beta [T, K], all F32, overwritten.
void gated_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& log_beta, const Tensor& doc, float scale,
                              const Tensor& out, const Tensor& lse, const Tensor& dout,
                              Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dlog_beta);

// Capacity sums S[l, t, κ] = Σ_{allowed i} exp((t − i)·log_beta[l, i, κ]) (the i = t term is 1).
// log_beta F32 [L, T, K] (≤ 0); doc I32 [T]; S F32 [L, T, K].
void capacity_sums(const Tensor& log_beta, const Tensor& doc, Tensor& S);

// The capacity hinge of DESIGN §4 for one sequence, as a sum and a count so the caller can
// form L_cap = Σℓ / #{ℓ > 0} over the global batch (across sequences and ranks).
//   local  (trimkv):   ℓ[l,κ,t] = max(0, (S[l,t,κ] − M) / max(p(t) − M, 1))
//   global (dbtrimkv): ℓ[t] = max(0, (Σ_{l,κ} S[l,t,κ] − M·N) / max(p(t)·N − M·N, 1)), N = L·K
// positions I32 [T] are the document positions p(t) (ops::document_positions).
enum class CapacityMode { local, global };
struct CapacityLoss {
  double sum = 0;        // Σ ℓ over the sequence
  int64_t positive = 0;  // #{ℓ > 0}
};
CapacityLoss capacity_loss(const Tensor& log_beta, const Tensor& doc, const Tensor& positions,
                           double memory, CapacityMode mode);

// dlog_beta F32 [L, T, K] = scale · ∂(Σℓ)/∂log_beta (overwritten). The trainer passes
// scale = λ / (global count of positive ℓ), which is constant almost everywhere.
void capacity_loss_backward(const Tensor& log_beta, const Tensor& doc, const Tensor& positions,
                            double memory, CapacityMode mode, double scale, Tensor& dlog_beta);

}  // namespace retain::ops
