// RetentionGates forward/backward on CUDA tensors (the device mirror, ops::linear* GEMMs and
// kernels/cuda/gates.cu) against the same gates on CPU tensors, on fresh random gates and inputs
// per run (the seed is printed with every failure; RETAIN_TEST_SEED=n replays one): trimkv (MLP and linear) and
// dbtrimkv, logβ and the saved activations, the parameter gradients after
// add_device_grads_to_host() (a shared dbtrimkv tensor summed over layers) and dh; bitwise
// repeatability; sync semantics; the missing-sync and mixed-device errors. Shapes are small:
// compute-sanitizer runs the whole suite.
//
// Bounds. Both sides are float32 evaluations of the same sums in different orders (cuBLASLt vs
// OpenBLAS blocking, FMA) with CUDA's expf/log1pf (≤ 2 ulp) for glibc's; the elementwise math is
// otherwise the same sequence of roundings (tests/cuda/test_gates_rows.cpp proves it bit for
// bit). Each side is within 2e-5·max(1, |logβ|) of float64 for logβ and 1e-4 of each tensor's
// largest entry for gradients: tests/gates/test_gates.cpp holds the CPU to exactly these against
// float64 and finite differences. So GPU vs CPU: logβ within 4e-5·max(1, |logβ|); activations,
// gradients and dh within 2e-4 of the largest |entry| of the CPU tensor. For inner lengths n ≤ 600
// (the T of these cases), float32 sums err by about √n·u·(Σ|terms|) in practice (u = 2^-24),
// two orders of magnitude inside these bounds.
// Skips (visibly) without a CUDA build or device. NOT YET RUN: no GPU has been lent.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "model/gates/gates.h"
#include "tests/cuda/cuda_test.h"
#include "tests/error_helpers.h"

using namespace retain;
using namespace retain::gates;

namespace {

Tensor gpu(const Tensor& t) { return t.to(Device::CUDA); }
Tensor host(const Tensor& t) { return t.on(Device::CPU); }

Tensor random_f32(const Shape& shape, double std, std::mt19937& rng) {
  std::normal_distribution<double> n(0, std);
  Tensor t = Tensor::empty(shape, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(n(rng));
  return t;
}

// O(1) random weights; logit biases from very negative to large positive (every layer sees
// both), so that z covers where a naive log(sigmoid(z)) breaks.
RetentionGates random_gates(const GateDims& d, std::mt19937& rng) {
  RetentionGates g = RetentionGates::init(d, 0.0, rng());
  const double biases[] = {-60.0, 0.7, 35.0, -3.0, 2.0};
  int64_t offset = 0;
  for (GateParameter& p : g.parameters()) {
    Tensor v = random_f32(p.value.shape(), p.value.ndim() == 2 ? 1.5 / std::sqrt(double(p.value.dim(1))) : 0.5, rng);
    if (p.name().ends_with("retention_gate.bias")) {
      for (int64_t k = 0; k < v.numel(); ++k) v.data<float>()[k] = static_cast<float>(biases[(k + offset) % 5]);
      offset += 2;
    }
    p.value.copy_from(v);
  }
  return g;
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(double(t.data<float>()[i])));
  return m;
}

// |got − want| ≤ rel·max|want| everywhere (the first violation is reported).
void expect_close_scaled(const Tensor& got_any, const Tensor& want, double rel, const std::string& what) {
  const Tensor got = host(got_any);
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const double tol = rel * std::max(max_abs(want), 1e-30);
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double a = got.data<float>()[i], b = want.data<float>()[i];
    if (!(std::fabs(a - b) <= tol)) {
      ADD_FAILURE() << what << " [" << i << "]: cuda " << a << " cpu " << b << " tol " << tol;
      return;
    }
  }
}

void expect_log_beta_close(const Tensor& got_any, const Tensor& want, const std::string& what) {
  const Tensor got = host(got_any);
  ASSERT_EQ(got.shape(), want.shape()) << what;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double a = got.data<float>()[i], b = want.data<float>()[i];
    ASSERT_LE(a, 0.0) << what << " [" << i << "]";
    if (!(std::fabs(a - b) <= 4e-5 * std::max(1.0, std::fabs(b)))) {
      ADD_FAILURE() << what << " [" << i << "]: cuda " << a << " cpu " << b;
      return;
    }
  }
}

bool same_bits(const Tensor& a_any, const Tensor& b_any) {
  const Tensor a = host(a_any), b = host(b_any);
  return a.shape() == b.shape() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}


struct Case {
  GateKind kind;
  int64_t L, D, G, K;
  std::vector<int64_t> Ts;  // per layer
};

