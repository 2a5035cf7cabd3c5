// The gate MLPs: construction, forward and backward (CPU here; CUDA through the device mirror,
// the GEMMs in ops:: and the elementwise kernels of kernels/cuda/gates.cu). File I/O is in
// gate_file.cpp.
#include "model/gates/gates.h"

#include <cblas.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "kernels/cuda/gates_rows.h"
#include "kernels/ops.h"
#ifdef RETAIN_CUDA_KERNELS
#include "kernels/cuda/gates_cuda.h"
#include "kernels/cuda/memory.h"
#endif

namespace retain::gates {

namespace {

float sigmoid(float x) {
  // Never exponentiates a positive number, so it neither overflows nor loses 1 − σ.
  if (x >= 0) return 1.0f / (1.0f + std::exp(-x));
  const float e = std::exp(x);
  return e / (1.0f + e);
}

float silu(float x) { return x * sigmoid(x); }

// d silu / dx = σ(x)·(1 + x·(1 − σ(x))).
float silu_grad(float x) {
  const float s = sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}

// Every tensor of a call must be F32 on h's device: a mixed call is this one-line error.
void check_f32(const Tensor& t, const Shape& shape, const char* what, Device device) {
  if (t.dtype() != DType::F32 || t.device() != device || t.shape() != shape)
    fail("retention gate: {} is {} {} on {}, expected F32 {} on {}", what, dtype_name(t.dtype()), shape_str(t.shape()),
         device_name(t.device()), shape_str(shape), device_name(device));
}

// y[t, :] += b for every row.
void add_bias(Tensor& y, const Tensor& b) {
  const int64_t T = y.dim(0), N = y.dim(1);
  float* ys = y.data<float>();
  const float* bs = b.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < N; ++j) ys[t * N + j] += bs[j];
}

Tensor silu_of(const Tensor& a) {
  Tensor s = Tensor::empty(a.shape(), DType::F32);
  const float* as = a.data<float>();
  float* ss = s.data<float>();
  const int64_t n = a.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) ss[i] = silu(as[i]);
  return s;
}

// Linear y = x·Wᵀ + b through the shared op (OpenBLAS).
Tensor affine(const Tensor& x, const Tensor& w, const Tensor& b) {
  Tensor y = Tensor::empty({x.dim(0), w.dim(0)}, DType::F32);
  ops::linear(x, w, y);
  add_bias(y, b);
  return y;
}

// db[j] += Σ_t dy[t, j] in float64. Rows are summed in fixed blocks, then the blocks in order:
// cache-friendly and bitwise independent of the thread count.
void add_column_sums(const Tensor& dy, Tensor& db) {
  constexpr int64_t kBlock = cuda::gates_rows::kColumnBlock;  // the CUDA kernel's blocks too
  const int64_t T = dy.dim(0), N = dy.dim(1), blocks = (T + kBlock - 1) / kBlock;
  std::vector<double> partial(static_cast<size_t>(blocks * N), 0.0);
  const float* g = dy.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    double* acc = partial.data() + b * N;
    for (int64_t t = b * kBlock; t < std::min(T, (b + 1) * kBlock); ++t)
      for (int64_t j = 0; j < N; ++j) acc[j] += g[t * N + j];
  }
  float* out = db.data<float>();
  for (int64_t j = 0; j < N; ++j) {
    double s = 0;
    for (int64_t b = 0; b < blocks; ++b) s += partial[static_cast<size_t>(b * N + j)];
    out[j] = static_cast<float>(out[j] + s);
  }
}

