// Backward ops of the Qwen3 forward (kernels/ops.h): activation gradients only, since the
// model is frozen and only the retention gates train. The first half checks shapes and
// dispatches like kernels/ops.cpp; the second half is the CPU reference: plain loops,
// OpenMP across rows, OpenBLAS for the matrix product, float64 row sums.
#include <cblas.h>

#include <cmath>
#include <cstring>
#include <initializer_list>

#include "kernels/cpu/ops_cpu.h"
#include "kernels/ops.h"

namespace retain::ops {

namespace {

void expect(const Tensor& t, DType dtype, int64_t ndim, const char* op, const char* what) {
  RETAIN_CHECK(t.dtype() == dtype && t.ndim() == ndim, "{}: {} must be {}-d {}, got {} {}", op, what, ndim,
               dtype_name(dtype), dtype_name(t.dtype()), shape_str(t.shape()));
}

// Until a CUDA kernel exists for an op, a CUDA tensor is a clear error, not a silent host copy.
void require_cpu(const char* op, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->device() != Device::CPU) fail("{}: no CUDA implementation of this op yet", op);
}

}  // namespace

void linear_backward_input(const Tensor& dy, const Tensor& w, Tensor& dx, bool accumulate) {
  expect(dy, DType::F32, 2, "linear_backward_input", "dy");
  expect(w, DType::F32, 2, "linear_backward_input", "w");
  expect(dx, DType::F32, 2, "linear_backward_input", "dx");
  RETAIN_CHECK(dy.dim(1) == w.dim(0) && dx.dim(0) == dy.dim(0) && dx.dim(1) == w.dim(1),
               "linear_backward_input: dy {} w {} dx {}", shape_str(dy.shape()), shape_str(w.shape()),
               shape_str(dx.shape()));
  RETAIN_CHECK(dx.numel() == 0 || (dx.raw() != dy.raw() && dx.raw() != w.raw()),
               "linear_backward_input: dx must not alias dy or w");
  require_cpu("linear_backward_input", {&dy, &w, &dx});
  cpu::linear_backward_input(dy, w, dx, accumulate);
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, float eps, const Tensor& dy, Tensor& dx) {
  expect(w, DType::F32, 1, "rmsnorm_backward", "w");
  RETAIN_CHECK(x.dtype() == DType::F32 && x.ndim() >= 1 && x.dim(-1) == w.dim(0) && dy.dtype() == DType::F32 &&
                   dy.shape() == x.shape() && dx.dtype() == DType::F32 && dx.shape() == x.shape(),
               "rmsnorm_backward: x {} w {} dy {} dx {}", shape_str(x.shape()), shape_str(w.shape()),
               shape_str(dy.shape()), shape_str(dx.shape()));
  RETAIN_CHECK(x.numel() == 0 || dx.raw() != x.raw(), "rmsnorm_backward: dx must not alias x");
  require_cpu("rmsnorm_backward", {&x, &w, &dy, &dx});
  cpu::rmsnorm_backward(x, w, eps, dy, dx);
}

void rope_backward(Tensor& dx, const Tensor& positions, const Tensor& inv_freq, float attention_factor) {
  expect(dx, DType::F32, 3, "rope_backward", "dx");
  expect(positions, DType::I32, 1, "rope_backward", "positions");
  expect(inv_freq, DType::F32, 1, "rope_backward", "inv_freq");
  RETAIN_CHECK(dx.dim(0) == positions.dim(0) && dx.dim(2) % 2 == 0 && inv_freq.dim(0) * 2 == dx.dim(2),
               "rope_backward: dx {} positions {} inv_freq {}", shape_str(dx.shape()), shape_str(positions.shape()),
               shape_str(inv_freq.shape()));
  require_cpu("rope_backward", {&dx, &positions, &inv_freq});
  cpu::rope_backward(dx, positions, inv_freq, attention_factor);
}

void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate, Tensor& dup) {
  const Shape& s = gate.shape();
  RETAIN_CHECK(gate.dtype() == DType::F32 && up.dtype() == DType::F32 && dout.dtype() == DType::F32 &&
                   dgate.dtype() == DType::F32 && dup.dtype() == DType::F32 && up.shape() == s && dout.shape() == s &&
                   dgate.shape() == s && dup.shape() == s,
               "swiglu_backward: gate {} up {} dout {} dgate {} dup {}", shape_str(s), shape_str(up.shape()),
               shape_str(dout.shape()), shape_str(dgate.shape()), shape_str(dup.shape()));
  RETAIN_CHECK(gate.numel() == 0 || dgate.raw() != dup.raw(), "swiglu_backward: dgate and dup must not alias");
  require_cpu("swiglu_backward", {&gate, &up, &dout, &dgate, &dup});
  cpu::swiglu_backward(gate, up, dout, dgate, dup);
}

}  // namespace retain::ops

namespace retain::cpu {

void linear_backward_input(const Tensor& dy, const Tensor& w, Tensor& dx, bool accumulate) {
  const int64_t N = dy.dim(0), out = w.dim(0), in = w.dim(1);
  if (N == 0 || in == 0) return;
  if (out == 0) {
    if (!accumulate) std::memset(dx.raw(), 0, dx.nbytes());
    return;
  }
  // dx[N,in] = dy[N,out] · w[out,in], all row-major.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(N), static_cast<int>(in),
              static_cast<int>(out), 1.0f, dy.data<float>(), static_cast<int>(out), w.data<float>(),
              static_cast<int>(in), accumulate ? 1.0f : 0.0f, dx.data<float>(), static_cast<int>(in));
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, float eps, const Tensor& dy, Tensor& dx) {
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
    for (int64_t j = 0; j < D; ++j)
      orow[j] = static_cast<float>(inv * static_cast<double>(ws[j]) * gr[j] - c * xr[j]);
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
