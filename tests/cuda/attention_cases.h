// Inputs and comparisons shared by the CUDA attention tests (test_gated_attention_cuda.cpp,
// test_attention_span_cuda.cpp): packed document layouts, logβ over its whole range, BF16
// device copies beside their F32 host values, NaN-poisoned outputs, relative errors that fail
// on an unwritten (non-finite) element, the CPU reference passes, the backward's rounding
// floors, and an environment variable set for a scope (the kernels' RETAIN_ATTENTION_*).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cuda/memory.h"
#include "kernels/retention.h"
#include "kernels/tensor.h"

namespace retain::attention_cases {

enum class Docs { one, contiguous, interleaved };

inline std::vector<int32_t> make_docs(int64_t T, Docs kind, std::mt19937& rng) {
  std::vector<int32_t> doc;
  if (kind == Docs::one) return std::vector<int32_t>(static_cast<size_t>(T), 0);
  if (kind == Docs::interleaved) {
    std::uniform_int_distribution<int32_t> id(-1, 2);
    for (int64_t t = 0; t < T; ++t) doc.push_back(id(rng));
    return doc;
  }
  std::uniform_int_distribution<int64_t> len(1, std::max<int64_t>(1, T / 3));
  std::bernoulli_distribution pad(0.2);
  int32_t id = 0;
  while (static_cast<int64_t>(doc.size()) < T) {
    const int32_t value = pad(rng) ? -1 : id++;
    for (int64_t n = len(rng); n > 0 && static_cast<int64_t>(doc.size()) < T; --n) doc.push_back(value);
  }
  return doc;
}

// logβ over its whole range: 5% −inf (β = 0), 10% −30 (a key seen only by its own query),
// 35% in [−2, 0] (short range), 50% in [−1e-3, 0] (long range: many tiles per row), or ≡ 0.
inline std::vector<float> make_log_beta(int64_t n, bool zero, std::mt19937& rng) {
  std::vector<float> lb(static_cast<size_t>(n), 0.0f);
  if (zero) return lb;
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (float& x : lb) {
    const float r = u(rng);
    x = r < 0.05f ? -INFINITY : r < 0.15f ? -30.0f : r < 0.5f ? -2.0f * u(rng) : -1e-3f * u(rng);
  }
  return lb;
}

inline std::vector<float> randn(int64_t n, float std, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, std);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

// A BF16 copy on the device and the same (bf16-rounded) values as F32 on the host.
struct Pair {
  Tensor host;    // F32, CPU
  Tensor device;  // BF16, CUDA
};
inline Pair bf16_pair(const std::vector<float>& v, const Shape& shape) {
  const Tensor bf = Tensor::from_vector<float>(v, shape).to_dtype(DType::BF16);
  return {bf.to_dtype(DType::F32), bf.to(Device::CUDA)};
}

// A device tensor filled with NaN (all-ones bytes are NaN in both F32 and BF16).
inline Tensor poisoned(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::CUDA);
  cuda::memset_device(t.raw(), 0xff, t.nbytes());
  return t;
}

inline std::vector<double> host_values(const Tensor& t) {
  const Tensor f = t.to(Device::CPU).to_dtype(DType::F32);
  const float* p = f.data<float>();
  return std::vector<double>(p, p + f.numel());
}

// ‖got − want‖ after checking that every value is finite (a NaN left by the poison means an
// unwritten element).
inline double distance(const std::vector<double>& got, const std::vector<double>& want, const char* what) {
  EXPECT_EQ(got.size(), want.size()) << what;
  double num = 0;
  for (size_t x = 0; x < want.size(); ++x) {
    if (!std::isfinite(got[x])) {
      ADD_FAILURE() << what << "[" << x << "] = " << got[x] << " (unwritten or overflowed)";
      return INFINITY;
    }
    num += (got[x] - want[x]) * (got[x] - want[x]);
  }
  return std::sqrt(num);
}

