#include "trainer/flat_params.h"

#include <cstring>

namespace retain::trainer {

namespace {

void check_f32(const Tensor& t, const gates::GateParameter& p) {
  RETAIN_CHECK(t.dtype() == DType::F32 && t.device() == Device::CPU && t.shape() == p.value.shape(),
               "gate parameter {}: expected a CPU F32 {} tensor", p.name(), shape_str(p.value.shape()));
}

// Copies each parameter's value (or gradient) to out, one after another.
template <bool kGrad>
void flatten(const gates::RetentionGates& gates, float* out) {
  for (const gates::GateParameter& p : gates.parameters()) {
    const Tensor& t = kGrad ? p.grad : p.value;
    check_f32(t, p);
    std::memcpy(out, t.data<float>(), t.nbytes());
    out += t.numel();
  }
}

}  // namespace

int64_t flat_size(const gates::RetentionGates& gates) {
  int64_t n = 0;
  for (const gates::GateParameter& p : gates.parameters()) n += p.value.numel();
  return n;
}

void flatten_values(const gates::RetentionGates& gates, float* out) { flatten<false>(gates, out); }
void flatten_grads(const gates::RetentionGates& gates, float* out) { flatten<true>(gates, out); }

void unflatten_values(gates::RetentionGates& gates, const float* in) {
  for (gates::GateParameter& p : gates.parameters()) {
    check_f32(p.value, p);
    std::memcpy(p.value.data<float>(), in, p.value.nbytes());
    in += p.value.numel();
  }
}

}  // namespace retain::trainer
