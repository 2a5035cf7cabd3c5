// The retention gates' MLP steps besides their GEMMs (DESIGN §4; model/gates/gates.h composes them
// with ops::linear / linear_backward_input / linear_backward_weight into one forward and one
// backward for both devices). One op per step, dispatched on the tensors' device to the CPU
// reference (kernels/cpu/gate_mlp.cpp) or the CUDA kernels (kernels/cuda/gates.cu); both run the
// same per-element formulas and the same fixed-order float64 bias-gradient sum
// (kernels/cuda/gates_rows.h), so on the host they agree bit for bit. Every tensor F32 [rows, N]
// (b, db: [N]) on one device; a wrong dtype, shape or device is a one-line retain::Error.
#pragma once
#include "kernels/tensor.h"

namespace retain::ops {

// a holds x·Wᵀ: a += b (per row), then s = silu(a).
void gate_bias_silu(Tensor& a, const Tensor& b, Tensor& s);
// z holds x·Wᵀ: z += b (per row), then log_beta = log σ(z) (stable: never log(sigmoid(z))).
void gate_bias_log_sigmoid(Tensor& z, const Tensor& b, Tensor& log_beta);
// s = silu(a) (the backward recomputes the activations the forward did not keep).
void gate_silu(const Tensor& a, Tensor& s);
// dz = dlog_beta·σ(−z): the backward of log σ.
void gate_log_sigmoid_backward(const Tensor& z, const Tensor& dlog_beta, Tensor& dz);
// ds *= silu'(a), in place.
void gate_times_silu_grad(Tensor& ds, const Tensor& a);
// db[j] = float32(db[j] + Σ_t dy[t, j]), the sum in float64 in fixed token blocks: the bias gradient.
void gate_add_column_sums(const Tensor& dy, Tensor& db);

}  // namespace retain::ops
