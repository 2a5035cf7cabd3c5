// KVPOP scorers from a safetensors or GGUF container (scorer_containers.h).
#include "model/kvpop/scorer_containers.h"

#include <map>

#include <fmt/format.h>

#include "data/formats/gguf.h"
#include "data/formats/safetensors.h"
#include "model/layer_names.h"

namespace retain::kvpop {

namespace {

constexpr std::string_view kOurs = "model.layers.", kOursMid = ".self_attn.kvpop.", kGguf = "blk.", kGgufMid = ".kvpop.";

// "<prefix><digits><middle><rest>" → "<to_prefix><digits><to_middle><rest>" when rest is a scorer suffix.
std::optional<std::string> rename(const std::string& name, std::string_view prefix, std::string_view middle,
                                  std::string_view to_prefix, std::string_view to_middle) {
  const auto parts = split_layer_name(name, prefix, middle);
  if (!parts || !all_digits(parts->first)) return std::nullopt;
  for (const std::string& s : scorer_suffixes())
    if (parts->second == s) return fmt::format("{}{}{}{}", to_prefix, parts->first, to_middle, parts->second);
  return std::nullopt;
}

std::optional<int64_t> parse_int(const std::map<std::string, std::string>& m, const char* key) {
  auto it = m.find(key);
  if (it == m.end()) return std::nullopt;
  try {
    size_t used = 0;
    const long long v = std::stoll(it->second, &used);
    if (used == it->second.size()) return v;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::string> kvpop_gguf_name(const std::string& name) {
  return rename(name, kOurs, kOursMid, kGguf, kGgufMid);
}
std::optional<std::string> kvpop_name_from_gguf(const std::string& name) {
  return rename(name, kGguf, kGgufMid, kOurs, kOursMid);
}

bool holds_kvpop(const std::string& path) {
  switch (gates::detect_format(path)) {
    case gates::Format::safetensors: {
      const formats::SafetensorsFile f = formats::SafetensorsFile::open(path);
      if (auto it = f.metadata().find("gate_kind"); it != f.metadata().end()) return it->second == "kvpop";
      for (const std::string& n : f.names())
        if (n.find(kOursMid) != std::string::npos) return true;
      return false;
    }
    case gates::Format::gguf: {
      const formats::gguf::File f = formats::gguf::read_file(path);
      const formats::gguf::Value* v = f.find("adapter.type");
      return v && v->type == formats::gguf::Type::STRING && std::get<std::string>(v->v) == "kvpop";
    }
    default: return false;
  }
}

LoadedScorers load_scorers(const std::string& path, const Qwen3Config& config) {
  const gates::Format format = gates::detect_format(path);
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> meta;
  if (format == gates::Format::safetensors) {
    const formats::SafetensorsFile f = formats::SafetensorsFile::open(path);
    for (const std::string& n : f.names()) tensors.emplace(n, f.tensor(n));
    meta = f.metadata();
  } else if (format == gates::Format::gguf) {
    const formats::gguf::File f = formats::gguf::read_file(path);
    auto str = [&](const char* key) -> std::optional<std::string> {
      const formats::gguf::Value* v = f.find(key);
      if (!v) return std::nullopt;
      if (v->type != formats::gguf::Type::STRING) fail("{}: metadata '{}' is not a string", path, key);
      return std::get<std::string>(v->v);
    };
    if (str("general.type") != "adapter" || str("adapter.type") != "kvpop")
      fail("{}: not a kvpop GGUF adapter (general.type '{}', adapter.type '{}')", path,
           str("general.type").value_or(""), str("adapter.type").value_or(""));
    for (const auto& [n, t] : f.tensors) {
      const auto name = kvpop_name_from_gguf(n);
      if (!name) fail("{}: unexpected tensor '{}' (not a blk.N.kvpop.* tensor)", path, n);
      tensors.emplace(*name, t);
    }
    meta["gate_kind"] = str("retention.kind").value_or("kvpop");
    for (const char* k : {"window", "sinks", "topk", "step", "max_seq_len"})
      if (const formats::gguf::Value* v = f.find(std::string("retention.") + k)) {
        if (auto* u = std::get_if<uint64_t>(&v->v)) meta[k] = std::to_string(*u);
        else if (auto* i = std::get_if<int64_t>(&v->v)) meta[k] = std::to_string(*i);
        else fail("{}: metadata 'retention.{}' is not an integer", path, k);
      }
    if (const formats::gguf::Value* v = f.find("retention.score_version")) {
      const auto* u = std::get_if<uint64_t>(&v->v);
      if (!u || (*u != kScoreVersion && *u != kScoreVersionDecay))
        fail("{}: retention.score_version {} is not one this retain reads ({} or {})", path, v->to_string(),
             kScoreVersion, kScoreVersionDecay);
    }
    if (const formats::gguf::Value* v = f.find("retention.decay_every")) {
      if (auto* u = std::get_if<uint64_t>(&v->v)) meta["decay_every"] = std::to_string(*u);
      else fail("{}: metadata 'retention.decay_every' is not an unsigned integer", path);
    }
    for (const char* k : {"decay_min", "decay_max"})
      if (const formats::gguf::Value* v = f.find(std::string("retention.") + k)) {
        if (auto* d = std::get_if<double>(&v->v)) meta[k] = fmt::format("{}", *d);
        else fail("{}: metadata 'retention.{}' is not a float", path, k);
      }
    if (auto s = str("retention.base_model")) meta["base_model"] = *s;
    if (auto s = str("retention.base_config_sha256")) meta["base_config_sha256"] = *s;
  } else {
    fail("{}: a {} container holds retention gates, not kvpop scorers (kvpop scorers are safetensors or GGUF)", path,
         gates::format_name(format));
  }
  LoadedScorers out{Scorers::from_tensors(path, tensors, meta, config), {}, format};
  out.info.step = parse_int(meta, "step");
  out.info.max_seq_len = parse_int(meta, "max_seq_len");
  if (auto it = meta.find("base_model"); it != meta.end()) out.info.base_model = it->second;
  if (auto it = meta.find("base_config_sha256"); it != meta.end()) out.info.base_config_sha256 = it->second;
  return out;
}

}  // namespace retain::kvpop
