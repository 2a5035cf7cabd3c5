// Gates from any container: detection by the first bytes, one reader per container, and the
// GGUF tensor names (gate_containers.h).
#include "model/gates/gate_containers.h"

#include <charconv>
#include <filesystem>
#include <fstream>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "data/formats/gguf.h"
#include "data/formats/safetensors.h"
#include "data/formats/torch_file.h"
#include "kernels/base/atomic_file.h"
#include "model/layer_names.h"

namespace retain::gates {

namespace fs = std::filesystem;

namespace {

constexpr const char* kTrimkvWeights = kTrimkvWeightsFile;

// gate-file suffix ↔ GGUF suffix
const std::pair<const char*, const char*> kSuffixes[] = {
    {"linear.weight", "fc.weight"},   {"linear1.weight", "fc1.weight"}, {"linear1.bias", "fc1.bias"},
    {"linear2.weight", "fc2.weight"}, {"linear2.bias", "fc2.bias"},     {"linear3.weight", "fc3.weight"},
    {"bias", "bias"},
};

std::string fmt_number(double x) { return fmt::format("{}", x); }

std::optional<double> parse_double(const std::string& s) {
  double v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}

std::map<std::string, Tensor> to_map(const std::vector<std::pair<std::string, Tensor>>& v, const std::string& path) {
  std::map<std::string, Tensor> m;
  for (const auto& [n, t] : v)
    if (!m.emplace(n, t).second) fail("{}: tensor '{}' appears twice", path, printable(n));
  return m;
}

nlohmann::ordered_json read_json(const std::string& path) {
  try {
    return nlohmann::ordered_json::parse(retain::read_file(path));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON ({})", path, e.what());
  }
}

// ---- readers per container ---------------------------------------------------------------
LoadedGates load_safetensors(const std::string& path, const Qwen3Config& config, std::optional<GateKind> expect) {
  const formats::SafetensorsFile f = formats::SafetensorsFile::open(path);
  std::map<std::string, Tensor> tensors;
  for (const std::string& n : f.names()) tensors.emplace(n, f.tensor(n));
  LoadedGates out{RetentionGates::from_tensors(path, tensors, f.metadata(), config, expect), {},
                  Format::safetensors};
  const auto& m = f.metadata();
  auto get = [&](const char* k) -> std::optional<std::string> {
    auto it = m.find(k);
    return it == m.end() ? std::nullopt : std::optional<std::string>(it->second);
  };
  if (auto v = get("memory")) out.info.memory = parse_double(*v);
  if (auto v = get("step"); v && parse_double(*v)) out.info.step = static_cast<int64_t>(*parse_double(*v));
  if (auto v = get("base_model")) out.info.base_model = *v;
  if (auto v = get("base_config_sha256")) out.info.base_config_sha256 = *v;
  if (auto v = get("max_seq_len"); v && parse_double(*v)) out.info.max_seq_len = static_cast<int64_t>(*parse_double(*v));
  return out;
}

LoadedGates load_gguf(const std::string& path, const Qwen3Config& config, std::optional<GateKind> expect) {
  const formats::gguf::File f = formats::gguf::read_file(path);
  auto str = [&](const char* key) -> std::optional<std::string> {
    const formats::gguf::Value* v = f.find(key);
    if (!v) return std::nullopt;
    if (v->type != formats::gguf::Type::STRING) fail("{}: metadata '{}' is not a string", path, printable(key));
    return std::get<std::string>(v->v);
  };
  auto num = [&](const char* key) -> std::optional<double> {
    const formats::gguf::Value* v = f.find(key);
    if (!v) return std::nullopt;
    if (auto* d = std::get_if<double>(&v->v)) return *d;
    if (auto* u = std::get_if<uint64_t>(&v->v)) return static_cast<double>(*u);
    if (auto* i = std::get_if<int64_t>(&v->v)) return static_cast<double>(*i);
    fail("{}: metadata '{}' is not a number", path, printable(key));
  };
  if (str("general.type") != "adapter" || str("adapter.type") != "retention_gate")
    fail("{}: not a retention-gate GGUF adapter (general.type '{}', adapter.type '{}')", path,
         printable(str("general.type").value_or("")), printable(str("adapter.type").value_or("")));
  std::map<std::string, Tensor> tensors;
  for (const auto& [n, t] : f.tensors) {
    const auto name = gate_name_from_gguf(n);
    if (!name) fail("{}: unexpected tensor '{}' (not a blk.N.retention_gate.* tensor)", path, printable(n));
    tensors.emplace(*name, t);
  }
  std::map<std::string, std::string> meta;
  if (auto k = str("retention.kind")) meta["gate_kind"] = *k;
  if (auto b = num("retention.bias_init")) meta["bias_init"] = fmt_number(*b);
  if (auto g = num("retention.gate_hidden")) meta["gate_hidden"] = fmt_number(*g);
  if (auto in = str("retention.gate_input")) meta["gate_input"] = *in;
  LoadedGates out{RetentionGates::from_tensors(path, tensors, meta, config, expect), {}, Format::gguf};
  out.info.memory = num("retention.memory");
  if (auto s = num("retention.step")) out.info.step = static_cast<int64_t>(*s);
  out.info.base_model = str("retention.base_model").value_or("");
  out.info.base_config_sha256 = str("retention.base_config_sha256").value_or("");
  if (auto s = num("retention.max_seq_len")) out.info.max_seq_len = static_cast<int64_t>(*s);
  return out;
}

LoadedGates load_pth(const std::string& path, const Qwen3Config& config, std::optional<GateKind> expect,
                     const std::map<std::string, std::string>& meta = {}) {
  const auto tensors = to_map(formats::torchfile::read_torch_file(path), path);
  return {RetentionGates::from_tensors(path, tensors, meta, config, expect), {}, Format::pth};
}

LoadedGates load_trimkv_dir(const std::string& dir, const Qwen3Config& config, std::optional<GateKind> expect) {
  const std::string cfg_path = (fs::path(dir) / "config.json").string();
  const nlohmann::ordered_json cfg = read_json(cfg_path);
  std::map<std::string, std::string> meta;
  if (auto it = cfg.find("retention_gate"); it != cfg.end()) {
    const std::string rg = it->is_string() ? it->get<std::string>() : it->dump();
    if (rg == "rg") meta["gate_kind"] = "trimkv";
    else if (rg == "rg10") meta["gate_kind"] = "dbtrimkv";
    else fail("{}: retention_gate {} (retain reads \"rg\", TRIM-KV, and \"rg10\", DBTrimKV)", cfg_path, it->dump());
  }
  if (auto it = cfg.find("retention_gate_bias_init"); it != cfg.end() && it->is_number())
    meta["bias_init"] = fmt_number(it->get<double>());
  LoadedGates out = load_pth((fs::path(dir) / kTrimkvWeights).string(), config, expect, meta);
  out.format = Format::trimkv;
  if (auto it = cfg.find("memory_size"); it != cfg.end() && it->is_number()) out.info.memory = it->get<double>();
  if (auto it = cfg.find("base_model"); it != cfg.end() && it->is_string()) out.info.base_model = it->get<std::string>();
  if (auto it = cfg.find("base_config_sha256"); it != cfg.end() && it->is_string())
    out.info.base_config_sha256 = it->get<std::string>();
  if (auto it = cfg.find("max_seq_len"); it != cfg.end() && it->is_number_integer())
    out.info.max_seq_len = it->get<int64_t>();
  if (auto it = cfg.find("retain_step"); it != cfg.end() && it->is_number_integer()) out.info.step = it->get<int64_t>();
  return out;
}

}  // namespace

std::string_view format_name(Format f) {
  switch (f) {
    case Format::safetensors: return "safetensors";
    case Format::trimkv: return "trimkv";
    case Format::gguf: return "gguf";
    case Format::pth: return "pth";
  }
  return "?";
}

Format detect_format(const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) fail("{}: no such file or directory", path);
  if (fs::is_directory(st)) {
    if (fs::exists(fs::path(path) / kTrimkvWeights)) return Format::trimkv;
    fail("{}: a directory without {} (a gate directory is the TRIM-KV layout: config.json + {})", path,
         kTrimkvWeights, kTrimkvWeights);
  }
  require_regular_file(path);  // a FIFO would block the read below
  char magic[4] = {};
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open", path);
  in.read(magic, 4);
  if (in.gcount() == 4 && std::string_view(magic, 4) == std::string_view("PK\x03\x04", 4)) return Format::pth;
  if (in.gcount() == 4 && std::string_view(magic, 4) == "GGUF") return Format::gguf;
  return Format::safetensors;
}

