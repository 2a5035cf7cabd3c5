#include "model/config.h"

#include <cmath>
#include <cstdint>

#include <nlohmann/json.hpp>

#include "data/formats/hf_config.h"
#include "kernels/base/atomic_file.h"
#include "kernels/base/error.h"

namespace retain {

using json = nlohmann::json;

namespace {

// Typed field access with errors that name the file and the key.
struct Reader {
  const json& j;
  const std::string& src;

  bool has(const char* key) const { return j.contains(key) && !j.at(key).is_null(); }

  // formats::json_integer's rule (data/formats/hf_config.h), errors naming this file and key.
  int64_t integer(const json& v, const std::string& key) const { return formats::json_integer(v, key, src); }
  double number(const json& v, const std::string& key) const {
    if (!v.is_number()) fail("{}: '{}' must be a number, got {}", src, key, v.dump());
    return v.get<double>();
  }
  int64_t positive(const char* key) const {
    if (!has(key)) fail("{}: missing required field '{}'", src, key);
    int64_t v = integer(j.at(key), key);
    if (v <= 0) fail("{}: '{}' must be positive, got {}", src, key, v);
    return v;
  }
  int64_t positive_or(const char* key, int64_t dflt) const { return has(key) ? positive(key) : dflt; }
  // A size every later allocation derives from, within retain's limit (Qwen3Config::kLimits):
  // checked here, before any buffer sized by it exists.
  int64_t bounded(const char* key, int64_t v) const {
    for (const auto& [name, limit] : Qwen3Config::kLimits)
      if (std::string_view(name) == key && v > limit)
        fail("{}: '{}' is {}, above retain's limit of {} (the largest Qwen3 has {}; docs/reliability.md)", src, key, v,
             limit, Qwen3Config::largest_known(key));
    return v;
  }
  bool boolean_or(const char* key, bool dflt) const {
    if (!has(key)) return dflt;
    if (!j.at(key).is_boolean()) fail("{}: '{}' must be true or false, got {}", src, key, j.at(key).dump());
    return j.at(key).get<bool>();
  }
  std::string string_or(const char* key, const std::string& dflt) const {
    if (!has(key)) return dflt;
    if (!j.at(key).is_string()) fail("{}: '{}' must be a string, got {}", src, key, j.at(key).dump());
    return j.at(key).get<std::string>();
  }
  // An integer or a list whose first entry is one (HF allows a list of eos ids; the first is the
  // document separator): formats::token_id_field, shared with retain-pack.
  std::optional<int64_t> token_id(const char* key) const { return formats::token_id_field(j, key, src); }
};

// RoPE parameters with transformers' precedence: `rope_scaling` (old) over
// `rope_parameters` (new); theta from the dict, else top-level `rope_theta`, else 10000.
RopeConfig parse_rope(const Reader& r, int64_t max_pos) {
  const json* params = nullptr;
  std::string where;
  for (const char* key : {"rope_scaling", "rope_parameters"})
    if (r.has(key) && !(r.j.at(key).is_object() && r.j.at(key).empty())) {
      params = &r.j.at(key);
      where = key;
      if (!params->is_object()) fail("{}: '{}' must be an object, got {}", r.src, key, params->dump());
      break;
    }
  const json empty = json::object();
  const json& p = params ? *params : empty;

  for (auto it = p.begin(); it != p.end(); ++it)
    if (it.value().is_object())
      fail("{}: per-layer-type '{}' ({}) is not supported: Qwen3 uses one RoPE for all layers", r.src, where,
           it.key());

  auto get = [&](const char* key) -> const json* { return p.contains(key) && !p.at(key).is_null() ? &p.at(key) : nullptr; };
  RopeConfig rope;
  if (const json* v = get("rope_type"))
    rope.type = v->is_string() ? v->get<std::string>() : "";
  else if (const json* t = get("type"))
    rope.type = t->is_string() ? t->get<std::string>() : "";
  if (const json* v = get("rope_theta"))
    rope.theta = r.number(*v, where + ".rope_theta");
  else if (r.has("rope_theta"))
    rope.theta = r.number(r.j.at("rope_theta"), "rope_theta");
  if (!(rope.theta > 1.0)) fail("{}: rope_theta must be > 1, got {}", r.src, rope.theta);
  const json* prf = get("partial_rotary_factor");
  if (!prf && r.has("partial_rotary_factor")) prf = &r.j.at("partial_rotary_factor");
  if (prf && r.number(*prf, "partial_rotary_factor") != 1.0)
    fail("{}: partial_rotary_factor {} is not supported (only 1.0)", r.src, prf->dump());

  if (rope.type == "default") return rope;
  if (rope.type != "yarn")
    fail("{}: RoPE type '{}' is not supported (supported: default, yarn)", r.src,
         rope.type.empty() ? p.dump() : rope.type);

  // transformers: a top-level original_max_position_embeddings wins, then the dict's,
  // then max_position_embeddings.
  if (r.has("original_max_position_embeddings"))
    rope.original_max_position_embeddings = r.positive("original_max_position_embeddings");
  else if (const json* v = get("original_max_position_embeddings"))
    rope.original_max_position_embeddings = r.integer(*v, where + ".original_max_position_embeddings");
  else
    rope.original_max_position_embeddings = max_pos;
  if (rope.original_max_position_embeddings <= 0)
    fail("{}: original_max_position_embeddings must be positive", r.src);
  if (!p.contains("factor")) fail("{}: YaRN '{}' needs a 'factor'", r.src, where);
  rope.factor = p.at("factor").is_null()
                    ? static_cast<double>(max_pos) / static_cast<double>(rope.original_max_position_embeddings)
                    : r.number(p.at("factor"), where + ".factor");
  if (!(rope.factor > 0)) fail("{}: YaRN factor must be positive, got {}", r.src, rope.factor);
  if (const json* v = get("attention_factor")) rope.attention_factor = r.number(*v, where + ".attention_factor");
  if (const json* v = get("mscale")) rope.mscale = r.number(*v, where + ".mscale");
  if (const json* v = get("mscale_all_dim")) rope.mscale_all_dim = r.number(*v, where + ".mscale_all_dim");
  // transformers uses `x or default`, so 0 also means the default.
  if (const json* v = get("beta_fast")) rope.beta_fast = r.number(*v, where + ".beta_fast");
  if (rope.beta_fast == 0) rope.beta_fast = 32.0;
  if (const json* v = get("beta_slow")) rope.beta_slow = r.number(*v, where + ".beta_slow");
  if (rope.beta_slow == 0) rope.beta_slow = 1.0;
  if (const json* v = get("truncate")) {
    if (!v->is_boolean()) fail("{}: {}.truncate must be true or false", r.src, where);
    rope.truncate = v->get<bool>();
  }
  return rope;
}

}  // namespace

Qwen3Config Qwen3Config::from_json(const json& j, const std::string& src) {
  if (!j.is_object()) fail("{}: config must be a JSON object", src);
  Reader r{j, src};
  const std::string model_type = r.string_or("model_type", "");
  if (model_type.empty()) fail("{}: missing 'model_type' (expected \"qwen3\")", src);
  if (model_type != "qwen3") fail("{}: model_type '{}' is not supported (expected \"qwen3\")", src, model_type);

  Qwen3Config c;
  c.vocab_size = r.bounded("vocab_size", r.positive("vocab_size"));
  c.hidden_size = r.bounded("hidden_size", r.positive("hidden_size"));
  c.intermediate_size = r.bounded("intermediate_size", r.positive("intermediate_size"));
  c.num_hidden_layers = r.bounded("num_hidden_layers", r.positive("num_hidden_layers"));
  c.num_attention_heads = r.bounded("num_attention_heads", r.positive("num_attention_heads"));
  c.num_key_value_heads = r.bounded("num_key_value_heads", r.positive_or("num_key_value_heads", c.num_attention_heads));
  c.head_dim = r.bounded("head_dim", r.positive_or("head_dim", 128));
  c.max_position_embeddings = r.bounded("max_position_embeddings", r.positive_or("max_position_embeddings", 32768));
  if (r.has("rms_norm_eps")) c.rms_norm_eps = r.number(j.at("rms_norm_eps"), "rms_norm_eps");
  if (!(c.rms_norm_eps >= 0)) fail("{}: rms_norm_eps must be >= 0", src);
  c.tie_word_embeddings = r.boolean_or("tie_word_embeddings", false);
  c.dtype = r.string_or("dtype", r.string_or("torch_dtype", "bfloat16"));
  c.bos_token_id = r.token_id("bos_token_id");
  c.eos_token_id = r.token_id("eos_token_id");

  if (c.num_attention_heads % c.num_key_value_heads != 0)
    fail("{}: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})", src, c.num_attention_heads,
         c.num_key_value_heads);
  if (c.head_dim % 2 != 0) fail("{}: head_dim must be even for RoPE, got {}", src, c.head_dim);
  if (const std::string act = r.string_or("hidden_act", "silu"); act != "silu")
    fail("{}: hidden_act '{}' is not supported (Qwen3 uses silu)", src, act);
  if (r.boolean_or("attention_bias", false)) fail("{}: attention_bias=true is not supported", src);
  if (r.boolean_or("use_sliding_window", false)) fail("{}: use_sliding_window=true is not supported", src);
  if (r.has("layer_types")) {
    const json& lt = j.at("layer_types");
    if (!lt.is_array()) fail("{}: 'layer_types' must be a list", src);
    for (const json& t : lt)
      if (t != "full_attention") fail("{}: layer type {} is not supported (only full_attention)", src, t.dump());
  }
  c.rope = parse_rope(r, c.max_position_embeddings);
  return c;
}

int64_t Qwen3Config::largest_known(std::string_view key) {
  static constexpr std::pair<const char*, int64_t> kLargest[] = {
      {"vocab_size", 151936},       {"hidden_size", 5120},         {"intermediate_size", 25600},
      {"num_hidden_layers", 94},    {"num_attention_heads", 64},   {"num_key_value_heads", 8},
      {"head_dim", 128},            {"max_position_embeddings", 262144}};
  for (const auto& [name, v] : kLargest)
    if (key == name) return v;
  return 0;
}

Qwen3Config Qwen3Config::load(const std::string& path) {
  const std::string text = read_file(path);
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail("{}: not valid JSON", path);
  return from_json(j, path);
}

json Qwen3Config::to_json() const {
  json rope_params = {{"rope_type", rope.type}, {"rope_theta", rope.theta}};
  if (rope.type == "yarn") {
    rope_params["factor"] = rope.factor;
    rope_params["original_max_position_embeddings"] = rope.original_max_position_embeddings;
    if (rope.attention_factor) rope_params["attention_factor"] = *rope.attention_factor;
  }
  json j = {
      {"architectures", {"Qwen3ForCausalLM"}},
      {"model_type", "qwen3"},
      {"vocab_size", vocab_size},
      {"hidden_size", hidden_size},
      {"intermediate_size", intermediate_size},
      {"num_hidden_layers", num_hidden_layers},
      {"num_attention_heads", num_attention_heads},
      {"num_key_value_heads", num_key_value_heads},
      {"head_dim", head_dim},
      {"hidden_act", "silu"},
      {"max_position_embeddings", max_position_embeddings},
      {"rms_norm_eps", rms_norm_eps},
      {"tie_word_embeddings", tie_word_embeddings},
      {"attention_bias", false},
      {"use_sliding_window", false},
      {"rope_parameters", rope_params},
      {"dtype", dtype},
      // The same settings in the keys transformers 4.x reads (5.x resolves both alike).
      {"rope_theta", rope.theta},
      {"rope_scaling", rope.type == "default" ? json(nullptr) : rope_params},
      {"torch_dtype", dtype},
  };
  if (bos_token_id) j["bos_token_id"] = *bos_token_id;
  if (eos_token_id) j["eos_token_id"] = *eos_token_id;
  return j;
}

}  // namespace retain
