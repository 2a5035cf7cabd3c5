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

#include "tests/cuda/attention_cases.h"
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
using namespace attention_cases;

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
