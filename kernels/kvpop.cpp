// Shape/dtype checks and device dispatch for kernels/kvpop.h. Failures are one line naming the
// op, the argument and what was expected. future_attention_target and mlstm_scores[_backward]
// run CUDA tensors on the kernels of kernels/cuda/kvpop.cu (CUDA builds), and so do the target's
// spans (future_attention_start / _sums / _finish); the other ops are CPU-only so far.
#include "kernels/kvpop.h"

#include <cmath>
#include <initializer_list>
#include <tuple>
#include <unordered_set>

#include <fmt/format.h>

#include "kernels/cpu/kvpop_cpu.h"
#include "kernels/require_cpu.h"
#ifdef RETAIN_CUDA_KERNELS
#include "kernels/cuda/kvpop_cuda.h"
#endif

namespace retain::kvpop {

namespace {

void expect(const char* op, const char* what, const Tensor& t, const Shape& shape, DType dtype = DType::F32) {
  if (!t.defined() || t.dtype() != dtype || t.shape() != shape)
    fail("{}: {} must be {} {}, got {} {}", op, what, dtype_name(dtype), shape_str(shape), dtype_name(t.dtype()),
         shape_str(t.shape()));
}

// doc I32 [T]; every document id forms one contiguous run (the recurrent state and the
// target's same-document ranges assume it). A CUDA doc is checked on a host copy (T int32).
const int32_t* check_doc(const char* op, const Tensor& doc, int64_t T) {
  expect(op, "doc", doc, {T}, DType::I32);
  if (doc.device() != Device::CPU) {
    check_doc(op, doc.to(Device::CPU), T);
    return nullptr;
  }
  const int32_t* p = doc.data<int32_t>();
  std::unordered_set<int32_t> finished;
  for (int64_t t = 0; t < T; ++t) {
    if (p[t] < 0 || (t > 0 && p[t] == p[t - 1])) continue;
    if (!finished.insert(p[t]).second) fail("{}: document {} reappears at token {} (documents must be contiguous runs)", op, p[t], t);
  }
  return p;
}

// Every tensor of a call on `device` (its leading tensor's): ops with CUDA kernels run
// where their inputs are, never with a silent copy.
void require_device(const char* op, Device device, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->device() != device)
      fail("{}: all tensors must be on one device (one is on {}, another on {})", op, device_name(device),
           device_name(t->device()));
}

// The CUDA branch of an op that has kernels: in builds without them a CUDA tensor cannot exist,
// but the error stays explicit.
[[noreturn, maybe_unused]] void no_cuda_kernels(const char* op) {
  fail("{}: this build of retain has no CUDA kernels", op);
}

void check_window(const char* op, int64_t w) {
  if (w < 1) fail("{}: window w = {} must be ≥ 1", op, w);
}

// The HeadParams shapes for 2d = n input features and r = n / 4.
int64_t check_params(const char* op, const HeadParams& p, int64_t n) {
  if (n % 4 != 0) fail("{}: x has {} features, not 2·d with d even", op, n);
  const int64_t r = n / 4;
  expect(op, "W_q", p.W_q, {r, n});
  expect(op, "W_k", p.W_k, {r, n});
  expect(op, "W_v", p.W_v, {r, n});
  expect(op, "w_i", p.w_i, {n});
  expect(op, "w_f", p.w_f, {n});
  expect(op, "b_i", p.b_i, {1});
  expect(op, "b_f", p.b_f, {1});
  ops::require_cpu(op, {&p.W_q, &p.W_k, &p.W_v, &p.w_i, &p.w_f, &p.b_i, &p.b_f});
  return r;
}

// Projected of T tokens with d = 2r; `optional` lets undefined fields through (zero gradient).
// Devices are the caller's to check.
void check_projected(const char* op, const Projected& P, int64_t T, int64_t r, bool optional) {
  const int64_t d = 2 * r;
  for (auto [t, name, shape] : {std::tuple{&P.q, "q", Shape{T, d}}, std::tuple{&P.k, "k", Shape{T, d}},
                                std::tuple{&P.v, "v", Shape{T, r}}, std::tuple{&P.igate, "igate", Shape{T}},
                                std::tuple{&P.log_f, "log_f", Shape{T}}}) {
    if (optional && t->numel() == 0 && t->shape().empty()) continue;
    expect(op, name, *t, shape);
  }
}

}  // namespace

bool has_score(const int32_t* doc, int64_t T, int64_t w, int64_t u) {
  const int64_t t = u + w - 1;
  if (u < 0 || t >= T || doc[u] < 0) return false;
  for (int64_t x = u + 1; x <= t; ++x)
    if (doc[x] != doc[u]) return false;
  return true;
}

