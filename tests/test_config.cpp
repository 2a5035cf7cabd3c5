// config.json parsing (both HF key styles, defaults, errors) and RoPE parameters.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numbers>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/rope_params.h"

using namespace retain;
using json = nlohmann::json;

namespace {

json base_config() {
  return json{{"model_type", "qwen3"},       {"vocab_size", 300},        {"hidden_size", 64},
              {"intermediate_size", 128},    {"num_hidden_layers", 2},   {"num_attention_heads", 4},
              {"num_key_value_heads", 2},    {"head_dim", 32},           {"rms_norm_eps", 1e-6},
              {"max_position_embeddings", 4096}};
}

std::string error_of(const json& j) {
  try {
    Qwen3Config::from_json(j, "cfg.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Config, DefaultsFollowTransformers) {
  json j = base_config();
  j.erase("num_key_value_heads");
  j.erase("head_dim");
  j.erase("rms_norm_eps");
  const Qwen3Config c = Qwen3Config::from_json(j, "cfg.json");
  EXPECT_EQ(c.num_key_value_heads, 4);  // = heads
  EXPECT_EQ(c.head_dim, 128);           // Qwen3Config's default, not hidden/heads
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.rope.type, "default");
  EXPECT_DOUBLE_EQ(c.rope.theta, 10000.0);
}

TEST(Config, NewStyleRopeParameters) {
  json j = base_config();
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e6}, {"factor", 4.0},
                          {"original_max_position_embeddings", 1024}};
  j["dtype"] = "bfloat16";
  j["tie_word_embeddings"] = true;
  const Qwen3Config c = Qwen3Config::from_json(j, "cfg.json");
  EXPECT_EQ(c.rope.type, "yarn");
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
  EXPECT_DOUBLE_EQ(c.rope.factor, 4.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 1024);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.dtype, "bfloat16");
}

TEST(Config, OldStyleRopeThetaAndScaling) {
  json j = base_config();
  j["rope_theta"] = 5e5;
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 2.0}};  // `type` spelling, no original max
  j["torch_dtype"] = "float16";
  const Qwen3Config c = Qwen3Config::from_json(j, "cfg.json");
  EXPECT_EQ(c.rope.type, "yarn");
  EXPECT_DOUBLE_EQ(c.rope.theta, 5e5);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 4096);  // falls back to max_position_embeddings
  EXPECT_EQ(c.dtype, "float16");
}

TEST(Config, PrecedenceMatchesTransformers) {
  json j = base_config();
  j["rope_theta"] = 123.0;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}};
  EXPECT_DOUBLE_EQ(Qwen3Config::from_json(j, "c").rope.theta, 1e6);  // dict beats top level
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};      // rope_scaling beats rope_parameters
  const Qwen3Config c = Qwen3Config::from_json(j, "c");
  EXPECT_EQ(c.rope.type, "yarn");
  EXPECT_DOUBLE_EQ(c.rope.theta, 123.0);  // rope_scaling has no theta: top-level one
  j["original_max_position_embeddings"] = 512;  // top-level wins (transformers' Phi3 rule)
  j["rope_scaling"]["original_max_position_embeddings"] = 1024;
  EXPECT_EQ(Qwen3Config::from_json(j, "c").rope.original_max_position_embeddings, 512);
}

TEST(Config, ErrorsNameTheFileAndTheProblem) {
  auto expect_error = [](json j, const std::string& needle) {
    const std::string e = error_of(j);
    EXPECT_NE(e.find("cfg.json"), std::string::npos) << e;
    EXPECT_NE(e.find(needle), std::string::npos) << "wanted '" << needle << "' in: " << e;
  };
  json j = base_config();
  j.erase("model_type");
  expect_error(j, "model_type");
  j = base_config();
  j["model_type"] = "llama";
  expect_error(j, "llama");
  j = base_config();
  j.erase("vocab_size");
  expect_error(j, "vocab_size");
  j = base_config();
  j["hidden_size"] = -4;
  expect_error(j, "hidden_size");
  j = base_config();
  j["num_key_value_heads"] = 3;
  expect_error(j, "multiple");
  j = base_config();
  j["hidden_size"] = "64";
  expect_error(j, "integer");
  // Out of int64's range, as a float or as an unsigned integer: an error, never a conversion
  // (2.5e19 was a fuzzer's finding: undefined behaviour before).
  j = base_config();
  j["num_hidden_layers"] = 2.5e19;
  expect_error(j, "integer");
  j = base_config();
  j["num_hidden_layers"] = uint64_t{18446744073709551615u};
  expect_error(j, "too large");
  j = base_config();
  j["num_hidden_layers"] = 2.5;
  expect_error(j, "integer");
  j = base_config();
  j["use_sliding_window"] = true;
  expect_error(j, "sliding");
  j = base_config();
  j["attention_bias"] = true;
  expect_error(j, "attention_bias");
  j = base_config();
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  expect_error(j, "linear");
  j = base_config();
  j["rope_parameters"] = {{"rope_type", "yarn"}};
  expect_error(j, "factor");
  j = base_config();
  j["hidden_act"] = "gelu";
  expect_error(j, "gelu");
  j = base_config();
  j["head_dim"] = 33;
  expect_error(j, "even");
  j = base_config();
  j["layer_types"] = {"full_attention", "sliding_attention"};
  expect_error(j, "sliding_attention");
  expect_error(json::array(), "object");
}

