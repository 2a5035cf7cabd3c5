// The retention gates' MLP steps on the CPU (kernels/gate_mlp.h): the per-element formulas and the
// bias-gradient reduction of kernels/cuda/gates_rows.h, which the CUDA kernels run too, here in
// OpenMP loops (each element computed alone, the reduction's order fixed: bitwise independent of
// the thread count).
#include "kernels/cpu/gate_mlp_cpu.h"

#include <algorithm>
#include <vector>

#include "kernels/cuda/gates_rows.h"

namespace retain::cpu {

namespace rows = cuda::gates_rows;

void gate_bias_silu(Tensor& a, const Tensor& b, Tensor& s) {
  const int64_t N = a.dim(1), n = a.numel();
  float* as = a.data<float>();
  float* ss = s.data<float>();
  const float* bs = b.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) rows::bias_silu_element(as, bs, ss, N, i);
}

void gate_bias_log_sigmoid(Tensor& z, const Tensor& b, Tensor& log_beta) {
  const int64_t N = z.dim(1), n = z.numel();
  float* zs = z.data<float>();
  float* lb = log_beta.data<float>();
  const float* bs = b.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) rows::bias_log_sigmoid_element(zs, bs, lb, N, i);
}

void gate_silu(const Tensor& a, Tensor& s) {
  const int64_t n = a.numel();
  const float* as = a.data<float>();
  float* ss = s.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) ss[i] = rows::silu(as[i]);
}

void gate_log_sigmoid_backward(const Tensor& z, const Tensor& dlog_beta, Tensor& dz) {
  const int64_t n = z.numel();
  const float* zs = z.data<float>();
  const float* g = dlog_beta.data<float>();
  float* d = dz.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) d[i] = rows::log_sigmoid_backward_element(g[i], zs[i]);
}

void gate_times_silu_grad(Tensor& ds, const Tensor& a) {
  const int64_t n = a.numel();
  float* g = ds.data<float>();
  const float* as = a.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) g[i] = rows::times_silu_grad_element(g[i], as[i]);
}

void gate_add_column_sums(const Tensor& dy, Tensor& db) {
  const int64_t T = dy.dim(0), N = dy.dim(1), blocks = rows::column_blocks(T);
  std::vector<double> partial(static_cast<size_t>(blocks * N), 0.0);
  const float* g = dy.data<float>();
  // Each (block, column) partial sums its tokens in token order, as rows::column_block_partial
  // does, with the columns innermost here so that the rows are read in memory order.
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    double* acc = partial.data() + b * N;
    const int64_t end = std::min(T, (b + 1) * rows::kColumnBlock);
    for (int64_t t = b * rows::kColumnBlock; t < end; ++t)
      for (int64_t j = 0; j < N; ++j) acc[j] += g[t * N + j];
  }
  float* out = db.data<float>();
  for (int64_t j = 0; j < N; ++j) out[j] = rows::add_total(out[j], rows::column_total(partial.data(), blocks, N, j));
}

}  // namespace retain::cpu