inline double norm(const std::vector<double>& x) {
  double s = 0;
  for (double e : x) s += e * e;
  return std::sqrt(s);
}

// ‖got − want‖ / ‖want‖ (or ‖got‖ when want is all zeros).
inline double rel_err(const std::vector<double>& got, const std::vector<double>& want, const char* what) {
  const double d = distance(got, want, what), n = norm(want);
  return n == 0 ? d : d / n;
}

struct Case {
  int64_t T, H, K, d;
  Docs docs;
  bool zero_decay = false;
};

struct Problem {
  Case c;
  float scale;
  Pair q, k, v, dout;
  Tensor lb_host, lb_dev, doc_host, doc_dev;
};

inline Problem make_problem(const Case& c, std::mt19937& rng) {
  Problem p{c, 1.0f / std::sqrt(static_cast<float>(c.d)), {}, {}, {}, {}, {}, {}, {}, {}};
  p.q = bf16_pair(randn(c.T * c.H * c.d, 1.5f, rng), {c.T, c.H, c.d});
  p.k = bf16_pair(randn(c.T * c.K * c.d, 1.5f, rng), {c.T, c.K, c.d});
  p.v = bf16_pair(randn(c.T * c.K * c.d, 1.0f, rng), {c.T, c.K, c.d});
  p.dout = bf16_pair(randn(c.T * c.H * c.d, 1.0f, rng), {c.T, c.H, c.d});
  p.lb_host = Tensor::from_vector<float>(make_log_beta(c.T * c.K, c.zero_decay, rng), {c.T, c.K});
  p.lb_dev = p.lb_host.to(Device::CUDA);
  p.doc_host = Tensor::from_vector<int32_t>(make_docs(c.T, c.docs, rng), {c.T});
  p.doc_dev = p.doc_host.to(Device::CUDA);
  return p;
}

struct Results {
  std::vector<double> out, lse, dq, dk, dv, dlb;
};

// The CPU backward of p given the forward's out and lse (F32, host).
inline void cpu_backward(const Problem& p, const Tensor& out, const Tensor& lse, Results& r) {
  const Case& c = p.c;
  Tensor dq = Tensor::empty({c.T, c.H, c.d}, DType::F32), dk = Tensor::empty({c.T, c.K, c.d}, DType::F32),
         dv = Tensor::empty({c.T, c.K, c.d}, DType::F32), dlb = Tensor::empty({c.T, c.K}, DType::F32);
  ops::gated_attention_backward(p.q.host, p.k.host, p.v.host, p.lb_host, p.doc_host, p.scale, out, lse, p.dout.host, dq,
                                dk, dv, dlb);
  r.dq = host_values(dq), r.dk = host_values(dk), r.dv = host_values(dv), r.dlb = host_values(dlb);
}

// The CPU forward of p: out and lse (F32, host).
inline std::pair<Tensor, Tensor> cpu_forward(const Problem& p) {
  const Case& c = p.c;
  Tensor out = Tensor::empty({c.T, c.H, c.d}, DType::F32), lse = Tensor::empty({c.T, c.H}, DType::F32);
  ops::gated_attention(p.q.host, p.k.host, p.v.host, p.lb_host, p.doc_host, p.scale, out, lse);
  return {out, lse};
}

// The rounding floor of dq, dk and dlogβ. Each is a sum over keys (or queries) of
// dS = P·(dP − D), where dP = dout·v and D = dout·out are fp32 dot products of d terms: each
// carries an absolute error up to d·2⁻²⁴·Σ|terms| (Higham's bound), whichever device computes
// it. Where the softmax puts all its mass on one key (a query whose document has no earlier
// key it can see: a one-token document, or only β = 0 keys before it) dP − D is exactly 0, so
// both devices return this rounding noise and a relative check of noise against noise cannot
// judge it. (The CUDA emulator met a seed whose rows were all such rows: 64 padding tokens and a
// one-token document; ‖Δ‖/‖ref‖ was 0.34 for dq and dk.) The floors sum that bound, with the
// softmax weights P, into each gradient row: a gradient passes with
// ‖got − want‖ ≤ tol·‖want‖ + ‖floor‖. On rows whose softmax is spread the floor is about
// 10⁻³ of the row's gradient, so it hardly loosens the relative check.
struct Floors {
  std::vector<double> dq, dk, dlb;  // per row of [T·H], [T·K], [T·K]
};