TEST(Config, LoadReportsBadFiles) {
  const std::string dir = ::testing::TempDir() + "/retain_cfg";
  std::filesystem::create_directories(dir);
  EXPECT_THROW(Qwen3Config::load(dir + "/missing.json"), Error);
  std::ofstream(dir + "/bad.json") << "{ \"model_type\": \"qwen3\", ";
  try {
    Qwen3Config::load(dir + "/bad.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.json: not valid JSON"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(Config, ToJsonRoundTrips) {
  json j = base_config();
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e6}, {"factor", 4.0},
                          {"original_max_position_embeddings", 1024}};
  j["eos_token_id"] = 5;
  const Qwen3Config a = Qwen3Config::from_json(j, "a");
  const Qwen3Config b = Qwen3Config::from_json(a.to_json(), "b");
  EXPECT_EQ(b.to_json(), a.to_json());
  EXPECT_EQ(b.eos_token_id, 5);
}

TEST(RopeParams, DefaultInverseFrequencies) {
  Qwen3Config c = Qwen3Config::from_json(base_config(), "c");
  c.rope.theta = 1e6;
  const RopeParams p = compute_rope_params(c);
  ASSERT_EQ(p.inv_freq.dim(0), 16);
  EXPECT_EQ(p.attention_factor, 1.0f);
  for (int j = 0; j < 16; ++j)
    EXPECT_NEAR(p.inv_freq.data<float>()[j], std::pow(1e6, -2.0 * j / 32), 1e-6 * std::pow(1e6, -2.0 * j / 32));
}

// YaRN from its definition (Peng et al. 2023, as transformers implements it), in float64.
TEST(RopeParams, YarnMatchesFloat64Definition) {
  for (double factor : {4.0, 2.5}) {
    for (int64_t orig : {32, 1024, 32768}) {
      json j = base_config();
      j["head_dim"] = 128;
      j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e6}, {"factor", factor},
                              {"original_max_position_embeddings", orig}};
      const Qwen3Config c = Qwen3Config::from_json(j, "c");
      const RopeParams p = compute_rope_params(c);
      const double dim = 128, base = 1e6;
      auto corr = [&](double rot) { return dim * std::log(orig / (rot * 2 * std::numbers::pi)) / (2 * std::log(base)); };
      const double low = std::max(std::floor(corr(32)), 0.0), high = std::min(std::ceil(corr(1)), dim - 1);
      for (int i = 0; i < 64; ++i) {
        const double extra = std::pow(base, -2.0 * i / dim), inter = extra / factor;
        const double ramp = std::clamp((i - low) / (high == low ? 0.001 : high - low), 0.0, 1.0);
        const double want = inter * ramp + extra * (1 - ramp);
        EXPECT_NEAR(p.inv_freq.data<float>()[i], want, 2e-6 * want) << factor << " " << orig << " " << i;
      }
      EXPECT_NEAR(p.attention_factor, 0.1 * std::log(factor) + 1.0, 1e-7);
    }
  }
}

TEST(RopeParams, YarnAttentionFactorOverrides) {
  json j = base_config();
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"attention_factor", 0.5}};
  EXPECT_FLOAT_EQ(compute_rope_params(Qwen3Config::from_json(j, "c")).attention_factor, 0.5f);
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"mscale", 2.0}, {"mscale_all_dim", 1.0}};
  EXPECT_FLOAT_EQ(compute_rope_params(Qwen3Config::from_json(j, "c")).attention_factor,
                  float((0.2 * std::log(4.0) + 1) / (0.1 * std::log(4.0) + 1)));
}
