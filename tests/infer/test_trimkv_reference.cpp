// Bounded-KV decoding vs the TRIM-KV authors' TrimKVCache (PyPI trimkv 0.1.5 under Hugging
// Face generate, greedy, CPU): the same generated tokens, the same kept positions per layer and
// KV head after the last forward, and the same logits at every step, from the fixtures of
// tests/fixtures/generate/make_fixtures.py. Through the library and through retain-generate.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "model/infer/generate.h"
#include "data/formats/safetensors.h"
#include "tests/fixture_helpers.h"

using namespace retain;
using namespace retain::infer;
namespace fs = std::filesystem;

namespace {

nlohmann::json read_json(const fs::path& p) {
  std::ifstream f(p);
  return nlohmann::json::parse(f);
}

std::vector<std::string> cases() {
  std::vector<std::string> out;
  const fs::path root = fs::path(RETAIN_FIXTURES_DIR) / "generate";
  for (const auto& e : fs::directory_iterator(root))
    if (fs::exists(e.path() / "expected.json")) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST(TrimKVReference, FixturesExist) { EXPECT_GE(cases().size(), 4u); }

TEST(TrimKVReference, DecoderMatchesTrimKVCache) {
  for (const std::string& name : cases()) {
    SCOPED_TRACE(name);
    const fs::path dir = fs::path(RETAIN_FIXTURES_DIR) / "generate" / name;
    const nlohmann::json e = read_json(dir / "expected.json");
    const std::string model = (fs::path(RETAIN_FIXTURES_DIR) / "hf" / e["model"].get<std::string>()).string();
    auto ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(model));
    const gates::RetentionGates gates = gates::RetentionGates::load((dir / "gates.safetensors").string(), ckpt->config());
    ResidentWeightProvider w(ckpt);
    PolicyOptions p;
    p.kind = PolicyKind::trimkv, p.budget = e["budget"], p.buffer = e["buffer"];
    Decoder dec(w, &gates, p);
    const auto prompt = e["prompt_ids"].get<std::vector<int32_t>>();
    const auto want = e["generated_ids"].get<std::vector<int32_t>>();
    GenerateOptions g;
    g.max_new = static_cast<int64_t>(want.size()), g.keep_logits = true;
    const GenerateResult r = generate(dec, prompt, g);
    EXPECT_EQ(r.generated, want);
    const auto kept = e["kept_positions"].get<std::vector<std::vector<std::vector<int32_t>>>>();
    ASSERT_EQ(static_cast<int64_t>(kept.size()), dec.cache().layers());
    for (int64_t l = 0; l < dec.cache().layers(); ++l)
      for (int64_t h = 0; h < dec.cache().kv_heads(); ++h)
        EXPECT_EQ(dec.cache().kept_positions(l, h), kept[l][h]) << "layer " << l << " head " << h;
    const formats::SafetensorsFile lf = formats::SafetensorsFile::open((dir / "logits.safetensors").string());
    const Tensor want_logits = lf.tensor("logits");
    const Tensor got = Tensor::from_vector(r.logits, want_logits.shape());
    EXPECT_LT(test_support::rel_diff(got, want_logits), 1e-5);
  }
}

TEST(TrimKVReference, ToolJsonMatchesTrimKVCache) {
  const std::string name = cases().front();
  const fs::path dir = fs::path(RETAIN_FIXTURES_DIR) / "generate" / name;
  const nlohmann::json e = read_json(dir / "expected.json");
  const fs::path out = fs::path(::testing::TempDir()) / ("retain_gen." + std::to_string(::getpid()) + ".json");
  std::string ids;
  for (int v : e["prompt_ids"]) ids += std::to_string(v) + " ";
  const std::string cmd = std::string(RETAIN_BIN_DIR) + "/retain-generate --model " +
                          (fs::path(RETAIN_FIXTURES_DIR) / "hf" / e["model"].get<std::string>()).string() +
                          " --gates " + (dir / "gates.safetensors").string() + " --policy trimkv --budget " +
                          std::to_string(e["budget"].get<int>()) + " --buffer " + std::to_string(e["buffer"].get<int>()) +
                          " --greedy --max-new " + std::to_string(e["generated_ids"].size()) + " --prompt-ids \"" + ids +
                          "\" --json " + out.string() + " > /dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const nlohmann::json got = read_json(out);
  EXPECT_EQ(got["prompt_ids"], e["prompt_ids"]);
  EXPECT_EQ(got["generated_ids"], e["generated_ids"]);
  EXPECT_EQ(got["kept_positions"], e["kept_positions"]);
  EXPECT_EQ(got["cache_sizes"], e["cache_sizes"]);
  fs::remove(out);
}
