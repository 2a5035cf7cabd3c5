// CUDA kernels of the retention-gate MLPs (model/gates/gates.h) other than their GEMMs, which go
// through ops::linear / linear_backward_input / linear_backward_weight. Compiled only in CUDA
// builds: kernels/gate_mlp.cpp includes this header and calls into it only under
// RETAIN_CUDA_KERNELS, after its own shape, dtype and device checks (every tensor here is F32 on
// the CUDA device; shapes are not re-checked). Kernels in kernels/cuda/gates.cu, their math in
// kernels/cuda/gates_rows.h.
//
// Default stream; every function returns after its launches. Deterministic: the bias gradient is
// a fixed-order float64 reduction (no atomics), bit-identical to the CPU's for the same dy.
//
// NOT YET RUN ON A GPU: no GPU has been lent to this project so far. The math is checked by host
// emulation (tests/cuda/test_gates_rows.cpp, every build); tests/cuda/test_gates_cuda.cpp is the
// GPU check and skips where there is no device.
#pragma once
#include "kernels/tensor.h"

namespace retain::cuda {

// a [T, N] holds x·Wᵀ: a += b (b [N], per row), then s = silu(a) (s [T, N]).
void gate_bias_silu(Tensor& a, const Tensor& b, Tensor& s);
// z [T, K] holds x·Wᵀ: z += b (b [K], per row), then log_beta = log σ(z) (log_beta [T, K]).
void gate_bias_log_sigmoid(Tensor& z, const Tensor& b, Tensor& log_beta);
// s = silu(a), same shape (the backward recomputes the activations the forward did not keep).
void gate_silu(const Tensor& a, Tensor& s);
// dz = dlog_beta·σ(−z), all [T, K].
void gate_log_sigmoid_backward(const Tensor& z, const Tensor& dlog_beta, Tensor& dz);
// ds *= silu'(a) in place, both [T, N].
void gate_times_silu_grad(Tensor& ds, const Tensor& a);
// db[j] = float32(db[j] + Σ_t dy[t, j]), the sum in float64 (dy [T, N], db [N]).
void gate_add_column_sums(const Tensor& dy, Tensor& db);

}  // namespace retain::cuda
