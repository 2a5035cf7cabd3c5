// The gate MLPs: construction, forward and backward — one forward and one backward for both
// devices, through the ops of kernels/ (ops::linear*, and kernels/gate_mlp.h's steps, each with a
// CPU reference and a CUDA kernel), reading the CPU parameters or their device mirror by the
// input's device. File I/O is in gate_file.cpp and gate_containers.cpp.
#include "model/gates/gates.h"

#include <cmath>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "kernels/cuda/gates_rows.h"
#include "kernels/cuda/memory.h"
#include "kernels/gate_mlp.h"
#include "kernels/ops.h"

namespace retain::gates {

namespace {

// Every tensor of a call must be F32 on h's device: a mixed call is this one-line error.
void check_f32(const Tensor& t, const Shape& shape, const char* what, Device device) {
  if (t.dtype() != DType::F32 || t.device() != device || t.shape() != shape)
    fail("retention gate: {} is {} {} on {}, expected F32 {} on {}", what, dtype_name(t.dtype()), shape_str(t.shape()),
         device_name(t.device()), shape_str(shape), device_name(device));
}

// y = x·Wᵀ + b and s = silu(y); y (the pre-activation) is what backward needs.
void affine_silu(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y, Tensor& s) {
  y = Tensor::empty({x.dim(0), w.dim(0)}, DType::F32, x.device());
  s = Tensor::empty(y.shape(), DType::F32, x.device());
  ops::linear(x, w, y);
  ops::gate_bias_silu(y, b, s);
}

// The backward of y = x·Wᵀ + b given dy: dW += dyᵀ·x, db += Σ_t dy (float64), and dx = dy·W
// (accumulate false) or dx += dy·W (true) when dx is given.
void affine_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dw, Tensor& db, Tensor* dx,
                     bool dx_accumulate) {
  ops::linear_backward_weight(dy, x, dw, /*accumulate=*/true);
  ops::gate_add_column_sums(dy, db);
  if (dx) ops::linear_backward_input(dy, w, *dx, dx_accumulate);
}

Tensor silu_of(const Tensor& a) {
  Tensor s = Tensor::empty(a.shape(), DType::F32, a.device());
  ops::gate_silu(a, s);
  return s;
}

}  // namespace

// The one formula kernels/cuda/gates_rows.h gives both devices.
float log_sigmoid(float x) { return cuda::gates_rows::log_sigmoid(x); }

GateKind parse_gate_kind(std::string_view s, std::string_view what) {
  if (s == "trimkv") return GateKind::trimkv;
  if (s == "dbtrimkv") return GateKind::dbtrimkv;
  fail("{}: unknown gate kind '{}' (expected trimkv or dbtrimkv)", what, s);
}

std::string_view gate_kind_name(GateKind kind) { return kind == GateKind::trimkv ? "trimkv" : "dbtrimkv"; }

GateInput parse_gate_input(std::string_view s, std::string_view what) {
  if (s == "hidden") return GateInput::hidden;
  if (s == "kv") return GateInput::kv;
  fail("{}: unknown gate input '{}' (expected hidden or kv)", what, s);
}

std::string_view gate_input_name(GateInput input) { return input == GateInput::hidden ? "hidden" : "kv"; }

int64_t gate_input_width(const Qwen3Config& config, GateInput input) {
  return input == GateInput::hidden ? config.hidden_size : 2 * config.num_key_value_heads * config.head_dim;
}

Tensor RetentionGates::input_of(const Tensor& h, const Tensor& k3, const Tensor& v3) const {
  if (!reads_kv()) return h;
  RETAIN_CHECK(k3.ndim() == 3 && v3.shape() == k3.shape() && k3.dim(1) == dims_.kv_heads &&
                   2 * k3.dim(1) * k3.dim(2) == dims_.hidden,
               "kv gate input: k {} v {} for {} KV heads and input width {}", shape_str(k3.shape()),
               shape_str(v3.shape()), dims_.kv_heads, dims_.hidden);
  const int64_t T = k3.dim(0), n = k3.dim(1) * k3.dim(2);
  Tensor x = Tensor::empty({T, 2 * n}, DType::F32, k3.device());
  ops::concat_columns(k3.reshape({T, n}), v3.reshape({T, n}), x);
  return x;
}

std::string gate_tensor_name(int64_t layer, std::string_view suffix) {
  return fmt::format("model.layers.{}.self_attn.retention_gate.{}", layer, suffix);
}

