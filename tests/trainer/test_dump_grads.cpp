// retain-train --dump-grads against the float64 PyTorch autograd reference
// (tests/fixtures/trainer/make_fixtures.py, tests/trainer/trainer_reference.py): both gate
// kinds (and trimkv with --kl reverse, with --capacity global, the linear gate; dbtrimkv reading [k ‖ v]), document-masked batches with padding and non-target prompts, on one rank (one
// micro-batch of 4, and 4 micro-batches of 1: gradient accumulation) and on 2 ranks under
// mpirun. Every gate gradient within 1e-4 relative of the reference; the batch identical. The
// same dumps on a GPU are in test_train_cuda.cpp.
#include <gtest/gtest.h>

#include <string>

#include "kernels/tensor.h"
#include "data/formats/safetensors.h"
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
  // "trimkv", "dbtrimkv", "trimkv-reverse-kl" (--kl reverse), "trimkv-global-capacity" (--capacity global)
  // "trimkv-linear" (the linear gate, G = 0, from gates-trimkv-linear) or "dbtrimkv-kv" (gates reading
  // [k ‖ v], --gate-input kv, from gates-dbtrimkv-kv): the fixture's name; the gate kind before the '-'.
  const std::string fixture = std::get<0>(GetParam());
  const std::string kind = fixture.substr(0, fixture.find('-'));
  const bool kv = fixture.ends_with("-kv");  // gates reading [k ‖ v]: --gate-input kv
  const std::string gates_file =
      kind + (fixture.find("-linear") != std::string::npos ? "-linear" : "") + (kv ? "-kv" : "");
  const std::string kl = std::string(fixture.find("reverse-kl") != std::string::npos ? " --kl reverse" : "") +
                         (fixture.find("global-capacity") != std::string::npos ? " --capacity global" : "") +
                       (kv ? " --gate-input kv" : "");
  const Launch launch = std::get<1>(GetParam());
  TempDir dir;
  const std::string data = pack_fixture_corpus(dir);
  const std::string dump = dir / "dump.safetensors";
  const std::string args = " --model " + kModel + " --data " + data + " --gate " + kind + " --init-gates " + kFixtures +
                           "/gates-" + gates_file + ".safetensors --dump-grads " + dump +
                           " --memory 4 --global-batch 4 --seed 3 --loss-chunk 7 --micro-batch " +
                           std::to_string(launch.micro_batch) + kl;
  const std::string cmd = (launch.ranks > 1 ? mpirun(launch.ranks) : std::string()) + bin("retain-train") + args;
  const Result r = run(cmd, dir);
  ASSERT_EQ(r.code, 0) << cmd << "\n" << r.err;

  const formats::SafetensorsFile got = formats::SafetensorsFile::open(dump);
  const formats::SafetensorsFile want = formats::SafetensorsFile::open(kFixtures + "/expected-" + fixture + ".safetensors");
  const formats::SafetensorsFile init = formats::SafetensorsFile::open(kFixtures + "/gates-" + gates_file + ".safetensors");
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
    ::testing::Combine(::testing::Values("trimkv", "dbtrimkv", "trimkv-reverse-kl", "trimkv-global-capacity",
                                                          "trimkv-linear", "dbtrimkv-kv"),
                       ::testing::Values(Launch{"one_rank", 1, 4}, Launch{"accumulate", 1, 1},
                                         Launch{"two_ranks", 2, 2}, Launch{"two_ranks_accumulate", 2, 1})),
    [](const auto& info) {
      std::string kind = std::get<0>(info.param);
      for (char& c : kind)
        if (c == '-') c = '_';
      return kind + "_" + std::get<1>(info.param).name;
    });

}  // namespace
}  // namespace retain::trainer::test
