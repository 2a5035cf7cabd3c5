// The ops the Qwen3 forward needs. One function per op; each checks shapes/dtypes and
// dispatches on the tensor's device to the CPU reference (kernels/cpu/) or, where one
// exists, a CUDA kernel (kernels/cuda/). Activations are F32; weights are F32 unless an
// op says otherwise. Shapes: T tokens, H query heads, K KV heads, d head_dim.
// CUDA kernels (same contracts, every tensor of a call on one device): embedding,
// rmsnorm(_backward), rope(_backward), swiglu(_backward), add_inplace (kernels/cuda/ops.cu);
// linear, linear_backward_input, linear_backward_weight (cuBLASLt) and cast
// (kernels/cuda/gemm.cu). The others are CPU-only for now (a one-line error on CUDA tensors).
#pragma once
#include <cstdint>

#include "kernels/tensor.h"

namespace retain::ops {

// out[t, :] = table[ids[t], :]. table F32/BF16/F16 [V, D] (read in place, so a BF16
// checkpoint's embedding needs no F32 copy); ids I32 [T]; out F32 [T, D].
void embedding(const Tensor& table, const Tensor& ids, Tensor& out);

// y = x · wᵀ (accumulate = true: y += x · wᵀ, the residual add fused into the GEMM, whose
// epilogue reads y; saves the [N, out] product buffer and a pass over it).
// x F32 or BF16 [N, in], w F32 or BF16 [out, in] (nn.Linear layout), y F32 [N, out]. A BF16 x
// is its values widened to float32 exactly: the same product as an F32 x holding them.
// CUDA (cuBLASLt, fp32 accumulation): with F32 w the product is float32 throughout (matches
// the CPU to float32 rounding); with BF16 w, an F32 x is rounded to bf16 first ("bf16 in, fp32
// accumulate", the GPU trainer's frozen weights) and a BF16 x is read as it is (no staging
// copy: the attention output feeds o_proj so). The CPU widens a BF16 w to float32 exactly:
// bit for bit the F32 path on the widened weight while that fits one 32 MiB block
// (kernels/cpu/ops_cpu.h), block by block beyond. y must not alias x or w.
void linear(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate = false);

// dw = dyᵀ · x (accumulate = true adds into dw): the weight gradient of y = x·wᵀ, for the
// trainable gate MLPs. dy F32 [N, out], x F32 [N, in], dw F32 [out, in]. CUDA: float32
// throughout (cuBLASLt). dw must not alias dy or x.
void linear_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, bool accumulate = false);

// dst = src converted elementwise (F32, BF16, F16 in any pair; round to nearest even), same
// shape, one device. dst may not alias src unless both dtypes are equal.
void cast(const Tensor& src, Tensor& dst);

// Row-wise RMSNorm over the last dim D: out = x / sqrt(mean(x²) + eps) * w.
// x F32 [..., D], w F32 [D]. Per-head norm (Qwen3 q_norm/k_norm) is this op on [T·H, d].
// out may alias x.
void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor& out);

// Rotary embedding in place, Hugging Face "rotate half" layout: for j < d/2,
//   (x_j, x_{j+d/2}) <- (x_j·c − x_{j+d/2}·s, x_{j+d/2}·c + x_j·s),
//   c = cos(p_t·inv_freq_j)·attention_factor, s = sin(p_t·inv_freq_j)·attention_factor,
// angles formed in float32 as HF does. x F32 [T, heads, d]; positions I32 [T];
// inv_freq F32 [d/2].
void rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, float attention_factor);

// out = silu(gate) * up, elementwise; all F32 of one shape. out may alias gate or up.
void swiglu(const Tensor& gate, const Tensor& up, Tensor& out);

// x += y, elementwise, both F32 or both F64 (context parallelism's gradient sums).
void add_inplace(Tensor& x, const Tensor& y);

// x[i] = value for every element of x (F32 or F64; value rounded to F32 for F32).
void fill(Tensor& x, double value);

// dst[i] = float(scale · src[i]): src F64, dst F32 of src's element count (rounded once, to
// nearest): the F64 sums of context parallelism's rings, scaled into their F32 results.
void scale_to_f32(const Tensor& src, double scale, Tensor& dst);

// out = [a ‖ b] row by row: a F32 [T, A], b F32 [T, B], out F32 [T, A + B] (a copy; out aliases
// neither). The input of a retention gate that reads [k ‖ v] (model/gates/gates.h).
void concat_columns(const Tensor& a, const Tensor& b, Tensor& out);
// The backward of concat_columns: da += src[:, :A], db += src[:, A:] (F32; src [T, A + B]).
void split_columns_add(const Tensor& src, Tensor& da, Tensor& db);

// Causal GQA softmax attention with document masks: query t attends key i iff i ≤ t and
// doc[i] == doc[t]; query head h uses KV head h / (H/K). score = (q·k)·scale.
// q F32 [T, H, d]; k, v F32 [T, K, d]; doc I32 [T]; out F32 [T, H, d].
// A token with doc < 0 (padding) attends nothing: its output row is 0.
void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& doc, float scale,
               Tensor& out);

// ---- Backward ops (training: activation gradients through the frozen model; no op here
// computes a gradient for a weight). kernels/cpu/ops_backward.cpp. ----

// dx = dy · w: the backward of linear (y = x·wᵀ) with respect to its input x.
// dy F32 [N, out], w F32 or BF16 [out, in] (as linear: with BF16 w, CUDA rounds dy to bf16),
// dx F32 [N, in]; accumulate = true adds into dx.
// dx must not alias dy or w.
void linear_backward_input(const Tensor& dy, const Tensor& w, Tensor& dx, bool accumulate = false);

// Backward of rmsnorm with respect to x only (the weight w is frozen): for each row,
//   dx = r·(w⊙dy) − x·r³·⟨w⊙dy, x⟩/D,  r = 1/sqrt(mean(x²) + eps),
// with r and the row sums in float64. x, dy, dx F32 [..., D] of one shape; w F32 [D].
// dx is overwritten and may alias dy (not x); accumulate = true adds into dx instead (the
// residual branch's gradient joining the running one in the same pass; dx then aliases neither).
void rmsnorm_backward(const Tensor& x, const Tensor& w, float eps, const Tensor& dy, Tensor& dx,
                      bool accumulate = false);

// Backward of rope, in place on dx F32 [T, heads, d]: the transposed rotation
//   (g_j, g_{j+d/2}) <- (g_j·c + g_{j+d/2}·s, g_{j+d/2}·c − g_j·s)
// with exactly rope()'s c and s (attention factor included). With attention_factor = 1 it is
// rope's inverse.
void rope_backward(Tensor& dx, const Tensor& positions, const Tensor& inv_freq, float attention_factor);

// Backward of out = silu(gate)·up: dgate = dout·up·silu'(gate), dup = dout·silu(gate).
// All F32 of one shape. Elementwise, each index read before it is written: dgate and dup may
// alias any of gate, up, dout, but not each other.
void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate, Tensor& dup);

// p[t] = 0-based position of t inside its run of equal doc ids (DESIGN §4: RoPE positions
// restart per document; packed data keeps each document contiguous). doc I32 [T] -> I32 [T].
// Padding (doc < 0) gets position 0.
Tensor document_positions(const Tensor& doc);

}  // namespace retain::ops
