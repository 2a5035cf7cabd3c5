// CPU reference for the elementwise and GEMM ops: plain loops, OpenMP across rows,
// OpenBLAS for the matrix product, float64 where a long reduction needs it.
#include <cblas.h>

#include <cmath>
#include <cstring>

#include "kernels/base/half.h"
#include "kernels/cpu/ops_cpu.h"

namespace retain::cpu {

void embedding(const Tensor& table, const Tensor& ids, Tensor& out) {
  const int64_t T = ids.dim(0), V = table.dim(0), D = table.dim(1);
  if (table.dtype() != DType::F32 && table.dtype() != DType::BF16 && table.dtype() != DType::F16)
    fail("embedding: table dtype {} is not a float type", dtype_name(table.dtype()));
  const int32_t* id = ids.data<int32_t>();
  for (int64_t t = 0; t < T; ++t)
    if (id[t] < 0 || id[t] >= V) fail("embedding: token id {} at position {} is outside [0, {})", id[t], t, V);
  float* o = out.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = id[t];
    float* dst = o + t * D;
    switch (table.dtype()) {
      case DType::F32: std::memcpy(dst, table.data<float>() + row * D, sizeof(float) * D); break;
      case DType::BF16: {
        const uint16_t* src = static_cast<const uint16_t*>(table.raw()) + row * D;
        for (int64_t j = 0; j < D; ++j) dst[j] = bf16_to_f32(src[j]);
        break;
      }
      case DType::F16: {
        const uint16_t* src = static_cast<const uint16_t*>(table.raw()) + row * D;
        for (int64_t j = 0; j < D; ++j) dst[j] = f16_to_f32(src[j]);
        break;
      }
      default: break;  // rejected above
    }
  }
}

void linear(const Tensor& x, const Tensor& w, Tensor& y) {
  const int64_t N = x.dim(0), in = x.dim(1), out = w.dim(0);
  if (N == 0 || out == 0) return;
  if (in == 0) {
    std::memset(y.raw(), 0, y.nbytes());
    return;
  }
  // y[N,out] = x[N,in] · w[out,in]ᵀ, all row-major.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(N), static_cast<int>(out),
              static_cast<int>(in), 1.0f, x.data<float>(), static_cast<int>(in), w.data<float>(),
              static_cast<int>(in), 0.0f, y.data<float>(), static_cast<int>(out));
}

void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor& out) {
  const int64_t D = w.dim(0), rows = D == 0 ? 0 : x.numel() / D;
  const float* xs = x.data<float>();
  const float* ws = w.data<float>();
  float* os = out.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xs + r * D;
    double ss = 0;
    for (int64_t j = 0; j < D; ++j) ss += static_cast<double>(xr[j]) * xr[j];
    // HF: x * rsqrt(mean(x²) + eps) in float32, then * weight.
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(D) + eps));
    float* orow = os + r * D;
    for (int64_t j = 0; j < D; ++j) orow[j] = ws[j] * (xr[j] * inv);
  }
}

void swiglu(const Tensor& gate, const Tensor& up, Tensor& out) {
  const int64_t n = gate.numel();
  const float* g = gate.data<float>();
  const float* u = up.data<float>();
  float* o = out.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

void add_inplace(Tensor& x, const Tensor& y) {
  const int64_t n = x.numel();
  float* a = x.data<float>();
  const float* b = y.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}

}  // namespace retain::cpu
