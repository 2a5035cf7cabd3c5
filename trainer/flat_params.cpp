#include "trainer/flat_params.h"

#include <cstring>

namespace retain::trainer {

namespace {

void check_f32(const Tensor& t, const Parameter& p) {
  RETAIN_CHECK(t.dtype() == DType::F32 && t.device() == Device::CPU && t.shape() == p.value.shape(),
               "gate parameter {}: expected a CPU F32 {} tensor", p.name(), shape_str(p.value.shape()));
}

// Copies each parameter's value (or gradient) to out, one after another.
template <bool kGrad>
void flatten(const ParameterSet& gates, float* out) {
  for (const Parameter& p : gates.parameters()) {
    const Tensor& t = kGrad ? p.grad : p.value;
    check_f32(t, p);
    std::memcpy(out, t.data<float>(), t.nbytes());
    out += t.numel();
  }
}

// The inverse: in, one parameter after another, into each value (or gradient).
template <bool kGrad>
void unflatten(ParameterSet& gates, const float* in) {
  for (Parameter& p : gates.parameters()) {
    Tensor& t = kGrad ? p.grad : p.value;
    check_f32(t, p);
    std::memcpy(t.data<float>(), in, t.nbytes());
    in += t.numel();
  }
}

}  // namespace

int64_t flat_size(const ParameterSet& gates) {
  int64_t n = 0;
  for (const Parameter& p : gates.parameters()) n += p.value.numel();
  return n;
}

void flatten_values(const ParameterSet& gates, float* out) { flatten<false>(gates, out); }
void flatten_grads(const ParameterSet& gates, float* out) { flatten<true>(gates, out); }

void unflatten_values(ParameterSet& gates, const float* in) { unflatten<false>(gates, in); }
void unflatten_grads(ParameterSet& gates, const float* in) { unflatten<true>(gates, in); }

}  // namespace retain::trainer