// The backward of y = x·Wᵀ + b given dy [T, out]: dW += dyᵀ·x, db += Σ_t dy (float64),
// and, if dx is given, dx = dy·W (beta 0) or dx += dy·W (beta 1).
void affine_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dw, Tensor* db, Tensor* dx,
                     float dx_beta) {
  const int64_t T = x.dim(0), in = x.dim(1), out = w.dim(0);
  if (T == 0) return;
  const int T_ = static_cast<int>(T), in_ = static_cast<int>(in), out_ = static_cast<int>(out);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out_, in_, T_, 1.0f, dy.data<float>(), out_, x.data<float>(),
              in_, 1.0f, dw.data<float>(), in_);
  if (db) add_column_sums(dy, *db);
  if (dx)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T_, in_, out_, 1.0f, dy.data<float>(), out_,
                w.data<float>(), in_, dx_beta, dx->data<float>(), in_);
}

// da = ds ⊙ silu'(a), in place on ds.
void times_silu_grad(Tensor& ds, const Tensor& a) {
  float* g = ds.data<float>();
  const float* as = a.data<float>();
  const int64_t n = a.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) g[i] *= silu_grad(as[i]);
}

}  // namespace

float log_sigmoid(float x) { return std::min(x, 0.0f) - std::log1p(std::exp(-std::fabs(x))); }

GateKind parse_gate_kind(std::string_view s, std::string_view what) {
  if (s == "trimkv") return GateKind::trimkv;
  if (s == "dbtrimkv") return GateKind::dbtrimkv;
  fail("{}: unknown gate kind '{}' (expected trimkv or dbtrimkv)", what, s);
}

std::string_view gate_kind_name(GateKind kind) { return kind == GateKind::trimkv ? "trimkv" : "dbtrimkv"; }

std::string gate_tensor_name(int64_t layer, std::string_view suffix) {
  return fmt::format("model.layers.{}.self_attn.retention_gate.{}", layer, suffix);
}

RetentionGates::RetentionGates(const GateDims& d) : dims_(d) {
  if (d.layers <= 0 || d.hidden <= 0 || d.gate_hidden <= 0 || d.kv_heads <= 0)
    fail("retention gates: layers {}, hidden {}, gate hidden {} and KV heads {} must all be positive", d.layers,
         d.hidden, d.gate_hidden, d.kv_heads);
  const int64_t L = d.layers, D = d.hidden, G = d.gate_hidden, K = d.kv_heads;
  auto add = [&](std::vector<std::string> names, const Shape& shape) {
    params_.push_back({std::move(names), Tensor::zeros(shape, DType::F32), Tensor::zeros(shape, DType::F32)});
    return static_cast<int>(params_.size() - 1);
  };
  slots_.resize(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    LayerSlots& s = slots_[static_cast<size_t>(l)];
    s.w1 = add({gate_tensor_name(l, "linear1.weight")}, {G, D});
    s.b1 = add({gate_tensor_name(l, "linear1.bias")}, {G});
    if (d.kind == GateKind::trimkv) {
      s.w2 = add({gate_tensor_name(l, "linear2.weight")}, {K, G});
      s.b = add({gate_tensor_name(l, "bias")}, {K});
    } else {
      s.w2 = add({gate_tensor_name(l, "linear2.weight")}, {G, G});
      s.b2 = add({gate_tensor_name(l, "linear2.bias")}, {G});
    }
  }
  if (d.kind == GateKind::dbtrimkv) {
    std::vector<std::string> w3_names, b_names;
    for (int64_t l = 0; l < L; ++l) {
      w3_names.push_back(gate_tensor_name(l, "linear3.weight"));
      b_names.push_back(gate_tensor_name(l, "bias"));
    }
    const int w3 = add(std::move(w3_names), {K, G});
    const int b = add(std::move(b_names), {K});
    for (LayerSlots& s : slots_) s.w3 = w3, s.b = b;
  }
}