std::string decay_problem(const Decay& d) {
  if (d.every < 1) return fmt::format("decay every = {} must be ≥ 1", d.every);
  if (!std::isfinite(d.gamma_min) || !std::isfinite(d.gamma_max) || !(d.gamma_min > 0) ||
      !(d.gamma_min <= d.gamma_max) || !(d.gamma_max <= 1))
    return fmt::format("decay range [{}, {}] must satisfy 0 < min ≤ max ≤ 1", d.gamma_min, d.gamma_max);
  return {};
}

namespace {
double sigmoid(double x) { return x >= 0 ? 1 / (1 + std::exp(-x)) : std::exp(x) / (1 + std::exp(x)); }
}  // namespace

double log_gamma(double theta, const Decay& d) {
  const double A = std::log(d.gamma_min), B = std::log(d.gamma_max);
  return A + (B - A) / (1 + std::exp(-theta));
}

double log_gamma_derivative(double theta, const Decay& d) {
  const double A = std::log(d.gamma_min), B = std::log(d.gamma_max), sg = sigmoid(theta);
  return (B - A) * sg * (1 - sg);
}

Projected project(const Tensor& x, const HeadParams& p) {
  const char* op = "kvpop::project";
  if (x.ndim() != 2 || x.dtype() != DType::F32) fail("{}: x must be F32 [T, 2d], got {} {}", op, dtype_name(x.dtype()), shape_str(x.shape()));
  ops::require_cpu(op, {&x});
  check_params(op, p, x.dim(1));
  return cpu::kvpop::project(x, p);
}

void project_backward(const Tensor& x, const HeadParams& p, const Projected& dP, HeadParams& g) {
  const char* op = "kvpop::project_backward";
  if (x.ndim() != 2 || x.dtype() != DType::F32) fail("{}: x must be F32 [T, 2d], got {} {}", op, dtype_name(x.dtype()), shape_str(x.shape()));
  ops::require_cpu(op, {&x});
  const int64_t r = check_params(op, p, x.dim(1));
  check_projected(op, dP, x.dim(0), r, true);
  ops::require_cpu(op, {&dP.q, &dP.k, &dP.v, &dP.igate, &dP.log_f});
  cpu::kvpop::project_backward(x, p, dP, g);
}

namespace {
// Shapes, devices (every tensor on P.v's), window and documents of an mLSTM call; returns T.
int64_t check_mlstm(const char* op, const Projected& P, const Tensor& doc, int64_t w, const Tensor& w_o,
                    const Tensor& b_o) {
  if (P.v.ndim() != 2) fail("{}: v must be F32 [T, r], got {}", op, shape_str(P.v.shape()));
  const int64_t T = P.v.dim(0), r = P.v.dim(1);
  check_projected(op, P, T, r, false);
  expect(op, "w_o", w_o, {r});
  expect(op, "b_o", b_o, {1});
  require_device(op, P.v.device(), {&P.q, &P.k, &P.igate, &P.log_f, &doc, &w_o, &b_o});
  check_window(op, w);
  check_doc(op, doc, T);
  return T;
}
}  // namespace

Tensor mlstm_scores(const Projected& P, const Tensor& doc, int64_t w, const Tensor& w_o, const Tensor& b_o) {
  const char* op = "kvpop::mlstm_scores";
  check_mlstm(op, P, doc, w, w_o, b_o);
  if (P.v.device() == Device::CUDA) {
#ifdef RETAIN_CUDA_KERNELS
    return cuda::kvpop_mlstm_scores(P, doc, w, w_o, b_o);
#else
    no_cuda_kernels(op);
#endif
  }
  return cpu::kvpop::mlstm_scores(P, doc.data<int32_t>(), w, w_o, b_o.data<float>()[0]);
}

Projected mlstm_scores_backward(const Projected& P, const Tensor& doc, int64_t w, const Tensor& w_o,
                                const Tensor& b_o, const Tensor& dscore, Tensor& dw_o, Tensor& db_o) {
  const char* op = "kvpop::mlstm_scores_backward";
  const int64_t T = check_mlstm(op, P, doc, w, w_o, b_o);
  expect(op, "dscore", dscore, {T});
  require_device(op, P.v.device(), {&dscore});
  if (P.v.device() == Device::CUDA) {
#ifdef RETAIN_CUDA_KERNELS
    return cuda::kvpop_mlstm_scores_backward(P, doc, w, w_o, dscore, dw_o, db_o);
#else
    no_cuda_kernels(op);
#endif
  }
  return cpu::kvpop::mlstm_scores_backward(P, doc.data<int32_t>(), w, w_o, b_o.data<float>()[0], dscore, dw_o, db_o);
}

