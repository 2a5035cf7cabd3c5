// CPU reference of the backward ops of the Qwen3 forward (kernels/ops.h; checks and dispatch
// in kernels/ops.cpp): activation gradients through the frozen model, plus the weight gradient
// of a linear layer for the trainable gate MLPs. Plain loops, OpenMP across rows, OpenBLAS for
// the matrix products, float64 row sums.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "kernels/cpu/ops_cpu.h"

namespace retain::cpu {

void linear_backward_input(const Tensor& dy, const Tensor& w, Tensor& dx, bool accumulate) {
  const int64_t N = dy.dim(0), out = w.dim(0), in = w.dim(1);
  if (N == 0 || in == 0) return;
  if (out == 0) {
    if (!accumulate) std::memset(dx.raw(), 0, dx.nbytes());
    return;
  }
  // dx[N, c0:c1] = dy[N,out] · w[out, c0:c1], all row-major (ldc = in); wcols has leading dim ldw.
  const auto gemm = [&](int64_t c0, int64_t c1, const float* wcols, int64_t ldw) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(N), static_cast<int>(c1 - c0),
                static_cast<int>(out), 1.0f, dy.data<float>(), static_cast<int>(out), wcols, static_cast<int>(ldw),
                accumulate ? 1.0f : 0.0f, dx.data<float>() + c0, static_cast<int>(in));
  };
  if (w.dtype() == DType::F32) return gemm(0, in, w.data<float>(), in);
  // BF16: widened by column blocks of w (kernels/cpu/ops_cpu.h), so each block is a whole product.
  const int64_t block = std::min(in, std::max<int64_t>(1, kWidenBlockFloats / out));
  const std::unique_ptr<float[]> wide(new float[static_cast<size_t>(block * out)]);
  for (int64_t c0 = 0; c0 < in; c0 += block) {
    const int64_t c1 = std::min(in, c0 + block);
    widen_bf16(w, 0, out, c0, c1, wide.get());
    gemm(c0, c1, wide.get(), c1 - c0);
  }
}

void linear_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, bool accumulate) {
  const int64_t N = dy.dim(0), out = dy.dim(1), in = x.dim(1);
  if (out == 0 || in == 0) return;
  if (N == 0) {  // an empty sum over tokens
    if (!accumulate) std::memset(dw.raw(), 0, dw.nbytes());
    return;
  }
  // dw[out,in] = dy[N,out]ᵀ · x[N,in], all row-major.
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(out), static_cast<int>(in),
              static_cast<int>(N), 1.0f, dy.data<float>(), static_cast<int>(out), x.data<float>(),
              static_cast<int>(in), accumulate ? 1.0f : 0.0f, dw.data<float>(), static_cast<int>(in));
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, float eps, const Tensor& dy, Tensor& dx, bool accumulate) {
  const int64_t D = w.dim(0), rows = D == 0 ? 0 : x.numel() / D;
  const float* xs = x.data<float>();
  const float* ws = w.data<float>();
  const float* gs = dy.data<float>();
  float* os = dx.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xs + r * D;
    const float* gr = gs + r * D;
    double ss = 0, dot = 0;  // Σx², Σ(w·dy)·x
    for (int64_t j = 0; j < D; ++j) {
      ss += static_cast<double>(xr[j]) * xr[j];
      dot += static_cast<double>(ws[j]) * gr[j] * xr[j];
    }
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(D) + eps);
    const double c = dot * inv * inv * inv / static_cast<double>(D);
    float* orow = os + r * D;  // may be gr: element j is read above and here before it is written
    for (int64_t j = 0; j < D; ++j) {
      const float g = static_cast<float>(inv * static_cast<double>(ws[j]) * gr[j] - c * xr[j]);
      orow[j] = accumulate ? orow[j] + g : g;  // as add_inplace would add it
    }
  }
}

void rope_backward(Tensor& dx, const Tensor& positions, const Tensor& inv_freq, float attention_factor) {
  rope_rotate(dx, positions, inv_freq, attention_factor, /*transpose=*/true);  // the forward's c and s, bit for bit
}

void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate, Tensor& dup) {
  const int64_t n = gate.numel();
  const float* g = gate.data<float>();
  const float* u = up.data<float>();
  const float* go = dout.data<float>();
  float* dg = dgate.data<float>();
  float* du = dup.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i], y = u[i], o = go[i];
    // σ without exponentiating a positive number; silu'(x) = σ(x)·(1 + x·(1 − σ(x))).
    const float e = std::exp(-std::fabs(x));
    const float sig = x >= 0 ? 1.0f / (1.0f + e) : e / (1.0f + e);
    dg[i] = o * y * (sig * (1.0f + x * (1.0f - sig)));
    du[i] = o * (x * sig);
  }
}

}  // namespace retain::cpu