std::vector<Case> cases() {
  return {{GateKind::trimkv, 3, 64, 32, 4, {300, 1, 600}},
          {GateKind::trimkv, 1, 40, 24, 1, {0}},
          {GateKind::trimkv, 2, 48, 0, 4, {129, 3}},  // the linear gate (G = 0)
          {GateKind::dbtrimkv, 3, 48, 40, 8, {257, 37, 512}},
          {GateKind::dbtrimkv, 2, 16, 8, 2, {5, 0}}};
}

std::string name_of(const Case& c) { return fmt::format("{} L{} D{} G{} K{}", gate_kind_name(c.kind), c.L, c.D, c.G, c.K); }

// One pass over every layer on the device: logβ and activations per layer, dh per layer, and the
// parameter gradients (CPU, after add_device_grads_to_host into zeroed gradients).
struct DeviceRun {
  std::vector<Tensor> log_beta, a1, a2, z, dh;
  std::vector<Tensor> grads;
};

DeviceRun run_on_device(RetentionGates& g, const std::vector<Tensor>& hs, const std::vector<Tensor>& dlbs,
                        const std::vector<Tensor>& dh0s) {
  DeviceRun r;
  g.zero_grad();
  g.sync_to_device();
  for (size_t l = 0; l < hs.size(); ++l) {
    GateActivations saved;
    const Tensor h = gpu(hs[l]);
    r.log_beta.push_back(host(g.forward(static_cast<int64_t>(l), h, &saved)));
    if (!g.is_linear()) {
      EXPECT_EQ(saved.a1.device(), Device::CUDA);
    }
    EXPECT_EQ(saved.z.device(), Device::CUDA);
    Tensor dh = gpu(dh0s[l]);
    g.backward(static_cast<int64_t>(l), h, saved, gpu(dlbs[l]), &dh);
    r.a1.push_back(g.is_linear() ? Tensor() : host(saved.a1));
    r.a2.push_back(g.kind() == GateKind::dbtrimkv ? host(saved.a2) : Tensor());
    r.z.push_back(host(saved.z));
    r.dh.push_back(host(dh));
  }
  g.add_device_grads_to_host();
  for (const GateParameter& p : g.parameters()) r.grads.push_back(p.grad.clone());
  return r;
}

class GatesCuda : public cuda_test::SeededTest {};

}  // namespace

// Fails without a device: run_sanitizer.sh uses it to skip (exit 77) on machines without one.
TEST_F(GatesCuda, DISABLED_DevicePresent) { ASSERT_GT(cuda_device_count(), 0); }

TEST_F(GatesCuda, ForwardAndBackwardMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  for (const Case& c : cases()) {
    const GateDims d{c.kind, c.L, c.D, c.G, c.K};
    RetentionGates g = random_gates(d, rng_);
    std::vector<Tensor> hs, dlbs, dh0s;
    for (int64_t T : c.Ts) {
      hs.push_back(random_f32({T, c.D}, 1.0, rng_));
      dlbs.push_back(random_f32({T, c.K}, 1.0, rng_));
      dh0s.push_back(random_f32({T, c.D}, 1.0, rng_));  // backward must ADD into dh
    }
    // The CPU, every layer accumulating into the gradients.
    g.zero_grad();
    std::vector<Tensor> want_lb, want_dh;
    std::vector<GateActivations> want_saved(hs.size());
    for (size_t l = 0; l < hs.size(); ++l) {
      want_lb.push_back(g.forward(static_cast<int64_t>(l), hs[l], &want_saved[l]));
      Tensor dh = dh0s[l].clone();
      g.backward(static_cast<int64_t>(l), hs[l], want_saved[l], dlbs[l], &dh);
      want_dh.push_back(dh);
    }
    std::vector<Tensor> want_grads;
    for (const GateParameter& p : g.parameters()) want_grads.push_back(p.grad.clone());

    const DeviceRun got = run_on_device(g, hs, dlbs, dh0s);
    for (size_t l = 0; l < hs.size(); ++l) {
      const std::string where = fmt::format("{} layer {} T {}", name_of(c), l, hs[l].dim(0));
      expect_log_beta_close(got.log_beta[l], want_lb[l], "logβ " + where);
      if (c.G > 0) {
        expect_close_scaled(got.a1[l], want_saved[l].a1, 2e-4, "a1 " + where);
      }
      expect_close_scaled(got.z[l], want_saved[l].z, 2e-4, "z " + where);
      if (c.kind == GateKind::dbtrimkv) expect_close_scaled(got.a2[l], want_saved[l].a2, 2e-4, "a2 " + where);
      expect_close_scaled(got.dh[l], want_dh[l], 2e-4, "dh " + where);
    }
    for (size_t i = 0; i < want_grads.size(); ++i)
      expect_close_scaled(got.grads[i], want_grads[i], 2e-4, name_of(c) + " gradient " + g.parameters()[i].name());

    // Bitwise repeatable: a second pass from a fresh sync gives the same bits.
    const DeviceRun again = run_on_device(g, hs, dlbs, dh0s);
    for (size_t l = 0; l < hs.size(); ++l) {
      EXPECT_TRUE(same_bits(again.log_beta[l], got.log_beta[l])) << name_of(c) << " logβ layer " << l;
      EXPECT_TRUE(same_bits(again.dh[l], got.dh[l])) << name_of(c) << " dh layer " << l;
    }
    for (size_t i = 0; i < want_grads.size(); ++i)
      EXPECT_TRUE(same_bits(again.grads[i], got.grads[i])) << name_of(c) << " " << g.parameters()[i].name();
  }
}

