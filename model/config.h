// Qwen3 configuration, read from a Hugging Face config.json. Field names and defaults
// follow transformers' Qwen3Config (v5); both the old (`rope_theta`, `rope_scaling`,
// `torch_dtype`) and new (`rope_parameters`, `dtype`) spellings are accepted, resolved
// with the same precedence transformers uses. Anything retain cannot run exactly
// (sliding windows, attention biases, other RoPE types) is one clear error.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <nlohmann/json_fwd.hpp>

namespace retain {

struct RopeConfig {
  std::string type = "default";  // "default" or "yarn"
  double theta = 10000.0;
  // YaRN only (DESIGN §3; Qwen3 uses factor 4 for 128K):
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  std::optional<double> attention_factor, mscale, mscale_all_dim;
  double beta_fast = 32.0, beta_slow = 1.0;
  bool truncate = true;
};

struct Qwen3Config {
  // The largest value retain accepts for each size field, checked when config.json is read, before
  // anything is allocated from it: far above every released Qwen3 (the largest, Qwen3-235B-A22B
  // and the 2507 models, have 94 layers, hidden 4096, 64 heads, head_dim 128, vocab 151,936,
  // 262,144 positions), far below what would exhaust memory before the checkpoint is checked.
  static constexpr std::pair<const char*, int64_t> kLimits[] = {
      {"vocab_size", int64_t{1} << 22},        {"hidden_size", int64_t{1} << 16},
      {"intermediate_size", int64_t{1} << 20}, {"num_hidden_layers", 1024},
      {"num_attention_heads", 1024},           {"num_key_value_heads", 1024},
      {"head_dim", 1024},                      {"max_position_embeddings", int64_t{1} << 24}};
  // The largest released Qwen3's value of a size field, for the error message.
  static int64_t largest_known(std::string_view key);

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 128;
  int64_t max_position_embeddings = 32768;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  RopeConfig rope;
  std::string dtype = "bfloat16";  // checkpoint dtype as declared (informational)
  std::optional<int64_t> bos_token_id, eos_token_id;

  // `source` names the file in error messages.
  static Qwen3Config from_json(const nlohmann::json& j, const std::string& source);
  static Qwen3Config load(const std::string& config_json_path);
  // An HF config.json for this config (what retain-make-tiny writes), with both the new
  // (`rope_parameters`, `dtype`) and the legacy (`rope_theta`, `rope_scaling`, `torch_dtype`) keys.
  nlohmann::json to_json() const;
};

}  // namespace retain
