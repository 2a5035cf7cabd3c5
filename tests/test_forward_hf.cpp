// The Qwen3 forward against Hugging Face transformers' Qwen3ForCausalLM: checkpoints
// saved by transformers itself (tests/fixtures/hf/make_fixtures.py), logits computed by
// transformers in float32. `logits` treats the sequence as one document; `logits_docs`
// ran each document through HF separately, the reference for document masking.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "model/qwen3.h"
#include "data/formats/safetensors.h"
#include "model/weights.h"
#include "tests/fixture_helpers.h"

using namespace retain;
namespace fs = std::filesystem;

namespace {

using retain::test_support::as_i32;
using retain::test_support::rel_diff;
std::vector<std::string> fixture_cases() { return retain::test_support::fixture_cases("hf"); }

class HfForward : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST(HfForward, FixturesArePresent) {
  // The cases cover: tied/untied, GQA 1:1/2:1/4:1, head_dim != hidden/heads, YaRN,
  // sharded index, BF16/F16/F32, old and new config.json styles.
  EXPECT_GE(fixture_cases().size(), 4u) << "tests/fixtures/hf is missing cases";
}

TEST_P(HfForward, LogitsMatchTransformers) {
  const fs::path dir = fs::path(RETAIN_FIXTURES_DIR) / "hf" / GetParam();
  const formats::SafetensorsFile expected = formats::SafetensorsFile::open((dir / "expected.safetensors").string());
  auto ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(dir.string()));
  LocalWeightProvider weights(ckpt);

  const Tensor ids = as_i32(expected.tensor("input_ids"));
  const Tensor docs = as_i32(expected.tensor("doc_ids"));
  Tensor one_doc = Tensor::zeros(ids.shape(), DType::I32);

  const double single = rel_diff(qwen3_forward(weights, ids, one_doc), expected.tensor("logits"));
  EXPECT_LT(single, 1e-4) << GetParam() << ": one document";
  const double multi = rel_diff(qwen3_forward(weights, ids, docs), expected.tensor("logits_docs"));
  EXPECT_LT(multi, 1e-4) << GetParam() << ": document-masked";
  std::printf("[ %s ] rel diff vs transformers: one document %.2e, documents %.2e\n", GetParam().c_str(), single,
              multi);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HfForward, ::testing::ValuesIn(fixture_cases()),
                         [](const auto& info) { return info.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(HfForward);