Tensor future_attention_target(const Tensor& q, const Tensor& k, const Tensor& lse, const Tensor& doc,
                               int64_t w, float scale) {
  const char* op = "kvpop::future_attention_target";
  if (q.ndim() != 3 || k.ndim() != 3 || q.dtype() != DType::F32 || k.dtype() != DType::F32)
    fail("{}: q must be F32 [T, H, hd] and k F32 [T, K, hd], got {} {} and {} {}", op, dtype_name(q.dtype()),
         shape_str(q.shape()), dtype_name(k.dtype()), shape_str(k.shape()));
  const int64_t T = q.dim(0), H = q.dim(1), hd = q.dim(2), K = k.dim(1);
  if (K < 1 || H % K != 0) fail("{}: {} query heads are not a multiple of {} KV heads", op, H, K);
  expect(op, "k", k, {T, K, hd});
  expect(op, "lse", lse, {T, H});
  require_device(op, q.device(), {&k, &lse, &doc});
  check_window(op, w);
  const int32_t* dp = check_doc(op, doc, T);
  if (q.device() == Device::CUDA) {
#ifdef RETAIN_CUDA_KERNELS
    return cuda::kvpop_future_attention_target(q, k, lse, doc, w, scale);
#else
    no_cuda_kernels(op);
#endif
  }
  return cpu::kvpop::future_attention_target(q, k, lse, dp, w, scale);
}

std::pair<Tensor, Tensor> future_attention_start(int64_t T_k, int64_t H, Device device) {
  if (T_k < 0 || H < 1) fail("kvpop::future_attention_start: {} keys, {} heads", T_k, H);
  std::pair<Tensor, Tensor> acc = cpu::kvpop::future_attention_start(T_k, H);
  if (device != Device::CPU) acc = {acc.first.to(device), acc.second.to(device)};  // (O(T_k·H) once per span)
  return acc;
}

void future_attention_sums(const Tensor& q, const Tensor& lse, const Tensor& q_doc, int64_t q_start, const Tensor& k,
                           const Tensor& k_doc, int64_t k_start, int64_t w, float scale, Tensor& mx, Tensor& sum) {
  const char* op = "kvpop::future_attention_sums";
  if (q.ndim() != 3 || k.ndim() != 3 || q.dtype() != DType::F32 || k.dtype() != DType::F32)
    fail("{}: q must be F32 [T_q, H, hd] and k F32 [T_k, K, hd], got {} {} and {} {}", op, dtype_name(q.dtype()),
         shape_str(q.shape()), dtype_name(k.dtype()), shape_str(k.shape()));
  const int64_t Tq = q.dim(0), H = q.dim(1), hd = q.dim(2), Tk = k.dim(0), K = k.dim(1);
  if (K < 1 || H % K != 0) fail("{}: {} query heads are not a multiple of {} KV heads", op, H, K);
  expect(op, "k", k, {Tk, K, hd});
  expect(op, "lse", lse, {Tq, H});
  expect(op, "mx", mx, {Tk, H}, DType::F64);
  expect(op, "sum", sum, {Tk, H}, DType::F64);
  if (q_start < 0 || k_start < 0) fail("{}: spans start at tokens {} (queries) and {} (keys)", op, q_start, k_start);
  require_device(op, q.device(), {&lse, &q_doc, &k, &k_doc, &mx, &sum});
  check_window(op, w);
  if (q.device() == Device::CUDA) {
#ifdef RETAIN_CUDA_KERNELS
    // (the documents' layout is checked where the whole sequence is: the teacher pass's caller)
    expect(op, "q_doc", q_doc, {Tq}, DType::I32);
    expect(op, "k_doc", k_doc, {Tk}, DType::I32);
    return cuda::kvpop_future_attention_sums(q, lse, q_doc, q_start, k, k_doc, k_start, w, scale, mx, sum);
#else
    no_cuda_kernels(op);
#endif
  }
  const int32_t* qd = check_doc(op, q_doc, Tq);
  const int32_t* kd = check_doc(op, k_doc, Tk);
  if (Tq == 0 || Tk == 0) return;
  cpu::kvpop::future_attention_sums(q, lse, qd, q_start, k, kd, k_start, w, scale, mx, sum);
}

