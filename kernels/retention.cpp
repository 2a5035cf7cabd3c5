// Shape/dtype/value checks and device dispatch for kernels/retention.h. Failures are one
// line naming the op, the argument and what was expected.
#include "kernels/retention.h"
#include "kernels/retention_spans.h"

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>

#include "kernels/cpu/retention_cpu.h"
#include "kernels/deferred_checks.h"
#include "kernels/require_cpu.h"
#ifdef RETAIN_CUDA_KERNELS
#include "kernels/cuda/retention_cuda.h"
#endif

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

// Positions t − i enter the scores as float32 and must be exact there.
void check_length(const char* op, int64_t T) {
  if (T >= (int64_t{1} << 24)) fail("{}: sequence length {} is not below 2^24", op, T);
}

// The multi-index "2, 0, 5" of flat element x of a tensor of this shape.
std::string index_str(const Shape& shape, int64_t x) {
  std::string index;
  for (int64_t a = static_cast<int64_t>(shape.size()) - 1, rest = x; a >= 0; --a) {
    const int64_t n = shape[static_cast<size_t>(a)];
    index = fmt::format("{}{}", rest % n, index.empty() ? "" : ", " + index);
    rest /= n;
  }
  return index;
}

std::string bad_log_beta(const char* op, const Shape& shape, int64_t x, float value) {
  return fmt::format("{}: log_beta[{}] = {} is not ≤ 0 (it must be a logsigmoid output)", op, index_str(shape, x),
                     value);
}
std::string bad_position(const char* op, int64_t t, int32_t value) {
  return fmt::format("{}: positions[{}] = {} is negative", op, t, value);
}

// logβ is a logsigmoid output, so ≤ 0 (−inf allowed): that keeps every exp((t − i)·logβ) ≤ 1
// in the capacity sums, and a NaN or positive value can only come from a bug upstream. On the
// CPU the check runs here; on CUDA it is a deferred device scan (kernels/deferred_checks.h)
// whose verdict the step reads once, with the same message.
void check_log_beta(const char* op, const Tensor& log_beta) {
  if (log_beta.device() == Device::CUDA) {
    ops::defer_value_check(log_beta.raw(), log_beta.numel(), ValueRule::at_most_zero_f32,
                           [op, shape = log_beta.shape()](int64_t x, uint32_t bits) {
                             float value = 0;
                             std::memcpy(&value, &bits, sizeof value);
                             return bad_log_beta(op, shape, x, value);
                           });
    return;
  }
  const float* lb = log_beta.data<float>();
  for (int64_t x = 0; x < log_beta.numel(); ++x)
    if (!(lb[x] <= 0.0f)) fail("{}", bad_log_beta(op, log_beta.shape(), x, lb[x]));
}

// Document positions are ≥ 0; deferred on CUDA like check_log_beta.
void check_positions(const char* op, const Tensor& positions) {
  if (positions.device() == Device::CUDA) {
    ops::defer_value_check(positions.raw(), positions.numel(), ValueRule::nonnegative_i32,
                           [op](int64_t t, uint32_t bits) { return bad_position(op, t, static_cast<int32_t>(bits)); });
    return;
  }
  const int32_t* p = positions.data<int32_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    if (p[t] < 0) fail("{}", bad_position(op, t, p[t]));
}

struct AttentionDims {
  int64_t T, H, K, d;
};

// The activations (q, k, v, out, dout, dq, dk, dv) are F32 on the CPU and BF16 on CUDA (the
// kernels' tensor-core inputs); log_beta, lse, dlog_beta stay F32 and doc I32 everywhere.
DType activation_dtype(const Tensor& q) { return q.device() == Device::CUDA ? DType::BF16 : DType::F32; }

AttentionDims check_attention_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& log_beta, const Tensor& doc, float scale) {
  const DType act = activation_dtype(q);
  if (q.device() == Device::CUDA && q.dtype() != act)
    fail("{}: q is a CUDA {} tensor; on CUDA q, k, v, out, dout, dq, dk, dv must be BF16", op, dtype_name(q.dtype()));
  expect_ndim(op, "q", q, act, 3, "[T, H, d]");
  const AttentionDims a{q.dim(0), q.dim(1), 0, q.dim(2)};
  expect_ndim(op, "k", k, act, 3, "[T, K, d]");
  const int64_t K = k.dim(1);
  if (K <= 0 || a.H % K != 0) fail("{}: {} query heads are not a multiple of {} KV heads", op, a.H, K);
  expect(op, "k", k, act, {a.T, K, a.d}, "[T, K, d]");
  expect(op, "v", v, act, {a.T, K, a.d}, "[T, K, d]");
  expect(op, "log_beta", log_beta, DType::F32, {a.T, K}, "[T, K]");
  expect(op, "doc", doc, DType::I32, {a.T}, "[T]");
  if (!std::isfinite(scale)) fail("{}: scale {} is not finite", op, scale);
  check_length(op, a.T);
  return {a.T, a.H, K, a.d};
}