RetentionGates RetentionGates::init(const GateDims& dims, double bias_init, uint64_t seed) {
  if (!std::isfinite(bias_init)) fail("retention gates: bias init {} is not finite", bias_init);
  RetentionGates g(dims);
  g.bias_init_ = bias_init;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 0.02);
  std::vector<bool> is_b(g.params_.size(), false);  // the logit bias b (per layer or shared)
  for (const LayerSlots& s : g.slots_) is_b[static_cast<size_t>(s.b)] = true;
  for (size_t i = 0; i < g.params_.size(); ++i) {
    Tensor& v = g.params_[i].value;
    float* x = v.data<float>();
    if (v.ndim() == 2)
      for (int64_t j = 0; j < v.numel(); ++j) x[j] = static_cast<float>(normal(rng));
    else if (is_b[i])
      for (int64_t j = 0; j < v.numel(); ++j) x[j] = static_cast<float>(bias_init);
    // b1, b2 stay 0.
  }
  return g;
}

Tensor RetentionGates::forward(int64_t layer, const Tensor& h, GateActivations* saved) const {
  RETAIN_CHECK(layer >= 0 && layer < dims_.layers, "gate layer {} of {}", layer, dims_.layers);
  RETAIN_CHECK(h.ndim() == 2, "gate input {}", shape_str(h.shape()));
  if (h.device() == Device::CUDA) return forward_cuda(layer, h, saved);
  check_f32(h, {h.dim(0), dims_.hidden}, "input h", Device::CPU);
  const LayerSlots& s = slots_[static_cast<size_t>(layer)];
  Tensor a1 = affine(h, value(s.w1), value(s.b1));
  Tensor s1 = silu_of(a1);
  Tensor a2, z;
  if (dims_.kind == GateKind::trimkv) {
    z = affine(s1, value(s.w2), value(s.b));
  } else {
    a2 = affine(s1, value(s.w2), value(s.b2));
    z = affine(silu_of(a2), value(s.w3), value(s.b));
  }
  Tensor log_beta = Tensor::empty(z.shape(), DType::F32);
  const float* zs = z.data<float>();
  float* lb = log_beta.data<float>();
  for (int64_t i = 0; i < z.numel(); ++i) lb[i] = log_sigmoid(zs[i]);
  if (saved) *saved = {std::move(a1), std::move(a2), std::move(z)};
  return log_beta;
}

void RetentionGates::backward(int64_t layer, const Tensor& h, const GateActivations& saved, const Tensor& dlog_beta,
                              Tensor* dh) {
  RETAIN_CHECK(layer >= 0 && layer < dims_.layers, "gate layer {} of {}", layer, dims_.layers);
  RETAIN_CHECK(h.ndim() == 2, "gate input {}", shape_str(h.shape()));
  const int64_t T = h.dim(0), G = dims_.gate_hidden, K = dims_.kv_heads;
  const Device device = h.device();
  check_f32(h, {T, dims_.hidden}, "input h", device);
  check_f32(saved.a1, {T, G}, "saved a1", device);
  check_f32(saved.z, {T, K}, "saved z", device);
  check_f32(dlog_beta, {T, K}, "dlog_beta", device);
  if (dims_.kind == GateKind::dbtrimkv) check_f32(saved.a2, {T, G}, "saved a2", device);
  if (dh) check_f32(*dh, h.shape(), "dh", device);
  if (device == Device::CUDA) return backward_cuda(layer, h, saved, dlog_beta, dh);
  const LayerSlots& s = slots_[static_cast<size_t>(layer)];

  // d logσ(z)/dz = 1 − σ(z) = σ(−z).
  Tensor dz = Tensor::empty({T, K}, DType::F32);
  {
    const float* z = saved.z.data<float>();
    const float* g = dlog_beta.data<float>();
    float* d = dz.data<float>();
    for (int64_t i = 0; i < T * K; ++i) d[i] = g[i] * sigmoid(-z[i]);
  }
  const Tensor s1 = silu_of(saved.a1);
  Tensor da1 = Tensor::empty({T, G}, DType::F32);
  if (dims_.kind == GateKind::trimkv) {
    affine_backward(s1, value(s.w2), dz, grad(s.w2), &grad(s.b), &da1, 0.0f);
  } else {
    const Tensor s2 = silu_of(saved.a2);
    Tensor da2 = Tensor::empty({T, G}, DType::F32);
    affine_backward(s2, value(s.w3), dz, grad(s.w3), &grad(s.b), &da2, 0.0f);
    times_silu_grad(da2, saved.a2);
    affine_backward(s1, value(s.w2), da2, grad(s.w2), &grad(s.b2), &da1, 0.0f);
  }
  times_silu_grad(da1, saved.a1);
  affine_backward(h, value(s.w1), da1, grad(s.w1), &grad(s.b1), dh, 1.0f);
}

