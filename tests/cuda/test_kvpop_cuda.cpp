// The CUDA KVPOP kernels (kernels/cuda/kvpop.cu) through the kvpop:: ops on CUDA tensors,
// against the CPU references on fresh random inputs per run (the seed is printed with every
// failure; RETAIN_TEST_SEED=n replays one): the future-attention target within the float32
// bound of tests/cuda/kvpop_cases.h; mlstm_scores and every output of mlstm_scores_backward
// within 2 float32 ulp (float64 on both sides); documents with padding, T not a multiple of 64,
// windows 1, 5, ≥ 64; bitwise repeatable; mixed devices, non-contiguous documents and too
// large head dims as one-line errors. Small/ cases are what compute-sanitizer runs.
// Skips (visibly) without a CUDA build or device. Not yet run: no GPU has been lent.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "tests/cuda/cuda_test.h"
#include "tests/error_helpers.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kernels/kvpop.h"
#include "kernels/tensor.h"
#include "tests/cuda/kvpop_cases.h"

using namespace retain;
using namespace retain::kvpop_cuda_test;

namespace {

Tensor on_gpu(const Tensor& t) { return t.to(Device::CUDA); }

kvpop::Projected on_gpu(const kvpop::Projected& P) {
  return {on_gpu(P.q), on_gpu(P.k), on_gpu(P.v), on_gpu(P.igate), on_gpu(P.log_f)};
}

// Fails without a device: run_sanitizer.sh uses it to skip (exit 77) on machines without one.
TEST(KvpopCuda, DISABLED_DevicePresent) { ASSERT_GT(cuda_device_count(), 0); }

// A case's inputs on both devices and the CPU reference target (seed printed by the caller's
// trace through `seed`).
struct TargetProblem {
  uint32_t seed;
  std::mt19937 rng;
  TargetInputs in;
  Tensor q, k, doc, q_d, k_d, lse_d, doc_d;
  Vec want;
  explicit TargetProblem(const TargetCase& c)
      : seed(cuda_test::fresh_seed()),
        rng(seed),
        in(make_target_inputs(c, rng)),
        q(f32(in.q, {c.T, c.H, c.hd})),
        k(f32(in.k, {c.T, c.K, c.hd})),
        doc(i32(in.doc)),
        q_d(on_gpu(q)),
        k_d(on_gpu(k)),
        lse_d(on_gpu(in.lse)),
        doc_d(on_gpu(doc)),
        want(to_vec(kvpop::future_attention_target(q, k, in.lse, doc, c.w, in.scale))) {}
};

class KvpopCudaTarget : public ::testing::TestWithParam<TargetCase> {};

TEST_P(KvpopCudaTarget, MatchesTheCpuReference) {
  SKIP_WITHOUT_GPU();
  const TargetCase c = GetParam();
  TargetProblem p(c);
  SCOPED_TRACE(::testing::Message() << "seed " << p.seed);
  const TargetInputs& in = p.in;
  const Tensor &q_d = p.q_d, &k_d = p.k_d, &lse_d = p.lse_d, &doc_d = p.doc_d;
  const Vec& want = p.want;
  const Tensor got = kvpop::future_attention_target(q_d, k_d, lse_d, doc_d, c.w, in.scale);
  ASSERT_EQ(got.device(), Device::CUDA);
  ASSERT_EQ(got.shape(), (Shape{c.K, c.T}));
  const Vec g = host_vec(got);
  expect_target_close(in, g, want, "CUDA target");
  EXPECT_EQ(host_vec(kvpop::future_attention_target(q_d, k_d, lse_d, doc_d, c.w, in.scale)), g) << "not repeatable";
}

// The target by spans (context parallelism's query ring): the sequence cut into chunks of odd
// lengths (documents across the cuts), every key chunk's running sums fed every query chunk
// (earlier, its own, later: in a shuffled order) on the device, finished there, and put
// together: the whole CPU target within the same bound.
TEST_P(KvpopCudaTarget, SpansEqualTheWhole) {
  SKIP_WITHOUT_GPU();
  const TargetCase c = GetParam();
  TargetProblem p(c);
  SCOPED_TRACE(::testing::Message() << "seed " << p.seed);
  const TargetInputs& in = p.in;
  const Tensor &q_d = p.q_d, &k_d = p.k_d, &lse_d = p.lse_d, &doc_d = p.doc_d;
  std::vector<int64_t> cuts = {0, c.T};
  for (int64_t at : {c.T / 3, c.T / 3 + 1, (2 * c.T) / 3 + 5})
    if (at > 0 && at < c.T) cuts.push_back(at);
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  Vec got(static_cast<size_t>(c.K * c.T), 0.0);
  for (size_t ki = 0; ki + 1 < cuts.size(); ++ki) {
    const int64_t k0 = cuts[ki], k1 = cuts[ki + 1];
    auto [mx, sum] = kvpop::future_attention_start(k1 - k0, c.H, Device::CUDA);
    std::vector<size_t> order(cuts.size() - 1);
    for (size_t x = 0; x < order.size(); ++x) order[x] = x;
    std::shuffle(order.begin(), order.end(), p.rng);
    for (size_t qi : order) {
      const int64_t q0 = cuts[qi], q1 = cuts[qi + 1];
      kvpop::future_attention_sums(q_d.rows(q0, q1), lse_d.rows(q0, q1), doc_d.rows(q0, q1), q0, k_d.rows(k0, k1),
                                   doc_d.rows(k0, k1), k0, c.w, in.scale, mx, sum);
    }
    const Tensor part = kvpop::future_attention_finish(mx, sum, c.K);
    ASSERT_EQ(part.device(), Device::CUDA);
    const Vec p = host_vec(part);
    for (int64_t kv = 0; kv < c.K; ++kv)
      for (int64_t t = k0; t < k1; ++t) got[static_cast<size_t>(kv * c.T + t)] = p[static_cast<size_t>(kv * (k1 - k0) + t - k0)];
  }
  expect_target_close(in, got, p.want, "CUDA target by spans");
}

const auto kSmallTargets = ::testing::Values(TargetCase{1, 1, 1, 8, 1, 1}, TargetCase{63, 2, 1, 16, 1, 20},
                                             TargetCase{200, 4, 2, 32, 5, 90}, TargetCase{257, 6, 3, 64, 64, 300},
                                             TargetCase{300, 2, 1, 128, 70, 1000});
// Qwen3-4B's heads (32 query, 8 KV, head_dim 128) over one long document, and many documents.
const auto kLargeTargets = ::testing::Values(TargetCase{2049, 32, 8, 128, 64, 100000}, TargetCase{3000, 8, 2, 128, 5, 400},
                                             TargetCase{1500, 4, 4, 256, 130, 900});
auto target_name = [](const ::testing::TestParamInfo<TargetCase>& info) {
  const TargetCase& c = info.param;
  return fmt::format("T{}_H{}_K{}_hd{}_w{}", c.T, c.H, c.K, c.hd, c.w);
};
INSTANTIATE_TEST_SUITE_P(Small, KvpopCudaTarget, kSmallTargets, target_name);
INSTANTIATE_TEST_SUITE_P(Large, KvpopCudaTarget, kLargeTargets, target_name);

class KvpopCudaMlstm : public ::testing::TestWithParam<MlstmCase> {};

TEST_P(KvpopCudaMlstm, ForwardAndBackwardMatchTheCpuReference) {
  SKIP_WITHOUT_GPU();
  const MlstmCase c = GetParam();
  const uint32_t seed = cuda_test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const MlstmInputs in = make_mlstm_inputs(c, rng);
  const MlstmResult want = reference_mlstm(in, c.w);
  const kvpop::Projected P = on_gpu(in.P);
  const Tensor doc = on_gpu(i32(in.doc)), w_o = on_gpu(in.w_o), b_o = on_gpu(in.b_o), ds = on_gpu(in.dscore);
  auto run = [&] {
    MlstmResult r;
    r.score = kvpop::mlstm_scores(P, doc, c.w, w_o, b_o);
    r.dP = kvpop::mlstm_scores_backward(P, doc, c.w, w_o, b_o, ds, r.dw_o, r.db_o);
    return r;
  };
  const MlstmResult got = run();
  for (const Tensor* t : {&got.score, &got.dP.q, &got.dP.k, &got.dP.v, &got.dP.igate, &got.dP.log_f, &got.dw_o, &got.db_o})
    ASSERT_EQ(t->device(), Device::CUDA);
  std::printf("CUDA mlstm vs CPU reference (%s):\n", ::testing::PrintToString(c).c_str());
  expect_mlstm_result(got, want);
  const MlstmResult again = run();
  for (auto [a, b] : {std::pair{&got.score, &again.score}, std::pair{&got.dP.q, &again.dP.q}, std::pair{&got.dP.k, &again.dP.k},
                      std::pair{&got.dP.v, &again.dP.v}, std::pair{&got.dP.igate, &again.dP.igate},
                      std::pair{&got.dP.log_f, &again.dP.log_f}, std::pair{&got.dw_o, &again.dw_o},
                      std::pair{&got.db_o, &again.db_o}})
    EXPECT_EQ(host_vec(*a), host_vec(*b)) << "not repeatable";
}

const auto kSmallMlstm = ::testing::Values(MlstmCase{1, 4, 1, 1, false}, MlstmCase{63, 4, 1, 90, false},
                                           MlstmCase{200, 4, 5, 90, false}, MlstmCase{300, 4, 70, 400, false},
                                           MlstmCase{150, 8, 3, 30, false}, MlstmCase{300, 64, 5, 200, false});
// The real model's r = 64 over many chunks, extreme gates, and d = 256 (the kernels' largest).
const auto kLargeMlstm = ::testing::Values(MlstmCase{4097, 64, 64, 3000, false}, MlstmCase{3000, 4, 130, 100000, true},
                                           MlstmCase{2000, 8, 1, 100000, true}, MlstmCase{700, 128, 9, 500, false});
auto mlstm_name = [](const ::testing::TestParamInfo<MlstmCase>& info) {
  const MlstmCase& c = info.param;
  return fmt::format("T{}_r{}_w{}{}", c.T, c.r, c.w, c.extreme ? "_extreme" : "");
};
INSTANTIATE_TEST_SUITE_P(Small, KvpopCudaMlstm, kSmallMlstm, mlstm_name);
INSTANTIATE_TEST_SUITE_P(Large, KvpopCudaMlstm, kLargeMlstm, mlstm_name);

TEST(KvpopCuda, BadInputsAreOneLineErrors) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  const MlstmInputs in = make_mlstm_inputs(MlstmCase{40, 4, 3, 10, false}, rng);
  const kvpop::Projected P = on_gpu(in.P);
  const Tensor doc = on_gpu(i32(in.doc)), w_o = on_gpu(in.w_o), b_o = on_gpu(in.b_o);
  // Mixed devices are refused, not silently copied.
  test_support::expect_one_line_error([&] { kvpop::mlstm_scores(P, i32(in.doc), 3, w_o, b_o); }, "one device");
  test_support::expect_one_line_error([&] { kvpop::mlstm_scores(P, doc, 3, in.w_o, b_o); }, "one device");
  Tensor dw_o, db_o;
  test_support::expect_one_line_error([&] { kvpop::mlstm_scores_backward(P, doc, 3, w_o, b_o, in.dscore, dw_o, db_o); }, "one device");
  // A document that reappears is found on the device tensor too.
  std::vector<int32_t> bad(40, 0);
  for (int64_t t = 10; t < 20; ++t) bad[t] = 1;
  test_support::expect_one_line_error([&] { kvpop::mlstm_scores(P, on_gpu(i32(bad)), 3, w_o, b_o); }, "reappears at token 20");
  // d = 2r above the readout blocks' static arrays.
  const MlstmInputs wide = make_mlstm_inputs(MlstmCase{8, 160, 1, 8, true}, rng);
  test_support::expect_one_line_error([&] { kvpop::mlstm_scores(on_gpu(wide.P), on_gpu(i32(wide.doc)), 1, on_gpu(wide.w_o), on_gpu(wide.b_o)); },
               "limit 256");
  // The target: mixed devices, and a head_dim beyond the device's shared memory per block.
  const Tensor q = on_gpu(f32(randn(40 * 2 * 8, rng), {40, 2, 8})), k = on_gpu(f32(randn(40 * 8, rng), {40, 1, 8}));
  const Tensor lse = on_gpu(Tensor::zeros({40, 2}, DType::F32));
  test_support::expect_one_line_error([&] { kvpop::future_attention_target(q, k, lse, i32(in.doc), 3, 0.3f); }, "one device");
  const Tensor q_wide = on_gpu(Tensor::zeros({4, 1, 4096}, DType::F32)), k_wide = on_gpu(Tensor::zeros({4, 1, 4096}, DType::F32));
  test_support::expect_one_line_error([&] { kvpop::future_attention_target(q_wide, k_wide, on_gpu(Tensor::zeros({4, 1}, DType::F32)),
                                                    on_gpu(i32({0, 0, 0, 0})), 1, 0.1f); },
               "shared memory");
  // The ops without CUDA kernels keep their clear error.
  test_support::expect_one_line_error([&] { kvpop::select_decisions(on_gpu(Tensor::zeros({40}, DType::F32)), doc, 3, 4, 2); },
               "no CUDA implementation");
}

}  // namespace