// Every tensor of an attention call on q's device (CUDA: kernels/cuda/gated_attention.cu), and
// log_beta checked there.
void check_attention_device(const char* op, const Tensor& q, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->device() != q.device())
      fail("{}: all tensors must be on one device (q is on {}, another is on {})", op, device_name(q.device()),
           device_name(t->device()));
}

// Every tensor of a capacity call on log_beta's device: CUDA runs kernels/cuda/capacity.cu.
void require_device(const char* op, Device device, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->device() != device)
      fail("{}: all tensors must be on one device (log_beta is on {}, another is on {})", op, device_name(device),
           device_name(t->device()));
}

#ifdef RETAIN_CUDA_KERNELS
bool on_cuda(const Tensor& log_beta) { return log_beta.device() == Device::CUDA; }
#endif

void check_capacity_inputs(const char* op, const Tensor& log_beta, const Tensor& doc, double skip_exponent) {
  if (!(skip_exponent > 0)) fail("{}: skip exponent {} is not > 0", op, skip_exponent);
  expect_ndim(op, "log_beta", log_beta, DType::F32, 3, "[L, T, K]");
  expect(op, "doc", doc, DType::I32, {log_beta.dim(1)}, "[T]");
  check_length(op, log_beta.dim(1));
  require_device(op, log_beta.device(), {&doc});
#ifndef RETAIN_CUDA_KERNELS
  require_cpu(op, {&log_beta});
#endif
  check_log_beta(op, log_beta);
}

void check_capacity_loss_inputs(const char* op, const Tensor& log_beta, const Tensor& doc, const Tensor& positions,
                                double memory, double skip_exponent) {
  check_capacity_inputs(op, log_beta, doc, skip_exponent);
  expect(op, "positions", positions, DType::I32, {log_beta.dim(1)}, "[T]");
  require_device(op, log_beta.device(), {&positions});
  check_positions(op, positions);
  if (!std::isfinite(memory) || memory < 0) fail("{}: memory M = {} is not a finite number ≥ 0", op, memory);
}

}  // namespace

std::string cuda_attention_kernels(bool backward) {
#ifdef RETAIN_CUDA_KERNELS
  return cuda::attention_kernels(backward);
#else
  fail("{}: this build of retain has no CUDA support", backward ? "gated_attention_backward" : "gated_attention");
#endif
}

void gated_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& log_beta, const Tensor& doc,
                     float scale, Tensor& out, Tensor& lse) {
  const char* op = "gated_attention";
  const AttentionDims a = check_attention_inputs(op, q, k, v, log_beta, doc, scale);
  expect(op, "out", out, activation_dtype(q), q.shape(), "[T, H, d]");
  expect(op, "lse", lse, DType::F32, {a.T, a.H}, "[T, H]");
  check_attention_device(op, q, {&k, &v, &log_beta, &doc, &out, &lse});
  if (q.device() == Device::CUDA) {
#ifdef RETAIN_CUDA_KERNELS
    check_log_beta(op, log_beta);
    return cuda::gated_attention(q, k, v, log_beta, doc, scale, out, lse);
#else
    fail("{}: this build of retain has no CUDA support", op);
#endif
  }
  check_log_beta(op, log_beta);
  cpu::gated_attention(q, k, v, log_beta, doc, scale, out, lse);
}