// ---- CUDA: the device mirror and the forward/backward on it ------------------------------

#ifdef RETAIN_CUDA_KERNELS

void RetentionGates::sync_to_device() {
  if (cuda_device_count() == 0) fail("retention gates: sync_to_device: no CUDA device is visible");
  if (mirror_.values.size() != params_.size()) {
    DeviceMirror fresh;
    for (const GateParameter& p : params_) {
      fresh.values.push_back(Tensor::empty(p.value.shape(), DType::F32, Device::CUDA));
      fresh.grads.push_back(Tensor::empty(p.value.shape(), DType::F32, Device::CUDA));
    }
    mirror_ = std::move(fresh);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    mirror_.values[i].copy_from(params_[i].value);
    cuda::memset_device(mirror_.grads[i].raw(), 0, mirror_.grads[i].nbytes());
  }
}

void RetentionGates::add_device_grads_to_host() {
  if (!has_device_mirror()) fail("retention gates: add_device_grads_to_host() before any sync_to_device()");
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor g = mirror_.grads[i].to(Device::CPU);
    const float* src = g.data<float>();
    float* dst = params_[i].grad.data<float>();
    for (int64_t k = 0; k < g.numel(); ++k) dst[k] += src[k];
    cuda::memset_device(mirror_.grads[i].raw(), 0, mirror_.grads[i].nbytes());
  }
}

namespace {

void require_mirror(bool present, const char* what) {
  if (!present) fail("retention gate {}: h is on cuda but sync_to_device() was never called", what);
}

// y = x·Wᵀ + b, s = silu(y) on the device; y (the pre-activation) is what backward needs.
void affine_silu_cuda(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y, Tensor& s) {
  y = Tensor::empty({x.dim(0), w.dim(0)}, DType::F32, Device::CUDA);
  s = Tensor::empty(y.shape(), DType::F32, Device::CUDA);
  ops::linear(x, w, y);
  cuda::gate_bias_silu(y, b, s);
}

// The CUDA counterpart of affine_backward: dW += dyᵀ·x, db += Σ_t dy (float64), and dx = dy·W
// (accumulate false) or dx += dy·W (true).
void affine_backward_cuda(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dw, Tensor& db, Tensor* dx,
                          bool dx_accumulate) {
  ops::linear_backward_weight(dy, x, dw, /*accumulate=*/true);
  cuda::gate_add_column_sums(dy, db);
  if (dx) ops::linear_backward_input(dy, w, *dx, dx_accumulate);
}

}  // namespace

