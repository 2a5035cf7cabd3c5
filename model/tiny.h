// A random tiny Qwen3 in the Hugging Face layout, for tests and the quickstart:
// config.json, model.safetensors (BF16) and a byte-level tokenizer.json that uses
// Qwen3's pre-tokenizer regex and its special tokens; optionally random retention gates.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "model/config.h"
#include "model/gates/gates.h"

namespace retain {

struct TinyModelOptions {
  int64_t layers = 2;
  int64_t hidden = 64;
  int64_t heads = 4;
  int64_t kv_heads = 2;
  int64_t head_dim = 32;  // deliberately != hidden / heads, as in real Qwen3 sizes
  int64_t intermediate = 128;
  int64_t vocab = 512;
  bool tie = true;
  double yarn_factor = 0;  // > 1: YaRN with original_max_position_embeddings = max_pos / factor
  uint64_t seed = 0;
  // The size guard: a model of more BF16 bytes than this is refused (a typo such as --hidden
  // 65536 must not fill the disk); Qwen3-shaped benchmark models raise it (--max-gib).
  double max_gib = 1;
  // With a kind: also DIR/gates.safetensors, initialised as DESIGN §4 says (weights N(0, 0.02))
  // but with a small logit bias by default, so that the decay is visible (b = 18 is not).
  std::optional<gates::GateKind> gate_kind;
  int64_t gate_hidden = 16;
  gates::GateInput gate_input = gates::GateInput::hidden;
  double gate_bias_init = 2.0;
  // An existing, non-empty DIR is replaced only when set (retain-make-tiny --force): a trained
  // run's folder must not lose its config.json and gates to a mistyped --out.
  bool replace = false;
};

// The tokenizer's special tokens, right after the 256 byte tokens.
inline constexpr int64_t kTinyEndOfText = 256, kTinyImStart = 257, kTinyImEnd = 258;
inline constexpr int64_t kTinyTokenizerSize = 259;

Qwen3Config tiny_config(const TinyModelOptions& opt);
// A Hugging Face tokenizer.json: byte-level BPE with the 256 byte tokens (GPT-2 byte to
// unicode mapping, in its order), no merges, Qwen3's Split regex, NFC, special tokens.
nlohmann::json tiny_tokenizer_json();
// Writes config.json, model.safetensors, tokenizer.json (and gates.safetensors when
// opt.gate_kind is set) as the folder `dir`: built beside it and renamed into place, so `dir`
// holds the whole model and nothing else, or is untouched. An existing empty `dir` is replaced;
// a non-empty one only with opt.replace (else a retain::Error naming it).
void make_tiny_model(const std::string& dir, const TinyModelOptions& opt);

}  // namespace retain
