// Shape/dtype/value checks and device dispatch for kernels/retention.h. Failures are one
// line naming the op, the argument and what was expected.
#include "kernels/retention.h"

#include <cmath>
#include <initializer_list>
#include <string>

#include "kernels/cpu/retention_cpu.h"

namespace retain::ops {

namespace {

// Fails unless t is a dtype tensor of exactly `shape` (the shape spelled in `spec`, e.g. "[T, H, d]").
void expect(const char* op, const char* what, const Tensor& t, DType dtype, const Shape& shape, const char* spec) {
  if (t.dtype() != dtype || t.shape() != shape)
    fail("{}: {} must be {} {} = {}, got {} {}", op, what, dtype_name(dtype), spec, shape_str(shape),
         dtype_name(t.dtype()), shape_str(t.shape()));
}

void expect_ndim(const char* op, const char* what, const Tensor& t, DType dtype, int64_t ndim, const char* spec) {
  if (t.dtype() != dtype || t.ndim() != ndim)
    fail("{}: {} must be a {}-d {} tensor {}, got {} {}", op, what, ndim, dtype_name(dtype), spec,
         dtype_name(t.dtype()), shape_str(t.shape()));
}

// Each op has a CPU reference; CUDA kernels arrive op by op. Until an op has one, asking for
// it on a CUDA tensor is a clear error rather than a silent host copy.
void require_cpu(const char* op, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->device() != Device::CPU) fail("{}: no CUDA implementation of this op yet", op);
}

// Positions t − i enter the scores as float32 and must be exact there.
void check_length(const char* op, int64_t T) {
  if (T >= (int64_t{1} << 24)) fail("{}: sequence length {} is not below 2^24", op, T);
}

// logβ is a logsigmoid output, so ≤ 0 (−inf allowed): that keeps every exp((t − i)·logβ) ≤ 1
// in the capacity sums, and a NaN or positive value can only come from a bug upstream.
void check_log_beta(const char* op, const Tensor& log_beta) {
  const float* lb = log_beta.data<float>();
  for (int64_t x = 0; x < log_beta.numel(); ++x) {
    if (lb[x] <= 0.0f) continue;
    std::string index;
    for (int64_t a = log_beta.ndim() - 1, rest = x; a >= 0; --a) {
      index = fmt::format("{}{}", rest % log_beta.dim(a), index.empty() ? "" : ", " + index);
      rest /= log_beta.dim(a);
    }
    fail("{}: log_beta[{}] = {} is not ≤ 0 (it must be a logsigmoid output)", op, index, lb[x]);
  }
}

struct AttentionDims {
  int64_t T, H, K, d;
};

AttentionDims check_attention_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& log_beta, const Tensor& doc, float scale) {
  expect_ndim(op, "q", q, DType::F32, 3, "[T, H, d]");
  const AttentionDims a{q.dim(0), q.dim(1), 0, q.dim(2)};
  expect_ndim(op, "k", k, DType::F32, 3, "[T, K, d]");
  const int64_t K = k.dim(1);
  if (K <= 0 || a.H % K != 0) fail("{}: {} query heads are not a multiple of {} KV heads", op, a.H, K);
  expect(op, "k", k, DType::F32, {a.T, K, a.d}, "[T, K, d]");
  expect(op, "v", v, DType::F32, {a.T, K, a.d}, "[T, K, d]");
  expect(op, "log_beta", log_beta, DType::F32, {a.T, K}, "[T, K]");
  expect(op, "doc", doc, DType::I32, {a.T}, "[T]");
  if (!std::isfinite(scale)) fail("{}: scale {} is not finite", op, scale);
  check_length(op, a.T);
  return {a.T, a.H, K, a.d};
}

void check_capacity_inputs(const char* op, const Tensor& log_beta, const Tensor& doc) {
  expect_ndim(op, "log_beta", log_beta, DType::F32, 3, "[L, T, K]");
  expect(op, "doc", doc, DType::I32, {log_beta.dim(1)}, "[T]");
  check_length(op, log_beta.dim(1));
  require_cpu(op, {&log_beta, &doc});
  check_log_beta(op, log_beta);
}

