// retain-export's KVPOP scorer writers (kvpop_export.h).
#include "checkpoints/export/kvpop_export.h"

#include <map>

#include "data/formats/gguf.h"
#include "data/formats/safetensors.h"
#include "model/kvpop/scorer_containers.h"

namespace retain::exports {

void write_scorers_safetensors(const std::string& out, const kvpop::Scorers& s, const GateInfo& info, DType dtype) {
  const kvpop::ScorerDims& d = s.dims();
  std::map<std::string, std::string> meta = {
      {"format", "retain-gates"},
      {"gate_kind", "kvpop"},
      {"num_hidden_layers", std::to_string(d.layers)},
      {"num_key_value_heads", std::to_string(d.kv_heads)},
      {"head_dim", std::to_string(d.head_dim)},
      {"base_model", info.base_model},
      {"base_config_sha256", info.base_config_sha256},
  };
  if (s.geometry()) {
    meta["window"] = std::to_string(s.geometry()->window);
    meta["sinks"] = std::to_string(s.geometry()->sinks);
    meta["topk"] = std::to_string(s.geometry()->topk);
  }
  for (const auto& [k, v] : kvpop::decay_metadata(s.decay())) meta[k] = v;
  if (info.step) meta["step"] = std::to_string(*info.step);
  if (info.max_seq_len) meta["max_seq_len"] = std::to_string(*info.max_seq_len);
  formats::write_safetensors(out, export_tensors(s, dtype), meta);
}

void write_scorers_gguf(const std::string& out, const kvpop::Scorers& s, const GateInfo& info, DType dtype) {
  const kvpop::ScorerDims& d = s.dims();
  using formats::gguf::Value;
  auto u64 = [](int64_t x) { return Value{formats::gguf::Type::U64, static_cast<uint64_t>(x)}; };
  formats::gguf::Metadata meta = {
      {"general.architecture", Value::str("qwen3")},
      {"general.type", Value::str("adapter")},
      {"general.alignment", Value::u32(32)},
      {"adapter.type", Value::str("kvpop")},
      {"retention.kind", Value::str("kvpop")},
      {"retention.score_version",
       Value::u32(s.decay() == kvpop::Decay{} ? kvpop::kScoreVersion : kvpop::kScoreVersionDecay)},
      {"retention.layer_count", Value::u32(static_cast<uint32_t>(d.layers))},
      {"retention.head_count_kv", Value::u32(static_cast<uint32_t>(d.kv_heads))},
      {"retention.key_length", Value::u32(static_cast<uint32_t>(d.head_dim))},
      {"retention.base_model", Value::str(info.base_model)},
      {"retention.base_config_sha256", Value::str(info.base_config_sha256)},
  };
  if (s.geometry()) {
    meta.emplace_back("retention.window", u64(s.geometry()->window));
    meta.emplace_back("retention.sinks", u64(s.geometry()->sinks));
    meta.emplace_back("retention.topk", u64(s.geometry()->topk));
  }
  if (s.decay() != kvpop::Decay{}) {
    meta.emplace_back("retention.decay_every", u64(s.decay().every));
    meta.emplace_back("retention.decay_min", Value::f64(s.decay().gamma_min));
    meta.emplace_back("retention.decay_max", Value::f64(s.decay().gamma_max));
  }
  if (info.step) meta.emplace_back("retention.step", u64(*info.step));
  if (info.max_seq_len) meta.emplace_back("retention.max_seq_len", u64(*info.max_seq_len));
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (auto& [n, t] : export_tensors(s, dtype)) {
    const auto name = kvpop::kvpop_gguf_name(n);
    RETAIN_CHECK(name.has_value(), "scorer tensor {}", n);
    tensors.emplace_back(*name, t);
  }
  formats::gguf::write_file(out, meta, tensors, 32);
}

}  // namespace retain::exports
