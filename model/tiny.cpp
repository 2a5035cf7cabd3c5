#include "model/tiny.h"

#include <unistd.h>


#include <filesystem>
#include <random>

#include <nlohmann/json.hpp>

#include "kernels/base/atomic_file.h"
#include "kernels/base/half.h"
#include "data/formats/safetensors.h"
#include "model/weights.h"

namespace retain {

using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

// Qwen3's pre-tokenizer pattern (from its tokenizer.json).
constexpr const char* kQwen3SplitRegex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// GPT-2's byte -> printable code point map, in the order byte-level vocabularies use:
// printable bytes keep their code point; the rest get 256, 257, ... in byte order.
std::vector<std::pair<int, int>> byte_to_codepoint_in_vocab_order() {
  std::vector<std::pair<int, int>> out;
  std::vector<bool> printable(256, false);
  auto keep = [&](int lo, int hi) {
    for (int b = lo; b <= hi; ++b) {
      printable[b] = true;
      out.emplace_back(b, b);
    }
  };
  keep('!', '~');
  keep(0xA1, 0xAC);
  keep(0xAE, 0xFF);
  int next = 256;
  for (int b = 0; b < 256; ++b)
    if (!printable[b]) out.emplace_back(b, next++);
  return out;
}

std::string utf8(int cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

json byte_level() {
  return {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
}

// BF16 tensor of N(0, std) values, or 1 + N(0, std) for norm weights.
Tensor random_bf16(const Shape& shape, double mean, double std, std::mt19937_64& rng) {
  Tensor t = Tensor::empty(shape, DType::BF16);
  std::normal_distribution<double> normal(mean, std);
  uint16_t* p = static_cast<uint16_t*>(t.raw());
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = f32_to_bf16(static_cast<float>(normal(rng)));
  return t;
}

}  // namespace

Qwen3Config tiny_config(const TinyModelOptions& o) {
  Qwen3Config c;
  c.vocab_size = o.vocab;
  c.hidden_size = o.hidden;
  c.intermediate_size = o.intermediate;
  c.num_hidden_layers = o.layers;
  c.num_attention_heads = o.heads;
  c.num_key_value_heads = o.kv_heads;
  c.head_dim = o.head_dim;
  c.max_position_embeddings = 131072;
  c.rms_norm_eps = 1e-6;
  c.tie_word_embeddings = o.tie;
  c.rope.theta = 1000000.0;  // Qwen3's
  if (o.yarn_factor > 1) {
    c.rope.type = "yarn";
    c.rope.factor = o.yarn_factor;
    c.rope.original_max_position_embeddings =
        static_cast<int64_t>(static_cast<double>(c.max_position_embeddings) / o.yarn_factor);
  }
  c.dtype = "bfloat16";
  c.bos_token_id = kTinyEndOfText;
  c.eos_token_id = kTinyEndOfText;
  // Validate through the same parser every loaded config goes through.
  return Qwen3Config::from_json(c.to_json(), "retain-make-tiny options");
}

json tiny_tokenizer_json() {
  json vocab = json::object();
  int id = 0;
  for (const auto& [byte, cp] : byte_to_codepoint_in_vocab_order()) {
    (void)byte;
    vocab[utf8(cp)] = id++;
  }
  json added = json::array();
  const std::pair<int64_t, const char*> specials[] = {
      {kTinyEndOfText, "<|endoftext|>"}, {kTinyImStart, "<|im_start|>"}, {kTinyImEnd, "<|im_end|>"}};
  for (const auto& [sid, content] : specials)
    added.push_back({{"id", sid}, {"content", content}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
  return {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"}, {"pattern", {{"Regex", kQwen3SplitRegex}}}, {"behavior", "Isolated"}, {"invert", false}},
          byte_level()}}}},
      {"post_processor", byte_level()},
      {"decoder", byte_level()},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", ""},
        {"end_of_word_suffix", ""},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", json::array()}}},
  };
}

void make_tiny_model(const std::string& dir, const TinyModelOptions& opt) {
  const Qwen3Config c = tiny_config(opt);
  if (c.vocab_size < kTinyTokenizerSize)
    fail("--vocab {} is too small: the tiny tokenizer has {} tokens", c.vocab_size, kTinyTokenizerSize);
  // Gates first, so bad gate options fail before anything is written. They have a seed of
  // their own, so adding gates leaves the model's weights unchanged.
  std::optional<gates::RetentionGates> gates;
  if (opt.gate_kind)
    gates = gates::RetentionGates::init(
        {*opt.gate_kind, c.num_hidden_layers, gates::gate_input_width(c, opt.gate_input), opt.gate_hidden,
         c.num_key_value_heads, opt.gate_input},
        opt.gate_bias_init, opt.seed ^ 0x9e3779b97f4a7c15ULL);
  // A size guard: this tool makes test models; a typo (--hidden 65536) must not fill the disk.
  int64_t params = 0;
  for (const auto& [name, shape] : expected_tensors(c)) params += shape_numel(shape);
  const double gib = static_cast<double>(params) * 2 / static_cast<double>(int64_t{1} << 30);
  if (gib > opt.max_gib)
    fail("{}: the model would hold {} parameters ({:.1f} GiB of BF16); retain-make-tiny makes test models of at "
         "most {:g} GiB (--max-gib raises it)",
         dir, params, gib, opt.max_gib);
  // The output folder's parent must exist (as for every tool). The model is built beside DIR
  // and renamed into place, so an interrupted run leaves no half-made model, and a replaced
  // folder keeps no stale file (gates that no longer fit the new shapes).
  std::error_code ec;
  const fs::path target = fs::absolute(dir).lexically_normal();
  if (!fs::is_directory(target.parent_path(), ec))
    fail("--out {}: the folder {} does not exist", dir, target.parent_path().string());
  if (fs::exists(target, ec) && !fs::is_directory(target, ec)) fail("--out {}: is not a directory", dir);
  if (fs::is_directory(target, ec) && !fs::is_empty(target, ec) && !opt.replace)
    fail("--out {}: already exists and is not empty (pass --force to replace it)", dir);
  const fs::path build = fs::path(target.string() + ".tmp." + std::to_string(::getpid()));
  struct Cleanup {
    fs::path p;
    bool armed;
    ~Cleanup() {
      std::error_code e;
      if (armed) fs::remove_all(p, e);
    }
  } cleanup{build, true};
  fs::remove_all(build, ec);
  if (!fs::create_directory(build, ec)) fail("{}: cannot create directory: {}", build.string(), ec.message());

  // Scale each matrix by 1/sqrt(fan_in) so activations and logits stay O(1) and the
  // model's outputs depend visibly on every weight (a stronger test than HF's 0.02 init).
  std::mt19937_64 rng(opt.seed);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& [name, shape] : expected_tensors(c)) {
    const bool is_norm = shape.size() == 1;
    const double std = is_norm ? 0.1 : 1.0 / std::sqrt(static_cast<double>(shape.back()));
    tensors.emplace_back(name, random_bf16(shape, is_norm ? 1.0 : 0.0, std, rng));
  }
  write_file_atomic((build / "config.json").string(), c.to_json().dump(2) + "\n");
  write_file_atomic((build / "tokenizer.json").string(), tiny_tokenizer_json().dump(2) + "\n");
  formats::write_safetensors((build / "model.safetensors").string(), tensors, {{"format", "pt"}, {"producer", "retain-make-tiny"}});
  if (gates) gates->save((build / "gates.safetensors").string(), {{"producer", "retain-make-tiny"}});
  replace_directory(build.string(), target.string(), dir);
  cleanup.armed = false;
}

}  // namespace retain
