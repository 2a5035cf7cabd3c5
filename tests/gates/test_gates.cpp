// The retention gates against an independent float64 implementation written here from the
// formulas of DESIGN §4: forward values, backward (parameter gradients and ∂/∂h) against
// central finite differences of that float64 forward, the shared dbtrimkv tensor, init; and
// that the CUDA entry points fail in one line where there is no device.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "model/gates/gates.h"
#include "tests/error_helpers.h"

using namespace retain;
using namespace retain::gates;

namespace {

// ---- float64 reference ---------------------------------------------------------------
using Mat = std::vector<double>;  // row-major

double sigmoid64(double x) { return x >= 0 ? 1 / (1 + std::exp(-x)) : std::exp(x) / (1 + std::exp(x)); }
double silu64(double x) { return x * sigmoid64(x); }
double logsig64(double x) { return std::min(x, 0.0) - std::log1p(std::exp(-std::fabs(x))); }

Mat to64(const Tensor& t) {
  Mat m(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) m[static_cast<size_t>(i)] = t.data<float>()[i];
  return m;
}

// y[T, out] = act(x[T, in]·Wᵀ + b)
Mat affine64(const Mat& x, int64_t T, int64_t in, const Mat& w, const Mat& b, int64_t out, bool silu) {
  Mat y(static_cast<size_t>(T * out));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < out; ++o) {
      double s = b[static_cast<size_t>(o)];
      for (int64_t i = 0; i < in; ++i) s += x[static_cast<size_t>(t * in + i)] * w[static_cast<size_t>(o * in + i)];
      y[static_cast<size_t>(t * out + o)] = silu ? silu64(s) : s;
    }
  return y;
}

// Parameters by file name (layer-specific names; a shared tensor appears under every layer's name).
struct Params64 {
  std::map<std::string, Mat> p;
  const Mat& at(int64_t l, const char* s) const { return p.at(gate_tensor_name(l, s)); }
};

Params64 params64(const RetentionGates& g) {
  Params64 out;
  for (const GateParameter& p : g.parameters())
    for (const std::string& n : p.file_names) out.p[n] = to64(p.value);
  return out;
}

Mat log_beta64(const GateDims& d, const Params64& P, int64_t l, const Mat& h, int64_t T) {
  const int64_t D = d.hidden, G = d.gate_hidden, K = d.kv_heads;
  if (G == 0) {  // the linear gate: logβ = log σ(W·h + b)
    Mat z = affine64(h, T, D, P.at(l, "linear.weight"), P.at(l, "bias"), K, false);
    for (double& v : z) v = logsig64(v);
    return z;
  }
  const Mat s1 = affine64(h, T, D, P.at(l, "linear1.weight"), P.at(l, "linear1.bias"), G, true);
  Mat z;
  if (d.kind == GateKind::trimkv) {
    z = affine64(s1, T, G, P.at(l, "linear2.weight"), P.at(l, "bias"), K, false);
  } else {
    const Mat s2 = affine64(s1, T, G, P.at(l, "linear2.weight"), P.at(l, "linear2.bias"), G, true);
    z = affine64(s2, T, G, P.at(l, "linear3.weight"), P.at(l, "bias"), K, false);
  }
  for (double& v : z) v = logsig64(v);
  return z;
}

// ---- helpers --------------------------------------------------------------------------
Tensor random_f32(const Shape& shape, double std, std::mt19937_64& rng) {
  std::normal_distribution<double> n(0, std);
  Tensor t = Tensor::empty(shape, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(n(rng));
  return t;
}

// Gates with O(1) random weights and logit biases spread from very negative to large
// positive, so that z covers the regions where a naive log(sigmoid(z)) breaks.
RetentionGates random_gates(const GateDims& d, uint64_t seed) {
  RetentionGates g = RetentionGates::init(d, 0.0, seed);
  std::mt19937_64 rng(seed + 1);
  const double biases[] = {-60.0, 0.7, 35.0, -3.0, 2.0};
  int64_t offset = 0;  // the l-th logit bias starts at biases[2l], so every case sees both extremes
  for (GateParameter& p : g.parameters()) {
    const bool logit_bias = p.name().ends_with("retention_gate.bias");
    Tensor v = random_f32(p.value.shape(), p.value.ndim() == 2 ? 1.0 / std::sqrt(double(p.value.dim(1))) * 1.5 : 0.5, rng);
    if (logit_bias) {
      for (int64_t k = 0; k < v.numel(); ++k) v.data<float>()[k] = static_cast<float>(biases[(k + offset) % 5]);
      offset += 2;
    }
    std::copy(v.data<float>(), v.data<float>() + v.numel(), p.value.data<float>());
  }
  return g;
}

struct Case {
  GateKind kind;
  int64_t L, D, G, K, T;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << fmt::format("{} L{} D{} G{} K{} T{}", gate_kind_name(c.kind), c.L, c.D, c.G, c.K, c.T);
}

}  // namespace

