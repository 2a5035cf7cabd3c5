// CPU reference for the elementwise and GEMM ops and the dtype cast: plain loops, OpenMP across
// rows, OpenBLAS for the matrix product, float64 where a long reduction needs it.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>

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

void widen_bf16(const Tensor& w, int64_t r0, int64_t r1, int64_t c0, int64_t c1, float* dst) {
  const int64_t cols = w.dim(1), width = c1 - c0;
  const uint16_t* src = static_cast<const uint16_t*>(w.raw());
#pragma omp parallel for schedule(static)
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) dst[(r - r0) * width + (c - c0)] = bf16_to_f32(src[r * cols + c]);
}

namespace {

// y[o] (+)= x · w[o, :] for one row x: a decoding step. sgemm would first pack all of w, a copy as
// long as the product (half the time of a small model's step), and OpenBLAS's sgemv runs on
// threads of its own that fight OpenMP's (a 4× slower retain-eval, whose units run on OpenMP's
// threads). Eight float partial sums per row, read the weight's dtype directly (BF16 widens
// exactly), combined pairwise: the same values for F32 and BF16 weights, on any thread count.
template <class Weight>
void linear_row(const float* x, const Weight* w, float* y, int64_t in, int64_t out, bool accumulate) {
  const auto widen = [](Weight v) {
    if constexpr (std::is_same_v<Weight, uint16_t>) return bf16_to_f32(v);
    else return v;
  };
  const int64_t body = in - in % 8;
#pragma omp parallel for schedule(static) if (out * in >= (int64_t{1} << 20))
  for (int64_t o = 0; o < out; ++o) {
    const Weight* row = w + o * in;
    float acc[8] = {};
    for (int64_t e = 0; e < body; e += 8)
      for (int l = 0; l < 8; ++l) acc[l] += x[e + l] * widen(row[e + l]);
    float tail = 0.f;
    for (int64_t e = body; e < in; ++e) tail += x[e] * widen(row[e]);
    const float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
    y[o] = accumulate ? y[o] + sum : sum;
  }
}

}  // namespace

void linear(const Tensor& x_any, const Tensor& w, Tensor& y, bool accumulate) {
  const int64_t N = x_any.dim(0), in = x_any.dim(1), out = w.dim(0);
  if (N == 0 || out == 0) return;
  Tensor x = x_any;
  if (x.dtype() != DType::F32) {  // a BF16 x: its values widened exactly, then the F32 path
    x = Tensor::empty(x_any.shape(), DType::F32);
    cast(x_any, x);
  }
  if (in == 0) {  // an empty sum: y = 0, or y unchanged
    if (!accumulate) std::memset(y.raw(), 0, y.nbytes());
    return;
  }
  if (N == 1) {
    if (w.dtype() == DType::F32) linear_row(x.data<float>(), w.data<float>(), y.data<float>(), in, out, accumulate);
    else linear_row(x.data<float>(), static_cast<const uint16_t*>(w.raw()), y.data<float>(), in, out, accumulate);
    return;
  }
  // y[N, o0:o1] (+)= x[N,in] · w[o0:o1, in]ᵀ, all row-major (ldc = out).
  const auto gemm = [&](int64_t o0, int64_t o1, const float* wrows) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(N), static_cast<int>(o1 - o0),
                static_cast<int>(in), 1.0f, x.data<float>(), static_cast<int>(in), wrows, static_cast<int>(in),
                accumulate ? 1.0f : 0.0f,
                y.data<float>() + o0, static_cast<int>(out));
  };
  if (w.dtype() == DType::F32) return gemm(0, out, w.data<float>());
  const int64_t block = std::min(out, std::max<int64_t>(1, kWidenBlockFloats / in));  // rows of w
  const std::unique_ptr<float[]> wide(new float[static_cast<size_t>(block * in)]);
  for (int64_t o0 = 0; o0 < out; o0 += block) {
    const int64_t o1 = std::min(out, o0 + block);
    widen_bf16(w, o0, o1, 0, in, wide.get());
    gemm(o0, o1, wide.get());
  }
}

void cast(const Tensor& src, Tensor& dst) {
  const int64_t n = src.numel();
  if (n == 0) return;
  if (src.dtype() == dst.dtype()) {  // a copy keeps NaN payloads, which a round trip through F32 would not
    if (src.raw() != dst.raw()) std::memcpy(dst.raw(), src.raw(), src.nbytes());
    return;
  }
  const DType from = src.dtype(), to = dst.dtype();
  const void* s = src.raw();
  void* d = dst.raw();
  // Through float32, as the CUDA kernel (kernels/cuda/cast_rows.h): widening is exact, so each
  // element is rounded once.
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float v = from == DType::F32    ? static_cast<const float*>(s)[i]
                    : from == DType::BF16 ? bf16_to_f32(static_cast<const uint16_t*>(s)[i])
                                          : f16_to_f32(static_cast<const uint16_t*>(s)[i]);
    if (to == DType::F32)
      static_cast<float*>(d)[i] = v;
    else
      static_cast<uint16_t*>(d)[i] = to == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v);
  }
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
  if (x.dtype() == DType::F64) {
    double* a = x.data<double>();
    const double* b = y.data<double>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) a[i] += b[i];
    return;
  }
  float* a = x.data<float>();
  const float* b = y.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}

void fill(Tensor& x, double value) {
  if (x.dtype() == DType::F64)
    std::fill(x.data<double>(), x.data<double>() + x.numel(), value);
  else
    std::fill(x.data<float>(), x.data<float>() + x.numel(), static_cast<float>(value));
}

void scale_to_f32(const Tensor& src, double scale, Tensor& dst) {
  const double* s = src.data<double>();
  float* d = dst.data<float>();
  const int64_t n = src.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<float>(scale * s[i]);
}

void concat_columns(const Tensor& a, const Tensor& b, Tensor& out) {
  const int64_t T = a.dim(0), A = a.dim(1), B = b.dim(1);
  const float *pa = a.data<float>(), *pb = b.data<float>();
  float* po = out.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    std::copy_n(pa + t * A, A, po + t * (A + B));
    std::copy_n(pb + t * B, B, po + t * (A + B) + A);
  }
}

void split_columns_add(const Tensor& src, Tensor& da, Tensor& db) {
  const int64_t T = da.dim(0), A = da.dim(1), B = db.dim(1);
  const float* ps = src.data<float>();
  float *pa = da.data<float>(), *pb = db.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < A; ++j) pa[t * A + j] += ps[t * (A + B) + j];
    for (int64_t j = 0; j < B; ++j) pb[t * B + j] += ps[t * (A + B) + A + j];
  }
}

}  // namespace retain::cpu