TEST_F(GatesCuda, MirrorFollowsSyncAndMovesGradientsOnce) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  const GateDims d{GateKind::dbtrimkv, 2, 16, 8, 2};
  RetentionGates g = random_gates(d, rng_);
  const Tensor h = random_f32({9, 16}, 1.0, rng_), hd = gpu(h), dlb = gpu(random_f32({9, 2}, 1.0, rng_));
  g.sync_to_device();
  const Tensor before = host(g.forward(1, hd));
  // A CPU change is invisible until the next sync (the trainer syncs after every optimizer step).
  GateParameter& b = g.parameters().back();  // the shared logit bias
  ASSERT_TRUE(b.name().ends_with("retention_gate.bias"));
  for (int64_t k = 0; k < b.value.numel(); ++k) b.value.data<float>()[k] -= 5.0f;
  EXPECT_TRUE(same_bits(g.forward(1, hd), before));
  g.sync_to_device();
  expect_log_beta_close(g.forward(1, hd), g.forward(1, h), "after sync");
  // Gradients move to the CPU once: the second add finds the mirror zeroed.
  GateActivations saved;
  g.forward(0, hd, &saved);
  g.backward(0, hd, saved, dlb);
  g.zero_grad();
  g.add_device_grads_to_host();
  std::vector<Tensor> first;
  for (const GateParameter& p : g.parameters()) first.push_back(p.grad.clone());
  EXPECT_GT(max_abs(first.back()), 0.0);
  g.add_device_grads_to_host();
  for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(same_bits(g.parameters()[i].grad, first[i])) << i;
  // sync_to_device zeroes the mirror gradients too.
  g.backward(0, hd, saved, dlb);
  g.sync_to_device();
  g.add_device_grads_to_host();
  for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(same_bits(g.parameters()[i].grad, first[i])) << i;
}

TEST_F(GatesCuda, MissingSyncAndMixedDevicesAreOneLineErrors) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  const GateDims d{GateKind::trimkv, 1, 8, 6, 2};
  RetentionGates g = random_gates(d, rng_);
  const Tensor h = random_f32({4, 8}, 1.0, rng_), hd = gpu(h), dlb = random_f32({4, 2}, 1.0, rng_);
  EXPECT_NE(test_support::one_line_error([&] { g.forward(0, hd); }).find("sync_to_device() was never called"), std::string::npos);
  EXPECT_NE(test_support::one_line_error([&] { g.add_device_grads_to_host(); }).find("before any sync_to_device()"), std::string::npos);
  g.sync_to_device();
  GateActivations saved;
  g.forward(0, hd, &saved);
  // A copy has no mirror of its own (it would share and overwrite this one's).
  RetentionGates copy = g;
  EXPECT_FALSE(copy.has_device_mirror());
  EXPECT_NE(test_support::one_line_error([&] { copy.backward(0, hd, saved, gpu(dlb)); }).find("sync_to_device() was never called"),
            std::string::npos);
  EXPECT_EQ(test_support::one_line_error([&] { g.backward(0, hd, saved, dlb); }),
            "retention gate: dlog_beta is F32 [4, 2] on cpu, expected F32 [4, 2] on cuda");
  Tensor dh_cpu = Tensor::zeros({4, 8}, DType::F32);
  EXPECT_EQ(test_support::one_line_error([&] { g.backward(0, hd, saved, gpu(dlb), &dh_cpu); }),
            "retention gate: dh is F32 [4, 8] on cpu, expected F32 [4, 8] on cuda");
  EXPECT_EQ(test_support::one_line_error([&] { g.backward(0, h, saved, dlb); }),
            "retention gate: saved a1 is F32 [4, 6] on cuda, expected F32 [4, 6] on cpu");
  // Nothing was added by the failed calls.
  g.zero_grad();
  g.add_device_grads_to_host();
  for (const GateParameter& p : g.parameters()) EXPECT_EQ(max_abs(p.grad), 0.0) << p.name();
}