TEST(Gates, LogSigmoidIsStable) {
  // Exact values: log σ(x) = −log1p(e^{−x}) for x > 0, x − log1p(e^{x}) for x < 0.
  EXPECT_FLOAT_EQ(log_sigmoid(0.0f), static_cast<float>(-std::log(2.0)));
  EXPECT_FLOAT_EQ(log_sigmoid(18.0f), static_cast<float>(-std::log1p(std::exp(-18.0))));  // log(sigmoid) gives 0
  EXPECT_FLOAT_EQ(log_sigmoid(30.0f), static_cast<float>(-9.357622968840175e-14));
  EXPECT_LT(log_sigmoid(30.0f), 0.0f);
  EXPECT_FLOAT_EQ(log_sigmoid(-200.0f), -200.0f);  // log(sigmoid) gives −inf
  EXPECT_FLOAT_EQ(log_sigmoid(-5.0f), static_cast<float>(-5.0 - std::log1p(std::exp(-5.0))));
  EXPECT_EQ(log_sigmoid(200.0f), -0.0f);
}

TEST(Gates, ParseKind) {
  EXPECT_EQ(parse_gate_kind("trimkv"), GateKind::trimkv);
  EXPECT_EQ(parse_gate_kind("dbtrimkv"), GateKind::dbtrimkv);
  try {
    parse_gate_kind("trim", "--gate-kind");
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "--gate-kind: unknown gate kind 'trim' (expected trimkv or dbtrimkv)");
  }
  EXPECT_EQ(gate_kind_name(GateKind::dbtrimkv), "dbtrimkv");
}

TEST(Gates, InitFollowsDesign) {
  for (GateKind kind : {GateKind::trimkv, GateKind::dbtrimkv}) {
    const GateDims d{kind, 3, 40, 32, 2};
    const RetentionGates g = RetentionGates::init(d, 18.0, 5);
    // Parameter list: per layer w1, b1, w2 (+ b2) (+ b for trimkv); shared w3, b once.
    const size_t per_layer = 4, shared = kind == GateKind::trimkv ? 0 : 2;
    ASSERT_EQ(g.parameters().size(), 3 * per_layer + shared);
    int64_t n = 0;
    double sum = 0, sq = 0;
    for (const GateParameter& p : g.parameters()) {
      const float* v = p.value.data<float>();
      EXPECT_EQ(p.grad.shape(), p.value.shape());
      if (p.value.ndim() == 2) {
        for (int64_t i = 0; i < p.value.numel(); ++i, ++n) sum += v[i], sq += double(v[i]) * v[i];
      } else {
        const float want = p.name().ends_with("retention_gate.bias") ? 18.0f : 0.0f;
        for (int64_t i = 0; i < p.value.numel(); ++i) EXPECT_EQ(v[i], want) << p.name();
      }
      EXPECT_EQ(p.shared(), kind == GateKind::dbtrimkv && (p.name().ends_with("linear3.weight") ||
                                                           p.name().ends_with("retention_gate.bias")))
          << p.name();
    }
    const double mean = sum / n, std = std::sqrt(sq / n - mean * mean);
    EXPECT_NEAR(mean, 0.0, 0.002) << n;
    EXPECT_NEAR(std, 0.02, 0.001) << n;
    // Deterministic in the seed.
    const RetentionGates same = RetentionGates::init(d, 18.0, 5), other = RetentionGates::init(d, 18.0, 6);
    const Tensor& a = g.parameters()[0].value;
    EXPECT_EQ(std::memcmp(a.raw(), same.parameters()[0].value.raw(), a.nbytes()), 0);
    EXPECT_NE(std::memcmp(a.raw(), other.parameters()[0].value.raw(), a.nbytes()), 0);
    EXPECT_EQ(g.bias_init(), 18.0);
    // With b = 18 the gate is plain attention to float32 precision, yet not exactly 0.
    std::mt19937_64 rng(1);
    const Tensor lb = g.forward(1, random_f32({5, 40}, 1.0, rng));
    for (int64_t i = 0; i < lb.numel(); ++i) {
      EXPECT_LT(lb.data<float>()[i], 0.0f);
      EXPECT_GT(lb.data<float>()[i], -2e-8f);
    }
  }
  const int64_t D = 40, G = 32, K = 2;
  EXPECT_EQ(RetentionGates::init({GateKind::trimkv, 3, D, G, K}, 1, 0).num_parameters(),
            3 * (G * D + G + K * G + K));
  EXPECT_EQ(RetentionGates::init({GateKind::dbtrimkv, 3, D, G, K}, 1, 0).num_parameters(),
            3 * (G * D + G + G * G + G) + K * G + K);
  // G = 0: the linear gate, W [K, D] and b [K] per layer, trimkv only.
  const RetentionGates linear = RetentionGates::init({GateKind::trimkv, 3, D, 0, K}, 1, 0);
  EXPECT_TRUE(linear.is_linear());
  EXPECT_EQ(linear.num_parameters(), 3 * (K * D + K));
  EXPECT_EQ(linear.parameters()[0].name(), gate_tensor_name(0, "linear.weight"));
  EXPECT_EQ(linear.parameters()[0].value.shape(), (Shape{K, D}));
  EXPECT_THROW(RetentionGates::init({GateKind::dbtrimkv, 3, D, 0, K}, 1, 0), Error);
  EXPECT_THROW(RetentionGates::init({GateKind::trimkv, 3, D, -1, K}, 1, 0), Error);
}