void gated_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& log_beta,
                              const Tensor& doc, float scale, const Tensor& out, const Tensor& lse,
                              const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dlog_beta) {
  const char* op = "gated_attention_backward";
  const AttentionDims a = check_attention_inputs(op, q, k, v, log_beta, doc, scale);
  const DType act = activation_dtype(q);
  expect(op, "out", out, act, q.shape(), "[T, H, d]");
  expect(op, "lse", lse, DType::F32, {a.T, a.H}, "[T, H]");
  expect(op, "dout", dout, act, q.shape(), "[T, H, d]");
  expect(op, "dq", dq, act, q.shape(), "[T, H, d]");
  expect(op, "dk", dk, act, k.shape(), "[T, K, d]");
  expect(op, "dv", dv, act, k.shape(), "[T, K, d]");
  expect(op, "dlog_beta", dlog_beta, DType::F32, {a.T, a.K}, "[T, K]");
  check_attention_device(op, q, {&k, &v, &log_beta, &doc, &out, &lse, &dout, &dq, &dk, &dv, &dlog_beta});
  if (q.device() == Device::CUDA) {
#ifdef RETAIN_CUDA_KERNELS
    check_log_beta(op, log_beta);
    return cuda::gated_attention_backward(q, k, v, log_beta, doc, scale, out, lse, dout, dq, dk, dv, dlog_beta);
#else
    fail("{}: this build of retain has no CUDA support", op);
#endif
  }
  check_log_beta(op, log_beta);
  cpu::gated_attention_backward(q, k, v, log_beta, doc, scale, out, lse, dout, dq, dk, dv, dlog_beta);
}

void capacity_sums(const Tensor& log_beta, const Tensor& doc, Tensor& S, double skip_exponent) {
  const char* op = "capacity_sums";
  check_capacity_inputs(op, log_beta, doc, skip_exponent);
  expect(op, "S", S, DType::F32, log_beta.shape(), "[L, T, K]");
  require_device(op, log_beta.device(), {&S});
#ifdef RETAIN_CUDA_KERNELS
  if (on_cuda(log_beta)) return cuda::capacity_sums(log_beta, doc, S, skip_exponent);
#endif
  cpu::capacity_sums(log_beta, doc, S, skip_exponent);
}

CapacityLoss capacity_loss(const Tensor& log_beta, const Tensor& doc, const Tensor& positions, double memory,
                           CapacityMode mode, double skip_exponent) {
  check_capacity_loss_inputs("capacity_loss", log_beta, doc, positions, memory, skip_exponent);
#ifdef RETAIN_CUDA_KERNELS
  if (on_cuda(log_beta)) return cuda::capacity_loss(log_beta, doc, positions, memory, mode, skip_exponent);
#endif
  return cpu::capacity_loss(log_beta, doc, positions, memory, mode, skip_exponent);
}

void capacity_loss_backward(const Tensor& log_beta, const Tensor& doc, const Tensor& positions, double memory,
                            CapacityMode mode, double scale, Tensor& dlog_beta, double skip_exponent) {
  const char* op = "capacity_loss_backward";
  check_capacity_loss_inputs(op, log_beta, doc, positions, memory, skip_exponent);
  if (!std::isfinite(scale)) fail("{}: scale {} is not finite", op, scale);
  expect(op, "dlog_beta", dlog_beta, DType::F32, log_beta.shape(), "[L, T, K]");
  require_device(op, log_beta.device(), {&dlog_beta});
#ifdef RETAIN_CUDA_KERNELS
  if (on_cuda(log_beta))
    return cuda::capacity_loss_backward(log_beta, doc, positions, memory, mode, scale, dlog_beta, skip_exponent);
#endif
  cpu::capacity_loss_backward(log_beta, doc, positions, memory, mode, scale, dlog_beta, skip_exponent);
}

// ---- Spans of a longer sequence (kernels/retention_spans.h) ----

