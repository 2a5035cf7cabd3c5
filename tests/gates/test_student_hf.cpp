// The student (retention-gated) Qwen3 forward against an independent float64 reference:
// transformers' Qwen3ForCausalLM in float64 with the gates and the gated attention written in
// torch (tests/fixtures/gates/make_fixtures.py), on document-masked inputs, for both gate
// kinds, gate files in F32/BF16/F16, GQA 1/2/4, YaRN, a sharded checkpoint. Also through
// `retain-forward --gates` as a process, and the teacher path (no gates) against the same
// float64 reference.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <sstream>

#include "kernels/base/atomic_file.h"
#include "model/gates/gates.h"
#include "model/qwen3.h"
#include "data/formats/safetensors.h"
#include "model/weights.h"
#include "tests/fixture_helpers.h"

using namespace retain;
namespace fs = std::filesystem;

namespace {

const fs::path kRoot = fs::path(RETAIN_FIXTURES_DIR) / "gates";

using retain::test_support::as_i32;
using retain::test_support::rel_diff;
std::vector<std::string> fixture_cases() { return retain::test_support::fixture_cases("gates"); }

std::string joined(const Tensor& t) {
  std::ostringstream s;
  for (int64_t i = 0; i < t.numel(); ++i) s << (i ? " " : "") << t.data<int32_t>()[i];
  return s.str();
}

struct Fixture {
  formats::SafetensorsFile expected;
  std::shared_ptr<const Qwen3Checkpoint> ckpt;
  gates::RetentionGates gates;
  Tensor ids, docs;
  fs::path model_dir, gates_path;
};

Fixture open_case(const std::string& name) {
  const fs::path dir = kRoot / name;
  formats::SafetensorsFile expected = formats::SafetensorsFile::open((dir / "expected.safetensors").string());
  const fs::path model_dir = fs::path(RETAIN_FIXTURES_DIR) / expected.metadata().at("model");
  auto ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(model_dir.string()));
  const auto kind = gates::parse_gate_kind(expected.metadata().at("gate_kind"));
  gates::RetentionGates g = gates::RetentionGates::load((dir / "gates.safetensors").string(), ckpt->config(), kind);
  const Tensor ids = as_i32(expected.tensor("input_ids")), docs = as_i32(expected.tensor("doc_ids"));
  return {std::move(expected), ckpt, std::move(g), ids, docs, model_dir, dir / "gates.safetensors"};
}

class StudentHf : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST(StudentHf, FixturesArePresent) {
  // Both kinds; gate files in F32, BF16 and F16; GQA 1, 2 and 4.
  EXPECT_GE(fixture_cases().size(), 4u) << "tests/fixtures/gates is missing cases";
}

TEST_P(StudentHf, LogitsMatchFloat64Reference) {
  Fixture f = open_case(GetParam());
  LocalWeightProvider weights(f.ckpt);
  const double student = rel_diff(qwen3_forward(weights, f.ids, f.docs, {}, &f.gates), f.expected.tensor("logits"));
  const double teacher = rel_diff(qwen3_forward(weights, f.ids, f.docs), f.expected.tensor("logits_teacher"));
  // The references are float64; our forward is float32 throughout (observed ~1e-6).
  EXPECT_LT(student, 1e-4) << GetParam() << ": student";
  EXPECT_LT(teacher, 1e-4) << GetParam() << ": teacher";
  // The gating must matter, or the comparison above proves nothing about it.
  const double effect = rel_diff(f.expected.tensor("logits_teacher"), f.expected.tensor("logits"));
  EXPECT_GT(effect, 0.1) << GetParam();
  std::printf("[ %s ] rel diff vs float64: student %.2e, teacher %.2e (student vs teacher %.3f)\n", GetParam().c_str(),
              student, teacher, effect);
}

TEST_P(StudentHf, GatesThatKeepEverythingGiveTheTeacher) {
  // b = +200 makes logβ = −log1p(e^−200) = −0 exactly (float32), so the gated attention must be
  // plain attention: the student equals the teacher up to the two attention kernels' rounding.
  Fixture f = open_case(GetParam());
  for (gates::GateParameter& p : f.gates.parameters())
    if (p.name().ends_with("retention_gate.bias"))
      for (int64_t i = 0; i < p.value.numel(); ++i) p.value.data<float>()[i] = 200.0f;
  LocalWeightProvider weights(f.ckpt);
  const Tensor teacher = qwen3_forward(weights, f.ids, f.docs);
  EXPECT_LT(rel_diff(qwen3_forward(weights, f.ids, f.docs, {}, &f.gates), teacher), 1e-6) << GetParam();
}

TEST_P(StudentHf, RetainForwardWithGatesMatches) {
  const Fixture f = open_case(GetParam());
  const fs::path tmp = fs::path(::testing::TempDir()) / ("retain_student." + std::to_string(::getpid()));
  fs::create_directories(tmp);
  const fs::path out = tmp / "logits.safetensors";
  const std::string cmd = std::string(RETAIN_BIN_DIR) + "/retain-forward --model " + f.model_dir.string() +
                          " --gates " + f.gates_path.string() + " --gate-kind " +
                          f.expected.metadata().at("gate_kind") + " --ids \"" + joined(f.ids) + "\" --doc-ids \"" +
                          joined(f.docs) + "\" --out " + out.string() + " >" + (tmp / "log").string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_file((tmp / "log").string());
  const formats::SafetensorsFile got = formats::SafetensorsFile::open(out.string());
  EXPECT_EQ(got.metadata().at("gate_kind"), f.expected.metadata().at("gate_kind"));
  const double student = rel_diff(got.tensor("logits"), f.expected.tensor("logits"));
  EXPECT_LT(student, 1e-4) << GetParam();
  fs::remove_all(tmp);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, StudentHf, ::testing::ValuesIn(fixture_cases()),
                         [](const auto& info) { return info.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(StudentHf);