class GateGrad : public ::testing::TestWithParam<Case> {};

TEST_P(GateGrad, ForwardMatchesFloat64) {
  const Case c = GetParam();
  const GateDims d{c.kind, c.L, c.D, c.G, c.K};
  const RetentionGates g = random_gates(d, 11);
  const Params64 P = params64(g);
  std::mt19937_64 rng(3);
  double zmin = 1e9, zmax = -1e9;
  for (int64_t l = 0; l < c.L; ++l) {
    const Tensor h = random_f32({c.T, c.D}, 1.0, rng);
    GateActivations saved;
    const Tensor lb = g.forward(l, h, &saved);
    ASSERT_EQ(lb.shape(), (Shape{c.T, c.K}));
    const Mat want = log_beta64(d, P, l, to64(h), c.T);
    for (int64_t i = 0; i < lb.numel(); ++i) {
      const double w = want[static_cast<size_t>(i)];
      // float32 rounding of O(G) products, relative to the logit's size, plus the exact tail.
      EXPECT_NEAR(lb.data<float>()[i], w, 2e-5 * std::max(1.0, std::fabs(w))) << "layer " << l << " index " << i;
      EXPECT_LE(lb.data<float>()[i], 0.0f);
      zmin = std::min(zmin, double(saved.z.data<float>()[i]));
      zmax = std::max(zmax, double(saved.z.data<float>()[i]));
    }
  }
  EXPECT_LT(zmin, -40) << "the test must reach very negative logits";
  EXPECT_GT(zmax, 25) << "the test must reach large positive logits";
}

