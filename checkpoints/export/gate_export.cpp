// retain-export's gate writers (gate_export.h): each container built beside its destination and
// renamed into place.
#include "checkpoints/export/gate_export.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>

#include <fmt/format.h>

#include "data/formats/gguf.h"
#include "data/formats/safetensors.h"
#include "data/formats/torch_file.h"
#include "kernels/base/atomic_file.h"

namespace retain::exports {

namespace fs = std::filesystem;

namespace {

std::string fmt_number(double x) { return fmt::format("{}", x); }

}  // namespace

std::vector<std::pair<std::string, Tensor>> export_tensors(const ParameterSet& set, DType dtype) {
  RETAIN_CHECK(dtype == DType::F32 || dtype == DType::BF16, "export dtype {}", dtype_name(dtype));
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [n, t] : set.named_tensors()) out.emplace_back(n, dtype == DType::F32 ? t : t.to_dtype(dtype));
  return out;
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
  if (g.reads_kv()) meta["gate_input"] = "kv";
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
      {"retention.score_version", Value::u32(gates::kScoreVersion)},
      {"retention.gate_hidden", Value::u32(static_cast<uint32_t>(d.gate_hidden))},
      {"retention.layer_count", Value::u32(static_cast<uint32_t>(d.layers))},
      {"retention.head_count_kv", Value::u32(static_cast<uint32_t>(d.kv_heads))},
      {"retention.embedding_length", Value::u32(static_cast<uint32_t>(d.hidden))},
      {"retention.base_model", Value::str(info.base_model)},
      {"retention.base_config_sha256", Value::str(info.base_config_sha256)},
  };
  if (g.reads_kv()) meta.emplace_back("retention.gate_input", Value::str("kv"));
  if (info.memory) meta.emplace_back("retention.memory", Value::f64(*info.memory));
  if (g.bias_init()) meta.emplace_back("retention.bias_init", Value::f64(*g.bias_init()));
  if (info.step) meta.emplace_back("retention.step", formats::gguf::Value{formats::gguf::Type::U64, static_cast<uint64_t>(*info.step)});
  if (info.max_seq_len)
    meta.emplace_back("retention.max_seq_len", formats::gguf::Value{formats::gguf::Type::U64, static_cast<uint64_t>(*info.max_seq_len)});
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (auto& [n, t] : export_tensors(g, dtype)) {
    const auto name = gates::gguf_name(n);
    RETAIN_CHECK(name.has_value(), "gate tensor {}", n);
    tensors.emplace_back(*name, t);
  }
  formats::gguf::write_file(out, meta, tensors, 32);
}

void write_trimkv_dir(const std::string& out, const gates::RetentionGates& g, const GateInfo& info, DType dtype,
                      const nlohmann::ordered_json& base_config, bool replace) {
  const gates::GateDims& d = g.dims();
  if (g.reads_kv())
    fail("{}: the authors' layout (config.json + {}) has no gate reading [k ‖ v] (their RetentionGate reads the "
         "hidden state); export it as safetensors or gguf",
         out, gates::kTrimkvWeightsFile);
  if (g.is_linear())
    fail("{}: the authors' layout (config.json + {}) has no linear gate (their RetentionGate is an MLP); export a "
         "linear gate as safetensors or gguf",
         out, gates::kTrimkvWeightsFile);
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
  formats::torchfile::write_torch_file((tmp / gates::kTrimkvWeightsFile).string(), export_tensors(g, dtype));
  replace_directory(tmp.string(), target.string(), out);
  cleanup.armed = false;
}

}  // namespace retain::exports