RetentionGates::RetentionGates(const GateDims& d) : dims_(d) {
  if (d.layers <= 0 || d.hidden <= 0 || d.gate_hidden < 0 || d.kv_heads <= 0)
    fail("retention gates: layers {} hidden {} and KV heads {} must be positive and the gate hidden width {} not "
         "negative",
         d.layers, d.hidden, d.kv_heads, d.gate_hidden);
  if (d.gate_hidden == 0 && d.kind != GateKind::trimkv)
    fail("retention gates: gate hidden width 0 (the linear gate) is a trimkv gate; dbtrimkv gates need G > 0");
  const int64_t L = d.layers, D = d.hidden, G = d.gate_hidden, K = d.kv_heads;
  auto add = [&](std::vector<std::string> names, const Shape& shape) {
    params_.push_back({std::move(names), Tensor::zeros(shape, DType::F32), Tensor::zeros(shape, DType::F32)});
    return static_cast<int>(params_.size() - 1);
  };
  slots_.resize(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    LayerSlots& s = slots_[static_cast<size_t>(l)];
    if (G == 0) {  // the linear gate: logβ = log σ(W·h + b)
      s.w1 = add({gate_tensor_name(l, "linear.weight")}, {K, D});
      s.b = add({gate_tensor_name(l, "bias")}, {K});
      continue;
    }
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

const Tensor& RetentionGates::value_on(int slot, Device device) const {
  if (device == Device::CPU) return value(slot);
  return mirror_.values[static_cast<size_t>(slot)];
}

Tensor& RetentionGates::grad_on(int slot, Device device) {
  if (device == Device::CPU) return grad(slot);
  return mirror_.grads[static_cast<size_t>(slot)];
}

Tensor RetentionGates::forward(int64_t layer, const Tensor& h, GateActivations* saved) const {
  RETAIN_CHECK(layer >= 0 && layer < dims_.layers, "gate layer {} of {}", layer, dims_.layers);
  RETAIN_CHECK(h.ndim() == 2, "gate input {}", shape_str(h.shape()));
  const Device device = h.device();
  check_f32(h, {h.dim(0), dims_.hidden}, "input h", device);
  if (device == Device::CUDA && !has_device_mirror())
    fail("retention gate forward: h is on cuda but sync_to_device() was never called");
  const int64_t T = h.dim(0), G = dims_.gate_hidden, K = dims_.kv_heads;
  const LayerSlots& s = slots_[static_cast<size_t>(layer)];
  auto v = [&](int slot) -> const Tensor& { return value_on(slot, device); };
  Tensor log_beta = Tensor::empty({T, K}, DType::F32, device);
  if (T == 0) {  // no work; the saved tensors still have the shapes backward() checks
    if (saved)
      *saved = {G ? Tensor::empty({0, G}, DType::F32, device) : Tensor(),
                dims_.kind == GateKind::dbtrimkv ? Tensor::empty({0, G}, DType::F32, device) : Tensor(),
                Tensor::empty({0, K}, DType::F32, device)};
    return log_beta;
  }
  Tensor z = Tensor::empty({T, K}, DType::F32, device);
  if (is_linear()) {
    ops::linear(h, v(s.w1), z);
    ops::gate_bias_log_sigmoid(z, v(s.b), log_beta);
    if (saved) *saved = {Tensor(), Tensor(), std::move(z)};
    return log_beta;
  }
  Tensor a1, s1, a2, s2;
  affine_silu(h, v(s.w1), v(s.b1), a1, s1);
  const Tensor* last = &s1;
  int w_out = s.w2;
  if (dims_.kind == GateKind::dbtrimkv) {
    affine_silu(s1, v(s.w2), v(s.b2), a2, s2);
    last = &s2;
    w_out = s.w3;
  }
  ops::linear(*last, v(w_out), z);
  ops::gate_bias_log_sigmoid(z, v(s.b), log_beta);
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
  if (!is_linear()) check_f32(saved.a1, {T, G}, "saved a1", device);
  check_f32(saved.z, {T, K}, "saved z", device);
  check_f32(dlog_beta, {T, K}, "dlog_beta", device);
  if (dims_.kind == GateKind::dbtrimkv) check_f32(saved.a2, {T, G}, "saved a2", device);
  if (dh) check_f32(*dh, h.shape(), "dh", device);
  if (device == Device::CUDA && !has_device_mirror())
    fail("retention gate backward: h is on cuda but sync_to_device() was never called");
  if (T == 0) return;  // nothing to add
  const LayerSlots& s = slots_[static_cast<size_t>(layer)];
  auto v = [&](int slot) -> const Tensor& { return value_on(slot, device); };
  auto g = [&](int slot) -> Tensor& { return grad_on(slot, device); };

  Tensor dz = Tensor::empty({T, K}, DType::F32, device);
  ops::gate_log_sigmoid_backward(saved.z, dlog_beta, dz);
  if (is_linear()) {
    affine_backward(h, v(s.w1), dz, g(s.w1), g(s.b), dh, true);
    return;
  }
  const Tensor s1 = silu_of(saved.a1);
  Tensor da1 = Tensor::empty({T, G}, DType::F32, device);
  if (dims_.kind == GateKind::trimkv) {
    affine_backward(s1, v(s.w2), dz, g(s.w2), g(s.b), &da1, false);
  } else {
    const Tensor s2 = silu_of(saved.a2);
    Tensor da2 = Tensor::empty({T, G}, DType::F32, device);
    affine_backward(s2, v(s.w3), dz, g(s.w3), g(s.b), &da2, false);
    ops::gate_times_silu_grad(da2, saved.a2);
    affine_backward(s1, v(s.w2), da2, g(s.w2), g(s.b2), &da1, false);
  }
  ops::gate_times_silu_grad(da1, saved.a1);
  affine_backward(h, v(s.w1), da1, g(s.w1), g(s.b1), dh, true);
}

// ---- the CUDA mirror ------------------------------------------------------------------------

void RetentionGates::sync_to_device() {
  if (!cuda_built()) fail("retention gates: sync_to_device: this build has no CUDA support (built without CUDA)");
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

}  // namespace retain::gates
