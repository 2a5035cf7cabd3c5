// retain-train --dump-grads against the float64 PyTorch autograd reference
// (tests/fixtures/trainer/make_fixtures.py, tests/trainer/trainer_reference.py): both gate
// kinds, document-masked batches with padding and non-target prompts, on one rank (one
// micro-batch of 4, and 4 micro-batches of 1: gradient accumulation) and on 2 ranks under
// mpirun. Every gate gradient within 1e-4 relative of the reference; the batch identical. On a
// GPU (DumpGradsCuda, skips without one): cuda vs the reference, 2 ranks sharing the GPU and
// 1 rank over NCCL vs 1 rank.
#include <gtest/gtest.h>

#include <string>

#include "kernels/tensor.h"
#include "model/safetensors.h"
#include "tests/trainer/train_helpers.h"

namespace retain::trainer::test {
namespace {

struct Launch {
  const char* name;
  int ranks;
  int micro_batch;
};

class DumpGrads : public ::testing::TestWithParam<std::tuple<const char*, Launch>> {};

TEST_P(DumpGrads, MatchesAutogradReference) {
  const std::string kind = std::get<0>(GetParam());
  const Launch launch = std::get<1>(GetParam());
  TempDir dir;
  const std::string data = pack_fixture_corpus(dir);
  const std::string dump = dir / "dump.safetensors";
  const std::string args = " --model " + kModel + " --data " + data + " --gate " + kind + " --init-gates " + kFixtures +
                           "/gates-" + kind + ".safetensors --dump-grads " + dump +
                           " --memory 4 --global-batch 4 --seed 3 --loss-chunk 7 --micro-batch " +
                           std::to_string(launch.micro_batch);
  const std::string cmd = (launch.ranks > 1 ? mpirun(launch.ranks) : std::string()) + bin("retain-train") + args;
  const Result r = run(cmd, dir);
  ASSERT_EQ(r.code, 0) << cmd << "\n" << r.err;

  const SafetensorsFile got = SafetensorsFile::open(dump);
  const SafetensorsFile want = SafetensorsFile::open(kFixtures + "/expected-" + kind + ".safetensors");
  const SafetensorsFile init = SafetensorsFile::open(kFixtures + "/gates-" + kind + ".safetensors");
  for (const char* b : {"batch/input_ids", "batch/doc_ids", "batch/target_mask"})
    EXPECT_TRUE(bytes_equal(got.tensor(b), want.tensor(b))) << b;
  int grads = 0;
  for (const std::string& name : want.names()) {
    if (name.rfind("grad/", 0) != 0) continue;
    ++grads;
    const std::string param = name.substr(5);
    ASSERT_TRUE(got.contains(name)) << name;
    EXPECT_TRUE(bytes_equal(got.tensor(param), init.tensor(param))) << param << " is not the --init-gates value";
    EXPECT_EQ(got.tensor(name).dtype(), DType::F32) << name;
    const double e = rel_diff(got.tensor(name), want.tensor(name));
    EXPECT_LE(e, 1e-4) << name;
    RecordProperty(name, std::to_string(e));
  }
  EXPECT_EQ(grads, static_cast<int>(init.names().size()));
  for (const char* l : {"loss/total", "loss/kl", "loss/ntp", "loss/cap"}) {
    EXPECT_EQ(got.tensor(l).numel(), 1) << l;
    EXPECT_LE(rel_diff(got.tensor(l), want.tensor(l)), 1e-5) << l;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, DumpGrads,
    ::testing::Combine(::testing::Values("trimkv", "dbtrimkv"),
                       ::testing::Values(Launch{"one_rank", 1, 4}, Launch{"accumulate", 1, 1},
                                         Launch{"two_ranks", 2, 2}, Launch{"two_ranks_accumulate", 2, 1})),
    [](const auto& info) {
      return std::string(std::get<0>(info.param)) + "_" + std::get<1>(info.param).name;
    });


// ---- on a GPU (skips without one) ----------------------------------------------------------------
// The same dumps with --device cuda: one rank against the float64 reference at bf16 tolerance;
// two ranks sharing the GPU (--comm mpi: FSDP-sharded bf16 weights gathered through the host)
// and one rank over NCCL against the one-rank GPU dump, which computes the same bf16 math.

// retain-train --dump-grads on cuda under `launch` with `extra` arguments; the dump's path,
// or "" (with the reason in *why) when it failed.
std::string cuda_dump(const std::string& kind, const std::string& data, const std::string& launch,
                      const std::string& extra, TempDir& dir, const std::string& name, std::string* why) {
  const std::string dump = dir / (name + ".safetensors");
  const std::string args = " --model " + kModel + " --data " + data + " --gate " + kind + " --init-gates " + kFixtures +
                           "/gates-" + kind + ".safetensors --dump-grads " + dump +
                           " --memory 4 --global-batch 4 --seed 3 --loss-chunk 7 --device cuda " + extra;
  const Result r = run(launch + bin("retain-train") + args, dir);
  if (r.code == 0) return dump;
  *why = r.err;
  return "";
}

void expect_close_dumps(const std::string& got_path, const std::string& want_path, double tol, const std::string& what) {
  const SafetensorsFile got = SafetensorsFile::open(got_path), want = SafetensorsFile::open(want_path);
  int compared = 0;
  for (const std::string& name : want.names()) {
    if (name.rfind("grad/", 0) != 0 && name.rfind("loss/", 0) != 0) continue;
    ++compared;
    ASSERT_TRUE(got.contains(name)) << what << ": " << name;
    const double e = rel_diff(got.tensor(name), want.tensor(name));
    EXPECT_LE(e, tol) << what << ": " << name;
    ::testing::Test::RecordProperty(what + ": " + name, std::to_string(e));
  }
  EXPECT_GT(compared, 4) << what;
}

class DumpGradsCuda : public ::testing::TestWithParam<const char*> {};

TEST_P(DumpGradsCuda, RanksAndBackendsAgree) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const std::string kind = GetParam();
  TempDir dir;
  const std::string data = pack_fixture_corpus(dir);
  std::string why;
  const std::string one = cuda_dump(kind, data, "", "--micro-batch 4", dir, "one_rank", &why);
  ASSERT_FALSE(one.empty()) << why;
  // bf16 weights and activations against float64: the GPU step's tolerance (tests/cuda/test_step_cuda.cpp).
  expect_close_dumps(one, kFixtures + "/expected-" + kind + ".safetensors", 3e-2, "cuda vs float64");

  // The same bf16 math in other micro-batch shapes and summation orders: 1e-3.
  const std::string two = cuda_dump(kind, data, mpirun(2), "--comm mpi --micro-batch 1", dir, "two_ranks_mpi", &why);
  ASSERT_FALSE(two.empty()) << why;
  expect_close_dumps(two, one, 1e-3, "2 ranks sharing the GPU (mpi, FSDP staged) vs 1 rank");

  // One rank over NCCL: the same computation; only the reductions go through NCCL.
  const std::string nccl = cuda_dump(kind, data, "", "--comm nccl --micro-batch 4", dir, "one_rank_nccl", &why);
  if (nccl.empty() && why.find("no NCCL backend") != std::string::npos) GTEST_SKIP() << "built without NCCL";
  ASSERT_FALSE(nccl.empty()) << why;
  expect_close_dumps(nccl, one, 0, "1 rank over nccl vs 1 rank");
}

INSTANTIATE_TEST_SUITE_P(Kinds, DumpGradsCuda, ::testing::Values("trimkv", "dbtrimkv"));

}  // namespace
}  // namespace retain::trainer::test