namespace {

void check_span(const char* op, const char* what, int64_t start, int64_t n) {
  if (start < 0) fail("{}: {} {} is negative", op, what, start);
  if (start + n >= (int64_t{1} << 24)) fail("{}: {} + length = {} is not below 2^24", op, what, start + n);
}

// q, k, v, log_beta, the docs as a span pair: [Tq, H, d], [Tk, K, d], [Tk, K], [Tq], [Tk] (q, k,
// v F32 on the CPU, BF16 on CUDA; I32 docs), all on q's device.
AttentionDims check_span_attention(const char* op, const Tensor& q, const Tensor& q_doc, int64_t q_start,
                                   const Tensor& k, const Tensor& v, const Tensor& log_beta, const Tensor& k_doc,
                                   int64_t k_start, float scale) {
#ifndef RETAIN_CUDA_KERNELS
  require_cpu(op, {&q});
#endif
  check_attention_device(op, q, {&q_doc, &k, &v, &log_beta, &k_doc});
  const DType act = activation_dtype(q);
  if (q.device() == Device::CUDA && q.dtype() != act)
    fail("{}: q is a CUDA {} tensor; on CUDA q, k, v, dout must be BF16 (out, lse and the gradients F32)", op,
         dtype_name(q.dtype()));
  expect_ndim(op, "q", q, act, 3, "[Tq, H, d]");
  expect_ndim(op, "k", k, act, 3, "[Tk, K, d]");
  const int64_t Tq = q.dim(0), H = q.dim(1), d = q.dim(2), Tk = k.dim(0), K = k.dim(1);
  if (K <= 0 || H % K != 0) fail("{}: {} query heads are not a multiple of {} KV heads", op, H, K);
  expect(op, "k", k, act, {Tk, K, d}, "[Tk, K, d]");
  expect(op, "v", v, act, {Tk, K, d}, "[Tk, K, d]");
  expect(op, "log_beta", log_beta, DType::F32, {Tk, K}, "[Tk, K]");
  expect(op, "q_doc", q_doc, DType::I32, {Tq}, "[Tq]");
  expect(op, "k_doc", k_doc, DType::I32, {Tk}, "[Tk]");
  if (!std::isfinite(scale)) fail("{}: scale {} is not finite", op, scale);
  check_span(op, "q_start", q_start, Tq);
  check_span(op, "k_start", k_start, Tk);
  check_log_beta(op, log_beta);
  return {Tq, H, K, d};
}

void check_capacity_span(const char* op, const Tensor& log_beta, const Tensor& k_doc, int64_t k_start,
                         const Tensor& q_doc, int64_t q_start, const Tensor& rows, const char* rows_name,
                         double skip_exponent) {
  require_device(op, log_beta.device(), {&k_doc, &q_doc, &rows});
#ifndef RETAIN_CUDA_KERNELS
  require_cpu(op, {&log_beta});
#endif
  if (!(skip_exponent > 0)) fail("{}: skip exponent {} is not > 0", op, skip_exponent);
  expect_ndim(op, "log_beta", log_beta, DType::F32, 3, "[L, Tk, K]");
  const int64_t L = log_beta.dim(0), Tk = log_beta.dim(1), K = log_beta.dim(2);
  expect(op, "k_doc", k_doc, DType::I32, {Tk}, "[Tk]");
  expect_ndim(op, "q_doc", q_doc, DType::I32, 1, "[Tq]");
  expect(op, rows_name, rows, DType::F64, {L, q_doc.dim(0), K}, "[L, Tq, K]");
  check_span(op, "q_start", q_start, q_doc.dim(0));
  check_span(op, "k_start", k_start, Tk);
  check_log_beta(op, log_beta);
}

}  // namespace

void gated_attention_span(const Tensor& q, const Tensor& q_doc, int64_t q_start, const Tensor& k, const Tensor& v,
                          const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, float scale, Tensor& out,
                          Tensor& lse) {
  const char* op = "gated_attention_span";
  const AttentionDims a = check_span_attention(op, q, q_doc, q_start, k, v, log_beta, k_doc, k_start, scale);
  check_attention_device(op, q, {&out, &lse});
  expect(op, "out", out, DType::F32, q.shape(), "[Tq, H, d]");
  expect(op, "lse", lse, DType::F32, {a.T, a.H}, "[Tq, H]");
#ifdef RETAIN_CUDA_KERNELS
  if (q.device() == Device::CUDA)
    return cuda::gated_attention_span(q, q_doc, q_start, k, v, log_beta, k_doc, k_start, scale, out, lse);
#endif
  cpu::gated_attention_span(q, q_doc, q_start, k, v, log_beta, k_doc, k_start, scale, out, lse);
}

void merge_attention(Tensor& out, Tensor& lse, const Tensor& part_out, const Tensor& part_lse) {
  const char* op = "merge_attention";
#ifndef RETAIN_CUDA_KERNELS
  require_cpu(op, {&out});
#endif
  check_attention_device(op, out, {&lse, &part_out, &part_lse});
  expect_ndim(op, "out", out, DType::F32, 3, "[R, H, d]");
  expect(op, "lse", lse, DType::F32, {out.dim(0), out.dim(1)}, "[R, H]");
  expect(op, "part_out", part_out, DType::F32, out.shape(), "[R, H, d]");
  expect(op, "part_lse", part_lse, DType::F32, lse.shape(), "[R, H]");
#ifdef RETAIN_CUDA_KERNELS
  if (out.device() == Device::CUDA) return cuda::merge_attention(out, lse, part_out, part_lse);
#endif
  cpu::merge_attention(out, lse, part_out, part_lse);
}

