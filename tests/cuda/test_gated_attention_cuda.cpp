// The CUDA retention-gated attention (kernels/cuda/gated_attention.cu) against the CPU
// reference op on fresh random inputs per run (the seed is printed with every failure, and
// RETAIN_TEST_SEED=n replays one): out, dq, dk, dv, dlogβ within ‖Δ‖/‖ref‖ ≤ 1e-2 (bf16
// operands; the reference gets the same bf16-rounded inputs in F32, and its backward the GPU
// forward's out and lse), dq, dk and dlogβ plus fp32 rounding floors where the softmax leaves
// them at rounding level (rounding_floors below), lse within 1e-3; every
// output poisoned with NaN before each call (an unwritten element fails); T not a multiple of
// the 64-token block (1, 63, 65, 200, 1000, 2048), documents with padding (contiguous and
// interleaved), GQA groups 1/2/4/8, head_dim 64 and 128, logβ from −inf to 0; bitwise repeatable
// results; bad inputs as one-line errors. Skips (visibly) without a CUDA build or device.
#include <gtest/gtest.h>

#include "tests/cuda/cuda_test.h"
#include "tests/error_helpers.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/memory.h"
#ifdef RETAIN_CUDA_KERNELS
#include "kernels/cuda/retention_cuda.h"
#endif
#include "kernels/deferred_checks.h"
#include "kernels/retention.h"
#include "kernels/tensor.h"

using namespace retain;