TEST_P(GateGrad, BackwardMatchesFiniteDifferences) {
  // loss = Σ_l Σ_{t,κ} logβ_l[t,κ]·R_l[t,κ]. One backward per layer, accumulating; a shared
  // tensor perturbed in the FD moves every layer, so its FD gradient is the sum over layers.
  const Case c = GetParam();
  const GateDims d{c.kind, c.L, c.D, c.G, c.K};
  RetentionGates g = random_gates(d, 23);
  std::mt19937_64 rng(4);
  std::vector<Tensor> hs, Rs, dhs;
  for (int64_t l = 0; l < c.L; ++l) {
    hs.push_back(random_f32({c.T, c.D}, 1.0, rng));
    Rs.push_back(random_f32({c.T, c.K}, 1.0, rng));
  }
  g.zero_grad();
  for (int64_t l = 0; l < c.L; ++l) {
    GateActivations saved;
    g.forward(l, hs[static_cast<size_t>(l)], &saved);
    Tensor dh = random_f32({c.T, c.D}, 1.0, rng);  // backward must ADD into dh
    const Tensor dh0 = dh.clone();
    g.backward(l, hs[static_cast<size_t>(l)], saved, Rs[static_cast<size_t>(l)], &dh);
    for (int64_t i = 0; i < dh.numel(); ++i) dh.data<float>()[i] -= dh0.data<float>()[i];
    dhs.push_back(dh);
  }

  Params64 P = params64(g);
  std::vector<Mat> h64, R64;
  for (int64_t l = 0; l < c.L; ++l) h64.push_back(to64(hs[size_t(l)])), R64.push_back(to64(Rs[size_t(l)]));
  auto loss = [&](const Params64& Q, const std::vector<Mat>& H) {
    double s = 0;
    for (int64_t l = 0; l < c.L; ++l) {
      const Mat lb = log_beta64(d, Q, l, H[size_t(l)], c.T);
      for (size_t i = 0; i < lb.size(); ++i) s += lb[i] * R64[size_t(l)][i];
    }
    return s;
  };
  // Central differences in float64: truncation O(eps²·f''') ≈ 1e-12, rounding ≈ 1e-16/eps ≈ 1e-10.
  // The analytic gradient is float32 (sums of ≤ T·G products of O(1) terms): error ≲ 1e-5 of
  // the gradient's scale, hence the tolerance 1e-4·scale. The scale is the largest entry of
  // each tensor's gradient, so it assumes some entry is not a sum that cancels across tokens:
  // with G = 1 a whole tensor can be one such entry (≈ 2e-4 from O(1) terms, float32 error
  // ≈ 5e-7, seen with random shapes); the shapes here have G ≥ 3 and pass for 1000 seeds.
  const double eps = 1e-6;
  for (const GateParameter& p : g.parameters()) {
    double scale = 1e-3;
    std::vector<double> fd(static_cast<size_t>(p.value.numel()));
    for (int64_t i = 0; i < p.value.numel(); ++i) {
      Params64 plus = P, minus = P;
      for (const std::string& n : p.file_names) plus.p[n][size_t(i)] += eps, minus.p[n][size_t(i)] -= eps;
      fd[size_t(i)] = (loss(plus, h64) - loss(minus, h64)) / (2 * eps);
      scale = std::max(scale, std::fabs(fd[size_t(i)]));
    }
    for (int64_t i = 0; i < p.value.numel(); ++i)
      EXPECT_NEAR(p.grad.data<float>()[i], fd[size_t(i)], 1e-4 * scale) << p.name() << " [" << i << "]";
  }
  for (int64_t l = 0; l < c.L; ++l) {
    double scale = 1e-3;
    std::vector<double> fd(static_cast<size_t>(c.T * c.D));
    for (size_t i = 0; i < fd.size(); ++i) {
      std::vector<Mat> plus = h64, minus = h64;
      plus[size_t(l)][i] += eps, minus[size_t(l)][i] -= eps;
      fd[i] = (loss(P, plus) - loss(P, minus)) / (2 * eps);
      scale = std::max(scale, std::fabs(fd[i]));
    }
    for (size_t i = 0; i < fd.size(); ++i)
      EXPECT_NEAR(dhs[size_t(l)].data<float>()[i], fd[i], 1e-4 * scale) << "dh layer " << l << " [" << i << "]";
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GateGrad,
                         ::testing::Values(Case{GateKind::trimkv, 2, 7, 5, 3, 13}, Case{GateKind::trimkv, 2, 4, 3, 1, 1},
                                           Case{GateKind::dbtrimkv, 3, 6, 4, 3, 11},
                                           Case{GateKind::dbtrimkv, 2, 5, 3, 5, 17},
                                           Case{GateKind::trimkv, 2, 6, 0, 3, 9}),  // the linear gate
                         [](const auto& info) {
                           const Case& c = info.param;
                           return fmt::format("{}_L{}_D{}_G{}_K{}_T{}", gate_kind_name(c.kind), c.L, c.D, c.G, c.K, c.T);
                         });

TEST(Gates, SharedGradientIsTheSumOverLayers) {
  const GateDims d{GateKind::dbtrimkv, 3, 6, 4, 2};
  RetentionGates g = random_gates(d, 31);
  std::mt19937_64 rng(9);
  std::vector<Tensor> hs, Rs;
  std::vector<GateActivations> saved(3);
  for (int64_t l = 0; l < 3; ++l) {
    hs.push_back(random_f32({9, 6}, 1.0, rng));
    Rs.push_back(random_f32({9, 2}, 1.0, rng));
    g.forward(l, hs.back(), &saved[size_t(l)]);
  }
  auto shared_grads = [&](std::vector<int64_t> layers) {
    g.zero_grad();
    for (int64_t l : layers) g.backward(l, hs[size_t(l)], saved[size_t(l)], Rs[size_t(l)]);
    std::vector<Mat> out;
    for (const GateParameter& p : g.parameters())
      if (p.shared()) out.push_back(to64(p.grad));
    return out;
  };
  const auto all = shared_grads({0, 1, 2});
  ASSERT_EQ(all.size(), 2u);
  std::vector<Mat> sum(2);
  for (int64_t l = 0; l < 3; ++l) {
    const auto one = shared_grads({l});
    for (size_t j = 0; j < 2; ++j) {
      sum[j].resize(one[j].size());
      double norm = 0;
      for (size_t i = 0; i < one[j].size(); ++i) sum[j][i] += one[j][i], norm += std::fabs(one[j][i]);
      EXPECT_GT(norm, 1e-3) << "layer " << l << " contributes to shared tensor " << j;
    }
  }
  for (size_t j = 0; j < 2; ++j)
    for (size_t i = 0; i < sum[j].size(); ++i) EXPECT_NEAR(all[j][i], sum[j][i], 1e-5 * (1 + std::fabs(sum[j][i])));
}

TEST(Gates, BackwardWithoutDhAndEmptyInput) {
  const GateDims d{GateKind::trimkv, 1, 4, 3, 2};
  RetentionGates g = random_gates(d, 2);
  GateActivations saved;
  const Tensor h = Tensor::empty({0, 4}, DType::F32);
  EXPECT_EQ(g.forward(0, h, &saved).shape(), (Shape{0, 2}));
  g.zero_grad();
  g.backward(0, h, saved, Tensor::empty({0, 2}, DType::F32));
  for (const GateParameter& p : g.parameters())
    for (int64_t i = 0; i < p.grad.numel(); ++i) EXPECT_EQ(p.grad.data<float>()[i], 0.0f);
  // Wrong input width is a clear error, not a crash.
  EXPECT_THROW(g.forward(0, Tensor::zeros({3, 5}, DType::F32)), Error);
}

TEST(Gates, CudaEntryPointsFailInOneLineWithoutADevice) {
  // The device mirror and the CUDA forward/backward (tests/cuda/test_gates_cuda.cpp on a GPU):
  // here only what must hold on any machine, GPU or not, and never touches device memory.
  const GateDims d{GateKind::trimkv, 1, 4, 3, 2};
  RetentionGates g = random_gates(d, 2);
  EXPECT_FALSE(g.has_device_mirror());
  const std::string early = test_support::one_line_error([&] { g.add_device_grads_to_host(); });
  EXPECT_TRUE(early.find("before any sync_to_device()") != std::string::npos ||
              early.find("built without CUDA") != std::string::npos)
      << early;
  // A tensor that claims to be on CUDA (host memory that is never read): forward without a
  // mirror and a mixed-device backward fail in their checks, before any access.
  std::vector<float> fake(3 * 4 * 2);
  const Tensor h_cuda = Tensor::view(fake.data(), {3, 4}, DType::F32, nullptr, Device::CUDA);
  const std::string fwd = test_support::one_line_error([&] { g.forward(0, h_cuda); });
  EXPECT_TRUE(fwd.find("sync_to_device() was never called") != std::string::npos ||
              fwd.find("built without CUDA") != std::string::npos)
      << fwd;
  std::mt19937_64 rng(5);
  const Tensor h = random_f32({3, 4}, 1.0, rng);
  GateActivations saved;
  g.forward(0, h, &saved);
  const Tensor dlb_cuda = Tensor::view(fake.data(), {3, 2}, DType::F32, nullptr, Device::CUDA);
  EXPECT_EQ(test_support::one_line_error([&] { g.backward(0, h, saved, dlb_cuda); }),
            "retention gate: dlog_beta is F32 [3, 2] on cuda, expected F32 [3, 2] on cpu");
  for (const GateParameter& p : g.parameters())
    for (int64_t i = 0; i < p.grad.numel(); ++i) EXPECT_EQ(p.grad.data<float>()[i], 0.0f) << p.name();
  if (cuda_built() && cuda_device_count() > 0)
    GTEST_SKIP() << "a CUDA device is present: sync_to_device() succeeds here (tests/cuda/test_gates_cuda.cpp)";
  const std::string sync = test_support::one_line_error([&] { g.sync_to_device(); });
  EXPECT_TRUE(sync.find("no CUDA device") != std::string::npos || sync.find("built without CUDA") != std::string::npos)
      << sync;
  EXPECT_FALSE(g.has_device_mirror());
}