Tensor future_attention_finish(const Tensor& mx, const Tensor& sum, int64_t K) {
  const char* op = "kvpop::future_attention_finish";
  if (mx.ndim() != 2 || K < 1 || mx.dim(1) % K != 0)
    fail("{}: mx must be F64 [T_k, H] with H a multiple of {} KV heads, got {}", op, K, shape_str(mx.shape()));
  expect(op, "mx", mx, mx.shape(), DType::F64);
  expect(op, "sum", sum, mx.shape(), DType::F64);
  require_device(op, mx.device(), {&sum});
  if (mx.device() == Device::CUDA) {
#ifdef RETAIN_CUDA_KERNELS
    return cuda::kvpop_future_attention_finish(mx, sum, K);
#else
    no_cuda_kernels(op);
#endif
  }
  return cpu::kvpop::future_attention_finish(mx, sum, K);
}

std::vector<Decision> select_decisions(const Tensor& log_m, const Tensor& doc, int64_t w, int64_t sinks,
                                       int64_t k, const TargetRule& rule) {
  const char* op = "kvpop::select_decisions";
  if (log_m.ndim() != 1) fail("{}: log_m must be F32 [T], got {}", op, shape_str(log_m.shape()));
  const int64_t T = log_m.dim(0);
  expect(op, "log_m", log_m, {T});
  ops::require_cpu(op, {&log_m, &doc});
  check_window(op, w);
  if (sinks < 0 || k < 1) fail("{}: sinks = {} must be ≥ 0 and k = {} ≥ 1", op, sinks, k);
  const int32_t* dp = check_doc(op, doc, T);
  const float* lm = log_m.data<float>();
  // Every candidate key (position ≥ sinks, not in the last w of its run) has a target; a NaN
  // or −inf there means log_m is not future_attention_target's output for this doc and w.
  for (int64_t t = 0; t < T; ++t)
    if (dp[t] >= 0 && t + w < T && dp[t + w] == dp[t] && !std::isfinite(lm[t]))
      fail("{}: log_m[{}] = {} is not finite although token {} has a target", op, t, lm[t], t);
  if (rule.effective && (rule.every < 1 || !std::isfinite(rule.log_gamma) || rule.log_gamma > 0))
    fail("{}: effective targets need every ≥ 1 and a finite log γ ≤ 0, got {} and {}", op, rule.every, rule.log_gamma);
  return cpu::kvpop::select_decisions(lm, dp, T, w, sinks, k, rule);
}

namespace {
void check_loss(const char* op, const Tensor& score, const Tensor& theta, const std::vector<Decision>& decisions,
                double margin_scale, double tau, const Decay& decay) {
  if (const std::string problem = decay_problem(decay); !problem.empty()) fail("{}: {}", op, problem);
  if (score.ndim() != 1) fail("{}: score must be F32 [T], got {}", op, shape_str(score.shape()));
  expect(op, "score", score, {score.dim(0)});
  expect(op, "theta", theta, {1});
  ops::require_cpu(op, {&score, &theta});
  if (!(tau > 0) || !(margin_scale >= 0)) fail("{}: tau = {} must be > 0 and margin_scale = {} ≥ 0", op, tau, margin_scale);
  for (const Decision& dc : decisions)
    if (dc.b < 0 || dc.t_new < 0 || dc.b >= score.dim(0) || dc.t_new >= score.dim(0))
      fail("{}: decision (q {}, t_new {}, b {}) is outside the {} scores", op, dc.q, dc.t_new, dc.b, score.dim(0));
}
}  // namespace

double pair_loss(const Tensor& score, const Tensor& theta, const std::vector<Decision>& decisions,
                 double margin_scale, double tau, const Decay& decay) {
  check_loss("kvpop::pair_loss", score, theta, decisions, margin_scale, tau, decay);
  return cpu::kvpop::pair_loss(score.data<float>(), theta.data<float>()[0], decisions, margin_scale, tau, decay);
}

void pair_loss_backward(const Tensor& score, const Tensor& theta, const std::vector<Decision>& decisions,
                        double margin_scale, double tau, double grad_scale, Tensor& dscore, Tensor& dtheta,
                        const Decay& decay) {
  check_loss("kvpop::pair_loss_backward", score, theta, decisions, margin_scale, tau, decay);
  dscore = Tensor::empty({score.dim(0)}, DType::F32);
  double dt = 0;
  cpu::kvpop::pair_loss_backward(score.data<float>(), theta.data<float>()[0], decisions, margin_scale, tau,
                                 grad_scale, score.dim(0), dscore.data<float>(), dt, decay);
  dtheta = Tensor::from_vector<float>({static_cast<float>(dt)}, {1});
}

}  // namespace retain::kvpop