LoadedGates load_gates(const std::string& path, const Qwen3Config& config, std::optional<GateKind> expect) {
  switch (detect_format(path)) {
    case Format::safetensors: return load_safetensors(path, config, expect);
    case Format::gguf: return load_gguf(path, config, expect);
    case Format::pth: return load_pth(path, config, expect);
    case Format::trimkv: return load_trimkv_dir(path, config, expect);
  }
  fail("{}: unknown gate format", path);
}

std::string recorded_base_model(const std::string& path) {
  switch (detect_format(path)) {
    case Format::safetensors: {
      const formats::SafetensorsFile f = formats::SafetensorsFile::open(path);
      auto it = f.metadata().find("base_model");
      return it == f.metadata().end() ? "" : it->second;
    }
    case Format::gguf: {
      const formats::gguf::File f = formats::gguf::read_file(path);
      const formats::gguf::Value* v = f.find("retention.base_model");
      return v && v->type == formats::gguf::Type::STRING ? std::get<std::string>(v->v) : "";
    }
    case Format::trimkv: {
      const nlohmann::ordered_json cfg = read_json((fs::path(path) / "config.json").string());
      auto it = cfg.find("base_model");
      return it != cfg.end() && it->is_string() ? it->get<std::string>() : "";
    }
    case Format::pth: return "";
  }
  return "";
}

Qwen3Config trimkv_dir_model_config(const std::string& dir) {
  const std::string p = (fs::path(dir) / "config.json").string();
  return Qwen3Config::from_json(nlohmann::json::parse(read_json(p).dump()), p);
}

std::optional<std::string> gguf_name(const std::string& gate_name) {
  const auto parts = split_layer_name(gate_name, "model.layers.", ".self_attn.retention_gate.");
  if (!parts || !all_digits(parts->first)) return std::nullopt;
  for (const auto& [ours, theirs] : kSuffixes)
    if (parts->second == ours) return fmt::format("blk.{}.retention_gate.{}", parts->first, theirs);
  return std::nullopt;
}

std::optional<std::string> gate_name_from_gguf(const std::string& name) {
  const auto parts = split_layer_name(name, "blk.", ".retention_gate.");
  if (!parts || !all_digits(parts->first)) return std::nullopt;
  for (const auto& [ours, theirs] : kSuffixes)
    if (parts->second == theirs) return fmt::format("model.layers.{}.self_attn.retention_gate.{}", parts->first, ours);
  return std::nullopt;
}

}  // namespace retain::gates