Tensor RetentionGates::forward_cuda(int64_t layer, const Tensor& h, GateActivations* saved) const {
  check_f32(h, {h.dim(0), dims_.hidden}, "input h", Device::CUDA);
  require_mirror(has_device_mirror(), "forward");
  const int64_t T = h.dim(0), K = dims_.kv_heads;
  const LayerSlots& s = slots_[static_cast<size_t>(layer)];
  auto v = [&](int slot) -> const Tensor& { return mirror_.values[static_cast<size_t>(slot)]; };
  Tensor log_beta = Tensor::empty({T, K}, DType::F32, Device::CUDA);
  if (T == 0) {  // no launches; the saved tensors still have the shapes backward() checks
    if (saved)
      *saved = {Tensor::empty({0, dims_.gate_hidden}, DType::F32, Device::CUDA),
                dims_.kind == GateKind::dbtrimkv ? Tensor::empty({0, dims_.gate_hidden}, DType::F32, Device::CUDA)
                                                 : Tensor(),
                Tensor::empty({0, K}, DType::F32, Device::CUDA)};
    return log_beta;
  }
  Tensor a1, s1, a2, s2;
  affine_silu_cuda(h, v(s.w1), v(s.b1), a1, s1);
  const Tensor* last = &s1;
  int w_out = s.w2;
  if (dims_.kind == GateKind::dbtrimkv) {
    affine_silu_cuda(s1, v(s.w2), v(s.b2), a2, s2);
    last = &s2;
    w_out = s.w3;
  }
  Tensor z = Tensor::empty({T, K}, DType::F32, Device::CUDA);
  ops::linear(*last, v(w_out), z);
  cuda::gate_bias_log_sigmoid(z, v(s.b), log_beta);
  if (saved) *saved = {std::move(a1), std::move(a2), std::move(z)};
  return log_beta;
}

void RetentionGates::backward_cuda(int64_t layer, const Tensor& h, const GateActivations& saved,
                                   const Tensor& dlog_beta, Tensor* dh) {
  require_mirror(has_device_mirror(), "backward");
  const int64_t T = h.dim(0), G = dims_.gate_hidden, K = dims_.kv_heads;
  if (T == 0) return;  // as the CPU: nothing to add
  const LayerSlots& s = slots_[static_cast<size_t>(layer)];
  auto v = [&](int slot) -> const Tensor& { return mirror_.values[static_cast<size_t>(slot)]; };
  auto g = [&](int slot) -> Tensor& { return mirror_.grads[static_cast<size_t>(slot)]; };

  Tensor dz = Tensor::empty({T, K}, DType::F32, Device::CUDA);
  cuda::gate_log_sigmoid_backward(saved.z, dlog_beta, dz);
  Tensor s1 = Tensor::empty({T, G}, DType::F32, Device::CUDA);
  cuda::gate_silu(saved.a1, s1);
  Tensor da1 = Tensor::empty({T, G}, DType::F32, Device::CUDA);
  if (dims_.kind == GateKind::trimkv) {
    affine_backward_cuda(s1, v(s.w2), dz, g(s.w2), g(s.b), &da1, false);
  } else {
    Tensor s2 = Tensor::empty({T, G}, DType::F32, Device::CUDA);
    cuda::gate_silu(saved.a2, s2);
    Tensor da2 = Tensor::empty({T, G}, DType::F32, Device::CUDA);
    affine_backward_cuda(s2, v(s.w3), dz, g(s.w3), g(s.b), &da2, false);
    cuda::gate_times_silu_grad(da2, saved.a2);
    affine_backward_cuda(s1, v(s.w2), da2, g(s.w2), g(s.b2), &da1, false);
  }
  cuda::gate_times_silu_grad(da1, saved.a1);
  affine_backward_cuda(h, v(s.w1), da1, g(s.w1), g(s.b1), dh, true);
}

#else  // a build without the CUDA gate kernels

namespace {
[[noreturn]] void no_cuda_gates(const char* what) {
  fail("retention gates: {}: this build has no CUDA gate kernels (built without CUDA)", what);
}
}  // namespace

void RetentionGates::sync_to_device() { no_cuda_gates("sync_to_device"); }
void RetentionGates::add_device_grads_to_host() { no_cuda_gates("add_device_grads_to_host"); }
Tensor RetentionGates::forward_cuda(int64_t, const Tensor&, GateActivations*) const { no_cuda_gates("forward"); }
void RetentionGates::backward_cuda(int64_t, const Tensor&, const GateActivations&, const Tensor&, Tensor*) {
  no_cuda_gates("backward");
}

#endif

}  // namespace retain::gates
