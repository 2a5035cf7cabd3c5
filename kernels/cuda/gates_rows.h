// The per-element math and the bias-gradient reduction of the CUDA retention-gate kernels
// (kernels/cuda/gates.cu), written as __host__ __device__ functions so that
// tests/cuda/test_gates_rows.cpp runs the very same code on the CPU (each kernel emulated thread
// by thread) against the CPU gates (kernels/cpu/gate_mlp.cpp runs these very formulas) in every build, GPU or not. Plain
// C++17 when not compiled by nvcc. Not yet run on a GPU (none has been lent);
// tests/cuda/test_gates_cuda.cpp is the GPU check.
//
// Every formula is the CPU gates' formula with its float32 operations in the same order, so on
// the host the results are bit-identical to the CPU path. On the device two things differ:
// expf/log1pf are CUDA's (≤ 2 and ≤ 1 ulp from the correctly rounded value, glibc's are < 1), and
// nvcc would contract x·(1 − s) + 1 into an FMA, which fmul_rn below forbids so that silu' is the
// CPU's sequence of roundings.
//
// Bias gradient db[j] += Σ_t dy[t, j] in float64, as the CPU sums it: tokens in blocks of
// kColumnBlock, each block summed in token order (column_block_partial: one thread per (block,
// column)), then the blocks in block order (column_total: one thread per column), and one
// float32 rounding of db[j] + total. No atomics: bitwise repeatable, and bit-identical to the
// CPU given the same dy.
#pragma once
#include <cmath>
#include <cstdint>

#include "kernels/cuda/host_device.h"

namespace retain::cuda::gates_rows {

// Tokens per float64 partial of the bias gradient. kernels/cpu/gate_mlp.cpp uses this constant for
// its own blocks, so the two reductions cannot drift apart.
inline constexpr int64_t kColumnBlock = 256;

// a·b rounded once, never fused into a following add (nvcc contracts a·b + c by default).
RETAIN_HD float fmul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// σ(x) without exponentiating a positive number: no overflow, no loss of 1 − σ.
RETAIN_HD float sigmoid(float x) {
  if (x >= 0) return 1.0f / (1.0f + expf(-x));
  const float e = expf(x);
  return e / (1.0f + e);
}

RETAIN_HD float silu(float x) { return x * sigmoid(x); }

// silu'(x) = σ(x)·(1 + x·(1 − σ(x))).
RETAIN_HD float silu_grad(float x) {
  const float s = sigmoid(x);
  return s * (1.0f + fmul_rn(x, 1.0f - s));
}

// log σ(x) = min(x, 0) − log1p(exp(−|x|)), min written as the CPU's std::min(x, 0.0f).
RETAIN_HD float log_sigmoid(float x) {
  const float m = (0.0f < x) ? 0.0f : x;
  return m - log1pf(expf(-fabsf(x)));
}

// ---- forward (element i of a [rows, N] tensor, column i % N) --------------------------------

// a = x·Wᵀ + b in place on the GEMM output, and s = silu(a): the saved pre-activation and the
// next layer's input.
RETAIN_HD void bias_silu_element(float* a, const float* b, float* s, int64_t N, int64_t i) {
  const float v = a[i] + b[i % N];
  a[i] = v;
  s[i] = silu(v);
}

// z = x·Wᵀ + b in place on the GEMM output, and logβ = log σ(z).
RETAIN_HD void bias_log_sigmoid_element(float* z, const float* b, float* log_beta, int64_t N, int64_t i) {
  const float v = z[i] + b[i % N];
  z[i] = v;
  log_beta[i] = log_sigmoid(v);
}

// ---- backward ---------------------------------------------------------------------------------

// ∂logσ(z)/∂z = 1 − σ(z) = σ(−z).
RETAIN_HD float log_sigmoid_backward_element(float dlog_beta, float z) { return dlog_beta * sigmoid(-z); }

// da = ds·silu'(a).
RETAIN_HD float times_silu_grad_element(float ds, float a) { return ds * silu_grad(a); }

// Number of kColumnBlock-token blocks of T tokens.
RETAIN_HD int64_t column_blocks(int64_t T) { return (T + kColumnBlock - 1) / kColumnBlock; }

// Σ dy[t, j] over the tokens t of block `block`, in token order, in float64.
RETAIN_HD double column_block_partial(const float* dy, int64_t T, int64_t N, int64_t block, int64_t j) {
  const int64_t end = (block + 1) * kColumnBlock < T ? (block + 1) * kColumnBlock : T;
  double acc = 0.0;
  for (int64_t t = block * kColumnBlock; t < end; ++t) acc += dy[t * N + j];
  return acc;
}

// The blocks' partials of column j (partials [blocks, N]) in block order, added to db[j] with one
// float32 rounding.
RETAIN_HD double column_total(const double* partials, int64_t blocks, int64_t N, int64_t j) {
  double s = 0.0;
  for (int64_t b = 0; b < blocks; ++b) s += partials[b * N + j];
  return s;
}
RETAIN_HD float add_total(float db, double total) { return static_cast<float>(db + total); }

}  // namespace retain::cuda::gates_rows
