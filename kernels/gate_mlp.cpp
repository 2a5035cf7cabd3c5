// Checks and device dispatch of kernels/gate_mlp.h.
#include "kernels/gate_mlp.h"

#include "kernels/base/error.h"
#include "kernels/cpu/gate_mlp_cpu.h"
#ifdef RETAIN_CUDA_KERNELS
#include "kernels/cuda/gates_cuda.h"
#endif

namespace retain::ops {

namespace {

// Every tensor of the call F32 on the first one's device, with the stated shape.
Device expect(const char* op, std::initializer_list<std::pair<const Tensor*, Shape>> ts) {
  const Device device = ts.begin()->first->device();
  for (const auto& [t, shape] : ts)
    if (t->dtype() != DType::F32 || t->device() != device || t->shape() != shape)
      fail("{}: expected F32 {} on {}, got {} {} on {}", op, shape_str(shape), device_name(device), dtype_name(t->dtype()),
           shape_str(t->shape()), device_name(t->device()));
  return device;
}

Shape rows_of(const char* op, const Tensor& t) {
  if (t.ndim() != 2) fail("{}: expected a 2-d tensor, got {}", op, shape_str(t.shape()));
  return t.shape();
}

}  // namespace

#ifdef RETAIN_CUDA_KERNELS
#define RETAIN_GATE_OP(device, call) \
  do {                               \
    if ((device) == Device::CUDA) {  \
      cuda::call;                    \
      return;                        \
    }                                \
    cpu::call;                       \
  } while (0)
#else
#define RETAIN_GATE_OP(device, call)                                                                \
  do {                                                                                              \
    if ((device) == Device::CUDA) fail("retention gate: this build has no CUDA gate kernels");      \
    cpu::call;                                                                                      \
  } while (0)
#endif

void gate_bias_silu(Tensor& a, const Tensor& b, Tensor& s) {
  const Shape shape = rows_of("gate_bias_silu", a);
  const Device d = expect("gate_bias_silu", {{&a, shape}, {&b, {shape[1]}}, {&s, shape}});
  RETAIN_GATE_OP(d, gate_bias_silu(a, b, s));
}

void gate_bias_log_sigmoid(Tensor& z, const Tensor& b, Tensor& log_beta) {
  const Shape shape = rows_of("gate_bias_log_sigmoid", z);
  const Device d = expect("gate_bias_log_sigmoid", {{&z, shape}, {&b, {shape[1]}}, {&log_beta, shape}});
  RETAIN_GATE_OP(d, gate_bias_log_sigmoid(z, b, log_beta));
}

void gate_silu(const Tensor& a, Tensor& s) {
  const Shape shape = rows_of("gate_silu", a);
  const Device d = expect("gate_silu", {{&a, shape}, {&s, shape}});
  RETAIN_GATE_OP(d, gate_silu(a, s));
}

void gate_log_sigmoid_backward(const Tensor& z, const Tensor& dlog_beta, Tensor& dz) {
  const Shape shape = rows_of("gate_log_sigmoid_backward", z);
  const Device d = expect("gate_log_sigmoid_backward", {{&z, shape}, {&dlog_beta, shape}, {&dz, shape}});
  RETAIN_GATE_OP(d, gate_log_sigmoid_backward(z, dlog_beta, dz));
}

void gate_times_silu_grad(Tensor& ds, const Tensor& a) {
  const Shape shape = rows_of("gate_times_silu_grad", a);
  const Device d = expect("gate_times_silu_grad", {{&ds, shape}, {&a, shape}});
  RETAIN_GATE_OP(d, gate_times_silu_grad(ds, a));
}

void gate_add_column_sums(const Tensor& dy, Tensor& db) {
  const Shape shape = rows_of("gate_add_column_sums", dy);
  const Device d = expect("gate_add_column_sums", {{&dy, shape}, {&db, {shape[1]}}});
  RETAIN_GATE_OP(d, gate_add_column_sums(dy, db));
}

}  // namespace retain::ops
