// The retention ops of DESIGN §4 (TRIM-KV / DBTrimKV): retention-gated attention and the
// capacity loss, forward and backward. Like kernels/ops.h, each function checks shapes and
// dtypes and dispatches on the device; kernels/cpu/ holds the float32 reference (float64
// accumulation where it matters). Shapes: T tokens, H query heads, K KV heads (H % K == 0,
// query head h reads KV head h / (H/K)), d head_dim, L layers. Pairs (t, i) are allowed iff
// i ≤ t and doc[i] == doc[t] >= 0; tokens with doc < 0 are padding and enter no sum.
#pragma once
#include <cstdint>
#include <string>

#include "kernels/tensor.h"

namespace retain::ops {

// Retention-gated causal attention:
//   score(t, i) = (q_t·k_i)·scale + (t − i)·log_beta[i, κ(h)],  softmax over allowed i.
// q F32 [T, H, d]; k, v F32 [T, K, d]; log_beta F32 [T, K]; doc I32 [T].
// out F32 [T, H, d]; lse F32 [T, H] (per-row log-sum-exp of the scores, kept for backward).
// CUDA (every tensor on the device; kernels/cuda/gated_attention.cu): q, k, v, out BF16, the
// rest as above (log_beta, lse F32, doc I32); d = 64 or 128; fp32 accumulation, probabilities
// rounded to bf16 before they multiply v (FlashAttention-2 numerics, ~1e-2 relative to F32).
// Padding rows: out = 0, lse = -inf. log_beta ≡ 0 is plain attention. log_beta must be ≤ 0
// (a logsigmoid output; a positive or NaN entry is a retain::Error naming its index — on CUDA
// thrown by the next ops::raise_deferred_checks(), kernels/deferred_checks.h, not by the op); the
// i = t decay is exactly 0, so -inf is allowed. T < 2^24 (t − i is exact in float32). O(T·d) memory:
// the CPU reference visits 64×64 tiles, skipping those above the diagonal or with no
// shared document (docs/math.md); results do not depend on the OpenMP thread count.
void gated_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& log_beta,
                     const Tensor& doc, float scale, Tensor& out, Tensor& lse);

// Gradients of the above given dout F32 [T, H, d] (recomputes the probabilities from q, k,
// log_beta and lse). dq [T, H, d], dk, dv [T, K, d], dlog_beta [T, K], all F32, overwritten;
// padding tokens get 0. dlog_beta[i, κ] = Σ_{h in group κ} Σ_t (t − i)·dS[t, i]. out and lse
// must be the forward's. CUDA: q, k, v, out, dout, dq, dk, dv BF16; log_beta, lse, dlog_beta
// F32; doc I32 (dS is rounded to bf16 for dq and dk; dlog_beta uses the fp32 dS).
void gated_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& log_beta, const Tensor& doc, float scale,
                              const Tensor& out, const Tensor& lse, const Tensor& dout,
                              Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dlog_beta);

// Every capacity function skips the tiles of the pair space whose every term
// exp((t − i)·logβ) is below e^−skip_exponent. The default, kExactSkipExponent = 60, is exact
// for every purpose: a row of S has fewer than T skipped terms, so S (≥ 1) moves by
// < T·e^−60 (1.2e-21 at T = 131072). A smaller exponent is an opt-in approximation for speed
// (retain-train --capacity-skip E): S moves by < T·e^−E per row (so ℓ by less than that
// over max(p − M, 1)), and a gradient entry by < |scale|·T²·e^−E where the hinge's sign agrees
// (a row whose S lies within T·e^−E of its threshold may switch sides). +inf skips nothing.
// skip_exponent must be > 0 (NaN is refused).
inline constexpr double kExactSkipExponent = 60.0;

// Capacity sums S[l, t, κ] = Σ_{allowed i} exp((t − i)·log_beta[l, i, κ]) (the i = t term is 1).
// log_beta F32 [L, T, K]; doc I32 [T]; S F32 [L, T, K] (0 on padding rows). Every log_beta
// must be ≤ 0 (a logsigmoid output, -inf allowed): a positive or NaN entry is a retain::Error
// naming its index (so no term exceeds 1; on CUDA, and for negative positions below, thrown by
// the next ops::raise_deferred_checks()). O(T·K) extra memory, float64 sums.
// CUDA (log_beta, doc, positions and the outputs all on the device; kernels/cuda/capacity.cu):
// the same math and dtypes for the three capacity functions, float32 partials of ≤ 64 terms
// summed in float64 (worst case < 1e-5 relative to this reference, typically ~1e-7),
// deterministic.
void capacity_sums(const Tensor& log_beta, const Tensor& doc, Tensor& S,
                   double skip_exponent = kExactSkipExponent);

// The capacity hinge of DESIGN §4 for one sequence, as a sum and a count so the caller can
// form L_cap = Σℓ / #{ℓ > 0} over the global batch (across sequences and ranks).
//   local  (trimkv):   ℓ[l,κ,t] = max(0, (S[l,t,κ] − M) / max(p(t) − M, 1))
//   global (dbtrimkv): ℓ[t] = max(0, (Σ_{l,κ} S[l,t,κ] − M·N) / max(p(t)·N − M·N, 1)), N = L·K
// positions I32 [T] are the document positions p(t) (ops::document_positions), ≥ 0; memory
// M is finite and ≥ 0. Padding tokens have no ℓ.
enum class CapacityMode { local, global };
struct CapacityLoss {
  double sum = 0;        // Σ ℓ over the sequence
  int64_t positive = 0;  // #{ℓ > 0}
};
CapacityLoss capacity_loss(const Tensor& log_beta, const Tensor& doc, const Tensor& positions,
                           double memory, CapacityMode mode, double skip_exponent = kExactSkipExponent);

// dlog_beta F32 [L, T, K] = scale · ∂(Σℓ)/∂log_beta (overwritten). The trainer passes
// scale = λ / (global count of positive ℓ), which is constant almost everywhere. At ℓ = 0
// (S = M exactly) the hinge's gradient is taken as 0.
void capacity_loss_backward(const Tensor& log_beta, const Tensor& doc, const Tensor& positions,
                            double memory, CapacityMode mode, double scale, Tensor& dlog_beta,
                            double skip_exponent = kExactSkipExponent);

// The CUDA kernels gated_attention (backward = false) or its backward runs on this device:
// "mma" or "wgmma", as RETAIN_ATTENTION_FORWARD / RETAIN_ATTENTION_BACKWARD pick them (unset:
// wgmma on an sm_90 GPU, else mma); fails in a build without CUDA.
std::string cuda_attention_kernels(bool backward);

}  // namespace retain::ops
