// Gate containers: detection, reading into RetentionGates, writing (docs/formats.md).
#include "checkpoints/export/gate_formats.h"

#include <unistd.h>

#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include <fmt/format.h>

#include "data/formats/gguf.h"
#include "data/formats/torch_file.h"
#include "kernels/base/atomic_file.h"
#include "model/layer_names.h"
#include "data/formats/safetensors.h"

namespace retain::gate_export {

namespace fs = std::filesystem;

namespace {

constexpr const char* kTrimkvWeights = "trimkv_weights.pth";
constexpr uint32_t kScoreVersion = 1;  // eviction score (q − i)·logβ_i, logβ = logsigmoid(gate MLP(h))

// gate-file suffix ↔ GGUF suffix
const std::pair<const char*, const char*> kSuffixes[] = {
    {"linear1.weight", "fc1.weight"}, {"linear1.bias", "fc1.bias"},   {"linear2.weight", "fc2.weight"},
    {"linear2.bias", "fc2.bias"},     {"linear3.weight", "fc3.weight"}, {"bias", "bias"},
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
LoadedGates load_safetensors(const std::string& path, const Qwen3Config& config, std::optional<gates::GateKind> expect) {
  const formats::SafetensorsFile f = formats::SafetensorsFile::open(path);
  std::map<std::string, Tensor> tensors;
  for (const std::string& n : f.names()) tensors.emplace(n, f.tensor(n));
  LoadedGates out{gates::RetentionGates::from_tensors(path, tensors, f.metadata(), config, expect), {},
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

LoadedGates load_gguf(const std::string& path, const Qwen3Config& config, std::optional<gates::GateKind> expect) {
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
  LoadedGates out{gates::RetentionGates::from_tensors(path, tensors, meta, config, expect), {}, Format::gguf};
  out.info.memory = num("retention.memory");
  if (auto s = num("retention.step")) out.info.step = static_cast<int64_t>(*s);
  out.info.base_model = str("retention.base_model").value_or("");
  out.info.base_config_sha256 = str("retention.base_config_sha256").value_or("");
  if (auto s = num("retention.max_seq_len")) out.info.max_seq_len = static_cast<int64_t>(*s);
  return out;
}

LoadedGates load_pth(const std::string& path, const Qwen3Config& config, std::optional<gates::GateKind> expect,
                     const std::map<std::string, std::string>& meta = {}) {
  const auto tensors = to_map(formats::torchfile::read_torch_file(path), path);
  return {gates::RetentionGates::from_tensors(path, tensors, meta, config, expect), {}, Format::pth};
}

LoadedGates load_trimkv_dir(const std::string& dir, const Qwen3Config& config, std::optional<gates::GateKind> expect) {
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

std::vector<std::pair<std::string, Tensor>> export_tensors(const ParameterSet& set, DType dtype) {
  RETAIN_CHECK(dtype == DType::F32 || dtype == DType::BF16, "export dtype {}", dtype_name(dtype));
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [n, t] : set.named_tensors()) out.emplace_back(n, dtype == DType::F32 ? t : t.to_dtype(dtype));
  return out;
}

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
  char magic[4] = {};
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open", path);
  in.read(magic, 4);
  if (in.gcount() == 4 && std::string_view(magic, 4) == std::string_view("PK\x03\x04", 4)) return Format::pth;
  if (in.gcount() == 4 && std::string_view(magic, 4) == "GGUF") return Format::gguf;
  return Format::safetensors;
}

LoadedGates load_gates(const std::string& path, const Qwen3Config& config, std::optional<gates::GateKind> expect) {
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

void write_safetensors(const std::string& out, const gates::RetentionGates& g, const GateInfo& info, DType dtype) {
  const gates::GateDims& d = g.dims();
  std::map<std::string, std::string> meta = {
      {"format", "retain-gates"},
      {"gate_kind", std::string(gates::gate_kind_name(d.kind))},
      {"gate_hidden", std::to_string(d.gate_hidden)},
      {"num_hidden_layers", std::to_string(d.layers)},
      {"num_key_value_heads", std::to_string(d.kv_heads)},
      {"hidden_size", std::to_string(d.hidden)},
      {"base_model", info.base_model},
      {"base_config_sha256", info.base_config_sha256},
  };
  if (g.bias_init()) meta["bias_init"] = fmt_number(*g.bias_init());
  if (info.memory) meta["memory"] = fmt_number(*info.memory);
  if (info.step) meta["step"] = std::to_string(*info.step);
  if (info.max_seq_len) meta["max_seq_len"] = std::to_string(*info.max_seq_len);
  formats::write_safetensors(out, export_tensors(g, dtype), meta);
}

void write_gguf(const std::string& out, const gates::RetentionGates& g, const GateInfo& info, DType dtype) {
  const gates::GateDims& d = g.dims();
  using formats::gguf::Value;
  formats::gguf::Metadata meta = {
      {"general.architecture", Value::str("qwen3")},
      {"general.type", Value::str("adapter")},
      {"general.alignment", Value::u32(32)},
      {"adapter.type", Value::str("retention_gate")},
      {"retention.kind", Value::str(std::string(gates::gate_kind_name(d.kind)))},
      {"retention.score_version", Value::u32(kScoreVersion)},
      {"retention.gate_hidden", Value::u32(static_cast<uint32_t>(d.gate_hidden))},
      {"retention.layer_count", Value::u32(static_cast<uint32_t>(d.layers))},
      {"retention.head_count_kv", Value::u32(static_cast<uint32_t>(d.kv_heads))},
      {"retention.embedding_length", Value::u32(static_cast<uint32_t>(d.hidden))},
      {"retention.base_model", Value::str(info.base_model)},
      {"retention.base_config_sha256", Value::str(info.base_config_sha256)},
  };
  if (info.memory) meta.emplace_back("retention.memory", Value::f64(*info.memory));
  if (g.bias_init()) meta.emplace_back("retention.bias_init", Value::f64(*g.bias_init()));
  if (info.step) meta.emplace_back("retention.step", formats::gguf::Value{formats::gguf::Type::U64, static_cast<uint64_t>(*info.step)});
  if (info.max_seq_len)
    meta.emplace_back("retention.max_seq_len", formats::gguf::Value{formats::gguf::Type::U64, static_cast<uint64_t>(*info.max_seq_len)});
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (auto& [n, t] : export_tensors(g, dtype)) {
    const auto name = gguf_name(n);
    RETAIN_CHECK(name.has_value(), "gate tensor {}", n);
    tensors.emplace_back(*name, t);
  }
  formats::gguf::write_file(out, meta, tensors, 32);
}

void write_trimkv_dir(const std::string& out, const gates::RetentionGates& g, const GateInfo& info, DType dtype,
                      const nlohmann::ordered_json& base_config, bool replace) {
  const gates::GateDims& d = g.dims();
  const bool db = d.kind == gates::GateKind::dbtrimkv;
  nlohmann::ordered_json cfg = base_config;
  cfg["retention_gate"] = db ? "rg10" : "rg";
  cfg["retention_gate_intermediate_size"] = d.gate_hidden;
  if (info.memory) {
    if (*info.memory == std::floor(*info.memory)) cfg["memory_size"] = static_cast<int64_t>(*info.memory);
    else cfg["memory_size"] = *info.memory;
  }
  cfg["global_capacity"] = db;
  cfg["tie_retention_gate_layers"] = db;
  if (g.bias_init()) cfg["retention_gate_bias_init"] = *g.bias_init();
  cfg["trainable_params"] = "self_attn.retention_gate";
  cfg["base_model"] = info.base_model;
  if (info.max_seq_len) cfg["max_seq_len"] = *info.max_seq_len;
  cfg["base_config_sha256"] = info.base_config_sha256;
  if (info.step) cfg["retain_step"] = *info.step;

  // Built beside `out` and renamed into place: the directory appears complete or not at all.
  const fs::path target = fs::absolute(fs::path(out)).lexically_normal();
  std::error_code ec;
  if (fs::exists(target, ec) && !replace)
    fail("{}: already exists (pass --force to replace it)", out);
  if (!fs::is_directory(target.parent_path(), ec)) fail("{}: parent directory {} does not exist", out, target.parent_path().string());
  const fs::path tmp = target.string() + ".tmp." + std::to_string(::getpid());
  fs::remove_all(tmp, ec);
  struct Cleanup {
    fs::path p;
    bool armed = true;
    ~Cleanup() {
      std::error_code e;
      if (armed) fs::remove_all(p, e);
    }
  } cleanup{tmp};
  if (!fs::create_directory(tmp, ec)) fail("{}: cannot create {}: {}", out, tmp.string(), ec.message());
  write_file_atomic((tmp / "config.json").string(), cfg.dump(2) + "\n");
  formats::torchfile::write_torch_file((tmp / kTrimkvWeights).string(), export_tensors(g, dtype));
  if (fs::exists(target, ec)) {
    const fs::path old = target.string() + ".old." + std::to_string(::getpid());
    fs::rename(target, old, ec);
    if (ec) fail("{}: cannot replace: {}", out, ec.message());
    fs::rename(tmp, target, ec);
    if (ec) {
      std::error_code e2;
      fs::rename(old, target, e2);
      fail("{}: cannot replace: {}", out, ec.message());
    }
    fs::remove_all(old, ec);
  } else {
    fs::rename(tmp, target, ec);
    if (ec) fail("{}: cannot create: {}", out, ec.message());
  }
  cleanup.armed = false;
}

}  // namespace retain::gate_export
