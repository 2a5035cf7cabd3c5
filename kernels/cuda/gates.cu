// CUDA kernels of the retention-gate MLPs besides their GEMMs (CPU reference
// kernels/cpu/gate_mlp.cpp, dispatched by kernels/gate_mlp.cpp). The math lives in kernels/cuda/gates_rows.h, shared with a CPU
// emulation test (tests/cuda/test_gates_rows.cpp); this file adds indexing and launches. Not yet
// run on a GPU (none has been lent); tests/cuda/test_gates_cuda.cpp is the GPU check.
//
// Elementwise kernels: grid-stride loops, one element per thread step, int64 indices.
// Bias gradient: two launches with no atomics, so that the sum is the CPU's: one thread per
// (token block, column) writes a float64 partial to scratch, then one thread per column adds the
// partials in block order and rounds once into db. Adjacent threads take adjacent columns, so the
// per-token loads of a warp are contiguous.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/base/error.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/grid.cuh"
#include "kernels/cuda/gates_cuda.h"
#include "kernels/cuda/gates_rows.h"

namespace retain::cuda {

namespace {

using namespace gates_rows;

#define RETAIN_GATES_LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

float* fptr(Tensor& t) { return static_cast<float*>(t.raw()); }
const float* fptr(const Tensor& t) { return static_cast<const float*>(t.raw()); }


__global__ void bias_silu_kernel(float* a, const float* b, float* s, int64_t N, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) bias_silu_element(a, b, s, N, i);
}

__global__ void bias_log_sigmoid_kernel(float* z, const float* b, float* log_beta, int64_t N, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) bias_log_sigmoid_element(z, b, log_beta, N, i);
}

__global__ void silu_kernel(const float* a, float* s, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) s[i] = silu(a[i]);
}

__global__ void log_sigmoid_backward_kernel(const float* z, const float* g, float* dz, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) dz[i] = log_sigmoid_backward_element(g[i], z[i]);
}

__global__ void times_silu_grad_kernel(float* ds, const float* a, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) ds[i] = times_silu_grad_element(ds[i], a[i]);
}

// Item k = block·N + j of [blocks, N].
__global__ void column_partials_kernel(const float* dy, int64_t T, int64_t N, int64_t items, double* partials) {
  for (int64_t k = first_index(); k < items; k += grid_stride())
    partials[k] = column_block_partial(dy, T, N, k / N, k % N);
}

__global__ void column_totals_kernel(const double* partials, int64_t blocks, int64_t N, float* db) {
  for (int64_t j = first_index(); j < N; j += grid_stride()) db[j] = add_total(db[j], column_total(partials, blocks, N, j));
}

}  // namespace

void gate_bias_silu(Tensor& a, const Tensor& b, Tensor& s) {
  const int64_t n = a.numel(), N = b.numel();
  if (n == 0) return;
  bias_silu_kernel<<<elem_blocks(n), kElemThreads>>>(fptr(a), fptr(b), fptr(s), N, n);
  RETAIN_GATES_LAUNCH_CHECK();
}

void gate_bias_log_sigmoid(Tensor& z, const Tensor& b, Tensor& log_beta) {
  const int64_t n = z.numel(), N = b.numel();
  if (n == 0) return;
  bias_log_sigmoid_kernel<<<elem_blocks(n), kElemThreads>>>(fptr(z), fptr(b), fptr(log_beta), N, n);
  RETAIN_GATES_LAUNCH_CHECK();
}

void gate_silu(const Tensor& a, Tensor& s) {
  const int64_t n = a.numel();
  if (n == 0) return;
  silu_kernel<<<elem_blocks(n), kElemThreads>>>(fptr(a), fptr(s), n);
  RETAIN_GATES_LAUNCH_CHECK();
}

void gate_log_sigmoid_backward(const Tensor& z, const Tensor& dlog_beta, Tensor& dz) {
  const int64_t n = z.numel();
  if (n == 0) return;
  log_sigmoid_backward_kernel<<<elem_blocks(n), kElemThreads>>>(fptr(z), fptr(dlog_beta), fptr(dz), n);
  RETAIN_GATES_LAUNCH_CHECK();
}

void gate_times_silu_grad(Tensor& ds, const Tensor& a) {
  const int64_t n = a.numel();
  if (n == 0) return;
  times_silu_grad_kernel<<<elem_blocks(n), kElemThreads>>>(fptr(ds), fptr(a), n);
  RETAIN_GATES_LAUNCH_CHECK();
}

void gate_add_column_sums(const Tensor& dy, Tensor& db) {
  const int64_t T = dy.dim(0), N = dy.dim(1), blocks = column_blocks(T);
  if (T == 0 || N == 0) return;  // as the CPU: no tokens, db untouched
  Tensor partials = Tensor::empty({blocks, N}, DType::F64, Device::CUDA);
  double* p = static_cast<double*>(partials.raw());
  column_partials_kernel<<<elem_blocks(blocks * N), kElemThreads>>>(fptr(dy), T, N, blocks * N, p);
  RETAIN_GATES_LAUNCH_CHECK();
  column_totals_kernel<<<elem_blocks(N), kElemThreads>>>(p, blocks, N, fptr(db));
  RETAIN_GATES_LAUNCH_CHECK();
}

}  // namespace retain::cuda