inline Floors rounding_floors(const Problem& p, const Results& gpu) {
  const Case& c = p.c;
  const int64_t group = c.H / c.K;
  const float *q = p.q.host.data<float>(), *k = p.k.host.data<float>(), *v = p.v.host.data<float>(),
              *dout = p.dout.host.data<float>(), *lb = p.lb_host.data<float>();
  const int32_t* doc = p.doc_host.data<int32_t>();
  const double u = 2.0 * static_cast<double>(c.d) * std::ldexp(1.0, -24);  // two dot products of d terms
  const auto dot = [&](const float* a, const float* b, bool absolute) {
    double s = 0;
    for (int64_t j = 0; j < c.d; ++j) s += absolute ? std::abs(static_cast<double>(a[j]) * b[j]) : static_cast<double>(a[j]) * b[j];
    return s;
  };
  Floors f{std::vector<double>(static_cast<size_t>(c.T * c.H), 0.0), std::vector<double>(static_cast<size_t>(c.T * c.K), 0.0),
           std::vector<double>(static_cast<size_t>(c.T * c.K), 0.0)};
  for (int64_t t = 0; t < c.T; ++t) {
    if (doc[t] < 0) continue;
    for (int64_t h = 0; h < c.H; ++h) {
      const int64_t kv = h / group;
      const float* qt = q + (t * c.H + h) * c.d;
      const float* dt = dout + (t * c.H + h) * c.d;
      double b = 0;  // Σ|dout ∘ out|, with the GPU's out (what its D is computed from)
      for (int64_t j = 0; j < c.d; ++j) b += std::abs(static_cast<double>(dt[j]) * gpu.out[static_cast<size_t>((t * c.H + h) * c.d + j)]);
      const double lse = gpu.lse[static_cast<size_t>(t * c.H + h)];
      const double q_norm = std::sqrt(dot(qt, qt, false));
      for (int64_t i = 0; i <= t; ++i) {
        if (doc[i] != doc[t]) continue;
        const double decay = i == t ? 0.0 : static_cast<double>(t - i) * lb[i * c.K + kv];
        const float* ki = k + (i * c.K + kv) * c.d;
        const double P = std::exp(p.scale * dot(qt, ki, false) + decay - lse);
        if (!(P > 0)) continue;
        const double noise = u * P * (dot(dt, v + (i * c.K + kv) * c.d, true) + b);
        f.dq[static_cast<size_t>(t * c.H + h)] += p.scale * noise * std::sqrt(dot(ki, ki, false));
        f.dk[static_cast<size_t>(i * c.K + kv)] += p.scale * noise * q_norm;
        f.dlb[static_cast<size_t>(i * c.K + kv)] += noise * static_cast<double>(t - i);
      }
    }
  }
  return f;
}

// ‖got − want‖ ≤ tol·‖want‖ + ‖floor‖, after checking that every value is finite.
inline void expect_close(const std::vector<double>& got, const std::vector<double>& want, const std::vector<double>& floor,
                  double tol, const char* what) {
  const double err = distance(got, want, what);
  EXPECT_LE(err, tol * norm(want) + norm(floor))
      << what << ": ‖Δ‖ = " << err << ", ‖ref‖ = " << norm(want) << ", rounding floor " << norm(floor);
}

// An environment variable set for a scope (restored after): RETAIN_ATTENTION_FORWARD and
// RETAIN_ATTENTION_BACKWARD pick the kernels.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_.c_str(), old_.c_str(), 1);
    else
      unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

}  // namespace retain::attention_cases