void check_capacity_loss_inputs(const char* op, const Tensor& log_beta, const Tensor& doc, const Tensor& positions,
                                double memory) {
  check_capacity_inputs(op, log_beta, doc);
  expect(op, "positions", positions, DType::I32, {log_beta.dim(1)}, "[T]");
  require_cpu(op, {&positions});
  const int32_t* p = positions.data<int32_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    if (p[t] < 0) fail("{}: positions[{}] = {} is negative", op, t, p[t]);
  if (!std::isfinite(memory) || memory < 0) fail("{}: memory M = {} is not a finite number ≥ 0", op, memory);
}

}  // namespace

void gated_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& log_beta, const Tensor& doc,
                     float scale, Tensor& out, Tensor& lse) {
  const char* op = "gated_attention";
  const AttentionDims a = check_attention_inputs(op, q, k, v, log_beta, doc, scale);
  expect(op, "out", out, DType::F32, q.shape(), "[T, H, d]");
  expect(op, "lse", lse, DType::F32, {a.T, a.H}, "[T, H]");
  require_cpu(op, {&q, &k, &v, &log_beta, &doc, &out, &lse});
  check_log_beta(op, log_beta);
  cpu::gated_attention(q, k, v, log_beta, doc, scale, out, lse);
}

void gated_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& log_beta,
                              const Tensor& doc, float scale, const Tensor& out, const Tensor& lse,
                              const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dlog_beta) {
  const char* op = "gated_attention_backward";
  const AttentionDims a = check_attention_inputs(op, q, k, v, log_beta, doc, scale);
  expect(op, "out", out, DType::F32, q.shape(), "[T, H, d]");
  expect(op, "lse", lse, DType::F32, {a.T, a.H}, "[T, H]");
  expect(op, "dout", dout, DType::F32, q.shape(), "[T, H, d]");
  expect(op, "dq", dq, DType::F32, q.shape(), "[T, H, d]");
  expect(op, "dk", dk, DType::F32, k.shape(), "[T, K, d]");
  expect(op, "dv", dv, DType::F32, k.shape(), "[T, K, d]");
  expect(op, "dlog_beta", dlog_beta, DType::F32, {a.T, a.K}, "[T, K]");
  require_cpu(op, {&q, &k, &v, &log_beta, &doc, &out, &lse, &dout, &dq, &dk, &dv, &dlog_beta});
  check_log_beta(op, log_beta);
  cpu::gated_attention_backward(q, k, v, log_beta, doc, scale, out, lse, dout, dq, dk, dv, dlog_beta);
}

void capacity_sums(const Tensor& log_beta, const Tensor& doc, Tensor& S) {
  const char* op = "capacity_sums";
  check_capacity_inputs(op, log_beta, doc);
  expect(op, "S", S, DType::F32, log_beta.shape(), "[L, T, K]");
  require_cpu(op, {&S});
  cpu::capacity_sums(log_beta, doc, S);
}

CapacityLoss capacity_loss(const Tensor& log_beta, const Tensor& doc, const Tensor& positions, double memory,
                           CapacityMode mode) {
  check_capacity_loss_inputs("capacity_loss", log_beta, doc, positions, memory);
  return cpu::capacity_loss(log_beta, doc, positions, memory, mode);
}

void capacity_loss_backward(const Tensor& log_beta, const Tensor& doc, const Tensor& positions, double memory,
                            CapacityMode mode, double scale, Tensor& dlog_beta) {
  const char* op = "capacity_loss_backward";
  check_capacity_loss_inputs(op, log_beta, doc, positions, memory);
  if (!std::isfinite(scale)) fail("{}: scale {} is not finite", op, scale);
  expect(op, "dlog_beta", dlog_beta, DType::F32, log_beta.shape(), "[L, T, K]");
  require_cpu(op, {&dlog_beta});
  cpu::capacity_loss_backward(log_beta, doc, positions, memory, mode, scale, dlog_beta);
}

}  // namespace retain::ops