namespace {

using cuda_test::fresh_seed;

enum class Docs { one, contiguous, interleaved };

std::vector<int32_t> make_docs(int64_t T, Docs kind, std::mt19937& rng) {
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
std::vector<float> make_log_beta(int64_t n, bool zero, std::mt19937& rng) {
  std::vector<float> lb(static_cast<size_t>(n), 0.0f);
  if (zero) return lb;
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (float& x : lb) {
    const float r = u(rng);
    x = r < 0.05f ? -INFINITY : r < 0.15f ? -30.0f : r < 0.5f ? -2.0f * u(rng) : -1e-3f * u(rng);
  }
  return lb;
}

std::vector<float> randn(int64_t n, float std, std::mt19937& rng) {
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
Pair bf16_pair(const std::vector<float>& v, const Shape& shape) {
  const Tensor bf = Tensor::from_vector<float>(v, shape).to_dtype(DType::BF16);
  return {bf.to_dtype(DType::F32), bf.to(Device::CUDA)};
}

// A device tensor filled with NaN (all-ones bytes are NaN in both F32 and BF16).
Tensor poisoned(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::CUDA);
  cuda::memset_device(t.raw(), 0xff, t.nbytes());
  return t;
}

std::vector<double> host_values(const Tensor& t) {
  const Tensor f = t.to(Device::CPU).to_dtype(DType::F32);
  const float* p = f.data<float>();
  return std::vector<double>(p, p + f.numel());
}

// ‖got − want‖ after checking that every value is finite (a NaN left by the poison means an
// unwritten element).
double distance(const std::vector<double>& got, const std::vector<double>& want, const char* what) {
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

double norm(const std::vector<double>& x) {
  double s = 0;
  for (double e : x) s += e * e;
  return std::sqrt(s);
}

// ‖got − want‖ / ‖want‖ (or ‖got‖ when want is all zeros).
double rel_err(const std::vector<double>& got, const std::vector<double>& want, const char* what) {
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

Problem make_problem(const Case& c, std::mt19937& rng) {
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
void cpu_backward(const Problem& p, const Tensor& out, const Tensor& lse, Results& r) {
  const Case& c = p.c;
  Tensor dq = Tensor::empty({c.T, c.H, c.d}, DType::F32), dk = Tensor::empty({c.T, c.K, c.d}, DType::F32),
         dv = Tensor::empty({c.T, c.K, c.d}, DType::F32), dlb = Tensor::empty({c.T, c.K}, DType::F32);
  ops::gated_attention_backward(p.q.host, p.k.host, p.v.host, p.lb_host, p.doc_host, p.scale, out, lse, p.dout.host, dq,
                                dk, dv, dlb);
  r.dq = host_values(dq), r.dk = host_values(dk), r.dv = host_values(dv), r.dlb = host_values(dlb);
}

// The CPU forward of p: out and lse (F32, host).
std::pair<Tensor, Tensor> cpu_forward(const Problem& p) {
  const Case& c = p.c;
  Tensor out = Tensor::empty({c.T, c.H, c.d}, DType::F32), lse = Tensor::empty({c.T, c.H}, DType::F32);
  ops::gated_attention(p.q.host, p.k.host, p.v.host, p.lb_host, p.doc_host, p.scale, out, lse);
  return {out, lse};
}

// The CPU forward, and its backward on its own out and lse.
Results run_cpu(const Problem& p) {
  const auto [out, lse] = cpu_forward(p);
  Results r{host_values(out), host_values(lse), {}, {}, {}, {}};
  cpu_backward(p, out, lse, r);
  return r;
}

// The GPU backward gets the GPU forward's own out and lse, as training does.
Results run_gpu(const Problem& p) {
  const Case& c = p.c;
  Tensor out = poisoned({c.T, c.H, c.d}, DType::BF16), lse = poisoned({c.T, c.H}, DType::F32);
  ops::gated_attention(p.q.device, p.k.device, p.v.device, p.lb_dev, p.doc_dev, p.scale, out, lse);
  Tensor dq = poisoned({c.T, c.H, c.d}, DType::BF16), dk = poisoned({c.T, c.K, c.d}, DType::BF16),
         dv = poisoned({c.T, c.K, c.d}, DType::BF16), dlb = poisoned({c.T, c.K}, DType::F32);
  ops::gated_attention_backward(p.q.device, p.k.device, p.v.device, p.lb_dev, p.doc_dev, p.scale, out, lse,
                                p.dout.device, dq, dk, dv, dlb);
  return {host_values(out), host_values(lse), host_values(dq), host_values(dk), host_values(dv), host_values(dlb)};
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

Floors rounding_floors(const Problem& p, const Results& gpu) {
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
void expect_close(const std::vector<double>& got, const std::vector<double>& want, const std::vector<double>& floor,
                  double tol, const char* what) {
  const double err = distance(got, want, what);
  EXPECT_LE(err, tol * norm(want) + norm(floor))
      << what << ": ‖Δ‖ = " << err << ", ‖ref‖ = " << norm(want) << ", rounding floor " << norm(floor);
}

void check_case(const Case& c, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "seed=" << seed << " (RETAIN_TEST_SEED replays it) T=" << c.T << " H=" << c.H
                                    << " K=" << c.K << " d=" << c.d << " docs=" << static_cast<int>(c.docs)
                                    << " zero_decay=" << c.zero_decay);
  std::mt19937 rng(seed);
  const Problem p = make_problem(c, rng);
  const auto [cpu_out, cpu_lse] = cpu_forward(p);
  Results want{host_values(cpu_out), host_values(cpu_lse), {}, {}, {}, {}};
  const Results got = run_gpu(p);
  const double tol = 1e-2;
  EXPECT_LE(rel_err(got.out, want.out, "out"), tol);
  // The backward is judged on the inputs it was given: the CPU reference's backward reruns on
  // the GPU forward's out (bf16) and lse, so that D = dout·out is the same product on both
  // devices and only the backward's own rounding differs.
  const std::vector<float> gpu_out(got.out.begin(), got.out.end()), gpu_lse(got.lse.begin(), got.lse.end());
  cpu_backward(p, Tensor::from_vector<float>(gpu_out, {c.T, c.H, c.d}), Tensor::from_vector<float>(gpu_lse, {c.T, c.H}),
               want);
  const Floors floor = rounding_floors(p, got);
  expect_close(got.dq, want.dq, floor.dq, tol, "dq");
  expect_close(got.dk, want.dk, floor.dk, tol, "dk");
  EXPECT_LE(rel_err(got.dv, want.dv, "dv"), tol);
  expect_close(got.dlb, want.dlb, floor.dlb, tol, "dlog_beta");
  // lse: -inf exactly on rows with nothing allowed (padding), else close (fp32 statistics).
  for (size_t x = 0; x < want.lse.size(); ++x) {
    if (std::isinf(want.lse[x])) {
      EXPECT_EQ(got.lse[x], want.lse[x]) << "lse row " << x;
    } else {
      EXPECT_NEAR(got.lse[x], want.lse[x], 1e-3 * (1 + std::abs(want.lse[x]))) << "lse row " << x;
    }
  }
  // Padding rows: out exactly 0; padding keys: dk, dv, dlogβ exactly 0.
  const int32_t* doc = p.doc_host.data<int32_t>();
  for (int64_t t = 0; t < c.T; ++t) {
    if (doc[t] >= 0) continue;
    for (int64_t x = 0; x < c.H * c.d; ++x)
      ASSERT_EQ(got.out[static_cast<size_t>(t * c.H * c.d + x)], 0.0) << "t=" << t;
    for (int64_t x = 0; x < c.K * c.d; ++x) ASSERT_EQ(got.dk[static_cast<size_t>(t * c.K * c.d + x)], 0.0) << "t=" << t;
    for (int64_t x = 0; x < c.K; ++x) ASSERT_EQ(got.dlb[static_cast<size_t>(t * c.K + x)], 0.0) << "t=" << t;
  }
}

// Small shapes (also what the compute-sanitizer runs take): every T edge, GQA 1/2/4/8, both d.
const std::vector<Case> kSmall = {
    {1, 2, 2, 64, Docs::one},           {1, 8, 1, 128, Docs::contiguous},   {63, 2, 2, 64, Docs::contiguous},
    {63, 4, 1, 128, Docs::interleaved}, {64, 4, 2, 128, Docs::one},         {65, 4, 2, 64, Docs::contiguous},
    {65, 8, 2, 128, Docs::contiguous},  {200, 8, 1, 64, Docs::interleaved}, {200, 4, 4, 128, Docs::contiguous},
    {130, 2, 1, 128, Docs::one, true},
};

// The GPU with the skip at ε (both passes) against the exact CPU reference, returning
// ‖Δ‖/‖ref‖ of out, dq, dk, dv, dlogβ.
#ifdef RETAIN_CUDA_KERNELS
std::vector<double> skip_errors(const Problem& p, float eps, const Results& want) {
  const Case& c = p.c;
  Tensor out = poisoned({c.T, c.H, c.d}, DType::BF16), lse = poisoned({c.T, c.H}, DType::F32);
  cuda::gated_attention(p.q.device, p.k.device, p.v.device, p.lb_dev, p.doc_dev, p.scale, out, lse, eps);
  Tensor dq = poisoned({c.T, c.H, c.d}, DType::BF16), dk = poisoned({c.T, c.K, c.d}, DType::BF16),
         dv = poisoned({c.T, c.K, c.d}, DType::BF16), dlb = poisoned({c.T, c.K}, DType::F32);
  cuda::gated_attention_backward(p.q.device, p.k.device, p.v.device, p.lb_dev, p.doc_dev, p.scale, out, lse,
                                 p.dout.device, dq, dk, dv, dlb, eps);
  return {rel_err(host_values(out), want.out, "out"), rel_err(host_values(dq), want.dq, "dq"),
          rel_err(host_values(dk), want.dk, "dk"), rel_err(host_values(dv), want.dv, "dv"),
          rel_err(host_values(dlb), want.dlb, "dlog_beta")};
}
#endif

}  // namespace

// The optional weight skip: with strong decays (logβ ∈ [−0.5, −0.1], so tiles four or more
// blocks back have weights < e^-19 and are skipped) and ε = 1e-6 the GPU still matches the
// exact reference at bf16 tolerance in every output, while ε = 0.5 with weak decays (skipping
// tiles that matter) visibly does not; ε outside [0, 1) is an error. (The bound itself is
// tested on the emulated kernels in test_attention_tiles.)
void weight_skip_keeps_negligible_errors() {
#ifdef RETAIN_CUDA_KERNELS
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed=" << seed);
  std::mt19937 rng(seed);
  Problem p = make_problem({1000, 4, 2, 128, Docs::contiguous}, rng);
  auto set_log_beta = [&](Problem& q, float lo, float hi) {
    std::uniform_real_distribution<float> u(lo, hi);
    std::vector<float> lb(static_cast<size_t>(q.c.T * q.c.K));
    for (float& x : lb) x = u(rng);
    q.lb_host = Tensor::from_vector<float>(lb, {q.c.T, q.c.K});
    q.lb_dev = q.lb_host.to(Device::CUDA);
  };
  set_log_beta(p, -0.5f, -0.1f);
  for (double err : skip_errors(p, 1e-6f, run_cpu(p))) EXPECT_LE(err, 1e-2);
  // Weak decays (logβ ∈ [−0.02, −0.01]) and ε = 0.5: tiles three blocks back (weights up to
  // e^-1.3) are dropped, which must show. One document: with random ones, all shorter than
  // three blocks for some seeds, nothing is that far back (the CUDA emulator met such a seed:
  // 424475689, error 1.7e-3).
  p = make_problem({1000, 4, 2, 128, Docs::one}, rng);
  set_log_beta(p, -0.02f, -0.01f);
  EXPECT_GT(skip_errors(p, 0.5f, run_cpu(p))[0], 1e-2) << "ε = 0.5 should drop mass that matters";
  Tensor out = Tensor::empty({p.c.T, p.c.H, p.c.d}, DType::BF16, Device::CUDA);
  Tensor lse = Tensor::empty({p.c.T, p.c.H}, DType::F32, Device::CUDA);
  try {
    cuda::gated_attention(p.q.device, p.k.device, p.v.device, p.lb_dev, p.doc_dev, p.scale, out, lse, 1.0f);
    ADD_FAILURE() << "ε = 1 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("skip_weight_below"), std::string::npos) << e.what();
  }
#else
  GTEST_SKIP() << "built without the CUDA kernels";
#endif
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

// The GatedAttentionCuda tests pin the mma.sync kernels: unset, an sm_90 GPU would run wgmma
// (use_wgmma's auto), which GatedAttentionCudaWgmma checks through the same cases.
struct PinMma {
  ScopedEnv forward{"RETAIN_ATTENTION_FORWARD", "mma"}, backward{"RETAIN_ATTENTION_BACKWARD", "mma"};
};

TEST(GatedAttentionCuda, WeightSkipKeepsNegligibleErrors) {
  SKIP_WITHOUT_GPU();
  const PinMma mma;
  weight_skip_keeps_negligible_errors();
}

// Run with --gtest_also_run_disabled_tests by tests/cuda/run_sanitizer.sh to ask "is there a
// device?" (fails without one).
TEST(GatedAttentionCuda, DISABLED_DevicePresent) { ASSERT_GT(cuda_device_count(), 0); }

void small_shapes_match_cpu_reference() {
  const uint32_t seed = fresh_seed();
  std::cout << "seed " << seed << "\n";
  for (size_t x = 0; x < kSmall.size(); ++x) check_case(kSmall[x], seed + static_cast<uint32_t>(x));
}
TEST(GatedAttentionCuda, SmallShapesMatchCpuReference) {
  SKIP_WITHOUT_GPU();
  const PinMma mma;
  small_shapes_match_cpu_reference();
}

// Many tiles per row: long documents (online softmax across tiles, the all-allowed fast path,
// the 2-stage pipeline) and many short ones (the document-range skip).
void longer_sequences_match_cpu_reference() {
  const uint32_t seed = fresh_seed();
  std::cout << "seed " << seed << "\n";
  const std::vector<Case> cases = {
      {1000, 8, 1, 64, Docs::contiguous},
      {1000, 4, 2, 128, Docs::one},
      {2048, 4, 1, 128, Docs::contiguous},
      {2048, 8, 8, 64, Docs::one, true},
  };
  for (size_t x = 0; x < cases.size(); ++x) check_case(cases[x], seed + static_cast<uint32_t>(x));
}
TEST(GatedAttentionCuda, LongerSequencesMatchCpuReference) {
  SKIP_WITHOUT_GPU();
  const PinMma mma;
  longer_sequences_match_cpu_reference();
}

// No atomics and fixed loop orders: two runs are bitwise equal.
void repeated_runs_are_bitwise_equal() {
  std::mt19937 rng(fresh_seed());
  const Problem p = make_problem({700, 8, 2, 128, Docs::contiguous}, rng);
  const Results a = run_gpu(p), b = run_gpu(p);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.dq, b.dq);
  EXPECT_EQ(a.dk, b.dk);
  EXPECT_EQ(a.dv, b.dv);
  EXPECT_EQ(a.dlb, b.dlb);
}
TEST(GatedAttentionCuda, RepeatedRunsAreBitwiseEqual) {
  SKIP_WITHOUT_GPU();
  const PinMma mma;
  repeated_runs_are_bitwise_equal();
}

// Both passes on Hopper's wgmma (forward_wgmma_kernel, dq_wgmma_kernel, dkdv_wgmma_kernel;
// RETAIN_ATTENTION_FORWARD=wgmma RETAIN_ATTENTION_BACKWARD=wgmma; sm_90 only) through the same
// checks.
class GatedAttentionCudaWgmma : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
#ifdef RETAIN_CUDA_KERNELS
    if (!cuda::wgmma_supported()) GTEST_SKIP() << "the wgmma kernels need an sm_90 GPU (H100/H200)";
    forward_.emplace("RETAIN_ATTENTION_FORWARD", "wgmma");
    backward_.emplace("RETAIN_ATTENTION_BACKWARD", "wgmma");
#else
    GTEST_SKIP() << "built without the CUDA kernels";
#endif
  }
  void TearDown() override {
    forward_.reset();
    backward_.reset();
  }
  std::optional<ScopedEnv> forward_, backward_;
};
TEST_F(GatedAttentionCudaWgmma, SmallShapesMatchCpuReference) { small_shapes_match_cpu_reference(); }
TEST_F(GatedAttentionCudaWgmma, LongerSequencesMatchCpuReference) { longer_sequences_match_cpu_reference(); }
TEST_F(GatedAttentionCudaWgmma, WeightSkipKeepsNegligibleErrors) { weight_skip_keeps_negligible_errors(); }
TEST_F(GatedAttentionCudaWgmma, RepeatedRunsAreBitwiseEqual) { repeated_runs_are_bitwise_equal(); }

TEST(GatedAttentionCuda, BadInputsAreOneLineErrors) {
  SKIP_WITHOUT_GPU();
  const int64_t T = 70, H = 4, K = 2, d = 64;
  Tensor q = Tensor::zeros({T, H, d}, DType::BF16, Device::CUDA);
  Tensor k = Tensor::zeros({T, K, d}, DType::BF16, Device::CUDA), v = k.clone();
  Tensor lb = Tensor::zeros({T, K}, DType::F32, Device::CUDA);
  Tensor doc = Tensor::zeros({T}, DType::I32, Device::CUDA);
  Tensor out = Tensor::empty({T, H, d}, DType::BF16, Device::CUDA),
         lse = Tensor::empty({T, H}, DType::F32, Device::CUDA);
  const float scale = 0.125f;
  // F32 activations on CUDA.
  Tensor q32 = Tensor::zeros({T, H, d}, DType::F32, Device::CUDA);
  test_support::expect_one_line_error([&] { ops::gated_attention(q32, k, v, lb, doc, scale, out, lse); }, "must be BF16");
  // A host tensor among device ones.
  Tensor lb_host = Tensor::zeros({T, K}, DType::F32);
  test_support::expect_one_line_error([&] { ops::gated_attention(q, k, v, lb_host, doc, scale, out, lse); }, "one device");
  // A head_dim without a kernel.
  Tensor q32d = Tensor::zeros({T, H, 32}, DType::BF16, Device::CUDA);
  Tensor k32d = Tensor::zeros({T, K, 32}, DType::BF16, Device::CUDA), out32d = q32d.clone();
  test_support::expect_one_line_error([&] { ops::gated_attention(q32d, k32d, k32d, lb, doc, scale, out32d, lse); }, "head_dim 32");
  // A positive logβ, named by its index (found on the device): the op queues the scan and
  // returns; the next raise_deferred_checks() (once per training step) throws its error.
  ops::raise_deferred_checks();  // nothing left over from the calls above
  std::vector<float> bad(static_cast<size_t>(T * K), -0.5f);
  bad[2 * K + 1] = 0.25f;
  Tensor lb_bad = Tensor::from_vector<float>(bad, {T, K}).to(Device::CUDA);
  EXPECT_NO_THROW(ops::gated_attention(q, k, v, lb_bad, doc, scale, out, lse));
  EXPECT_EQ(ops::deferred_checks_pending(), 1);
  test_support::expect_one_line_error([&] { ops::raise_deferred_checks(); }, "gated_attention: log_beta[2, 1] = 0.25");
  EXPECT_EQ(ops::deferred_checks_pending(), 0);
  EXPECT_NO_THROW(ops::raise_deferred_checks()) << "a verdict is read once";
  bad[2 * K + 1] = NAN;
  Tensor lb_nan = Tensor::from_vector<float>(bad, {T, K}).to(Device::CUDA);
  Tensor dq = q.clone(), dk = k.clone(), dv = k.clone(), dlb = lb.clone();
  // Good calls before and after: the first failing check in queue order is the one reported.
  ops::gated_attention(q, k, v, lb, doc, scale, out, lse);
  ops::gated_attention_backward(q, k, v, lb_nan, doc, scale, out, lse, q, dq, dk, dv, dlb);
  ops::gated_attention(q, k, v, lb_bad, doc, scale, out, lse);
  test_support::expect_one_line_error([&] { ops::raise_deferred_checks(); }, "gated_attention_backward: log_beta[2, 1] = nan");
  ops::gated_attention(q, k, v, lb, doc, scale, out, lse);
  EXPECT_NO_THROW(ops::raise_deferred_checks());
  {
    const ScopedEnv bogus("RETAIN_ATTENTION_FORWARD", "mma.sync");
    test_support::expect_one_line_error([&] { ops::gated_attention(q, k, v, lb, doc, scale, out, lse); },
                                        "RETAIN_ATTENTION_FORWARD must be mma, wgmma or auto, not 'mma.sync'");
  }
  {
    const ScopedEnv bogus("RETAIN_ATTENTION_BACKWARD", "hgmma");
    test_support::expect_one_line_error(
        [&] { ops::gated_attention_backward(q, k, v, lb, doc, scale, out, lse, q, dq, dk, dv, dlb); },
        "RETAIN_ATTENTION_BACKWARD must be mma, wgmma or auto, not 'hgmma'");
  }
}