void gated_attention_span_backward(const Tensor& q, const Tensor& q_doc, int64_t q_start, const Tensor& k,
                                   const Tensor& v, const Tensor& log_beta, const Tensor& k_doc, int64_t k_start,
                                   float scale, const Tensor& out, const Tensor& lse, const Tensor& dout, Tensor& dq,
                                   Tensor& dk, Tensor& dv, Tensor& dlog_beta) {
  const char* op = "gated_attention_span_backward";
  const AttentionDims a = check_span_attention(op, q, q_doc, q_start, k, v, log_beta, k_doc, k_start, scale);
  check_attention_device(op, q, {&out, &lse, &dout, &dq, &dk, &dv, &dlog_beta});
  expect(op, "out", out, DType::F32, q.shape(), "[Tq, H, d]");
  expect(op, "lse", lse, DType::F32, {a.T, a.H}, "[Tq, H]");
  expect(op, "dout", dout, activation_dtype(q), q.shape(), "[Tq, H, d]");
  expect(op, "dq", dq, DType::F32, q.shape(), "[Tq, H, d]");
  expect(op, "dk", dk, DType::F32, k.shape(), "[Tk, K, d]");
  expect(op, "dv", dv, DType::F32, k.shape(), "[Tk, K, d]");
  expect(op, "dlog_beta", dlog_beta, DType::F32, log_beta.shape(), "[Tk, K]");
#ifdef RETAIN_CUDA_KERNELS
  if (q.device() == Device::CUDA)
    return cuda::gated_attention_span_backward(q, q_doc, q_start, k, v, log_beta, k_doc, k_start, scale, out, lse,
                                               dout, dq, dk, dv, dlog_beta);
#endif
  cpu::gated_attention_span_backward(q, q_doc, q_start, k, v, log_beta, k_doc, k_start, scale, out, lse, dout, dq,
                                     dk, dv, dlog_beta);
}

void capacity_sums_span(const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, const Tensor& q_doc,
                        int64_t q_start, Tensor& S, double skip_exponent) {
  check_capacity_span("capacity_sums_span", log_beta, k_doc, k_start, q_doc, q_start, S, "S", skip_exponent);
#ifdef RETAIN_CUDA_KERNELS
  if (on_cuda(log_beta)) return cuda::capacity_sums_span(log_beta, k_doc, k_start, q_doc, q_start, S, skip_exponent);
#endif
  cpu::capacity_sums_span(log_beta, k_doc, k_start, q_doc, q_start, S, skip_exponent);
}

CapacityLoss capacity_hinge(const Tensor& S, const Tensor& doc, const Tensor& positions, double memory,
                            CapacityMode mode, Tensor* g) {
  const char* op = "capacity_hinge";
#ifndef RETAIN_CUDA_KERNELS
  require_cpu(op, {&S});
#endif
  require_device(op, S.device(), {&doc, &positions});
  expect_ndim(op, "S", S, DType::F64, 3, "[L, T, K]");
  expect(op, "doc", doc, DType::I32, {S.dim(1)}, "[T]");
  expect(op, "positions", positions, DType::I32, {S.dim(1)}, "[T]");
  if (g) {
    require_device(op, S.device(), {g});
    expect(op, "g", *g, DType::F64, S.shape(), "[L, T, K]");
  }
  check_positions(op, positions);
  if (!std::isfinite(memory) || memory < 0) fail("{}: memory M = {} is not a finite number ≥ 0", op, memory);
#ifdef RETAIN_CUDA_KERNELS
  if (S.device() == Device::CUDA) return cuda::capacity_hinge(S, doc, positions, memory, mode, g);
#endif
  return cpu::capacity_hinge(S, doc, positions, memory, mode, g);
}

void capacity_grad_span(const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, const Tensor& q_doc,
                        int64_t q_start, const Tensor& g, Tensor& dlog_beta, double skip_exponent) {
  const char* op = "capacity_grad_span";
  check_capacity_span(op, log_beta, k_doc, k_start, q_doc, q_start, g, "g", skip_exponent);
  require_device(op, log_beta.device(), {&dlog_beta});
  expect(op, "dlog_beta", dlog_beta, DType::F64, log_beta.shape(), "[L, Tk, K]");
#ifdef RETAIN_CUDA_KERNELS
  if (on_cuda(log_beta))
    return cuda::capacity_grad_span(log_beta, k_doc, k_start, q_doc, q_start, g, dlog_beta, skip_exponent);
#endif
  cpu::capacity_grad_span(log_beta, k_doc, k_start, q_doc, q_start, g, dlog_beta, skip_exponent);
}

}  // namespace retain::ops
