// Retention gates in every container retain reads and writes (DESIGN §6; byte layouts in
// docs/formats.md): retain's safetensors gate files, the TRIM-KV authors' directory
// (config.json + trimkv_weights.pth, a torch.save archive), and a GGUF v3 adapter. Reading
// accepts any of them — also a trimkv_weights.pth written by PyTorch itself — and checks the
// gates against the model; writing is what retain-export does.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/gates/gates.h"

namespace retain::gate_export {

enum class Format { safetensors, trimkv, gguf, pth };
std::string_view format_name(Format f);  // "safetensors", "trimkv", "gguf", "pth"
// The container at `path`: a directory holding trimkv_weights.pth is `trimkv`; a file is
// told by its first bytes (a zip: `pth`, "GGUF": `gguf`, else `safetensors`). Throws when
// the path does not exist or is a directory of another kind.
Format detect_format(const std::string& path);

// What travels with the gates besides their tensors (absent when the source does not say).
struct GateInfo {
  std::optional<double> memory;           // M
  std::optional<int64_t> step;            // optimizer steps the gates were trained for
  std::string base_model;                 // the base model's identity: an absolute directory or a hub id
  std::string base_config_sha256;         // of the base model's config.json bytes
  std::optional<int64_t> max_seq_len;     // sequence length trained at
};

struct LoadedGates {
  gates::RetentionGates gates;  // F32 values, whatever the stored dtype
  GateInfo info;
  Format format;
};

// Gates from any container for a model with `config` (shapes, layer and KV-head counts
// checked; a mismatch names the tensor). `expect` as RetentionGates::load. The gate kind
// comes from the tensors and must agree with what the container says (gate_kind,
// retention_gate "rg"/"rg10", retention.kind).
LoadedGates load_gates(const std::string& path, const Qwen3Config& config,
                       std::optional<gates::GateKind> expect = std::nullopt);

// The base-model identity a container records (safetensors __metadata__ base_model, GGUF
// retention.base_model, a trimkv config's base_model), or "" (a .pth records none).
std::string recorded_base_model(const std::string& path);

// The model config a trimkv directory carries (its config.json is the base config plus the
// retention fields), for sources with no base model directory at hand.
Qwen3Config trimkv_dir_model_config(const std::string& dir);

// Every tensor of a gate or scorer set under its file names, its values as `dtype` (BF16 or
// F32): what each writer below (and the KVPOP scorers' writers) stores.
std::vector<std::pair<std::string, Tensor>> export_tensors(const ParameterSet& set, DType dtype);

// Writers (atomic; values converted to `dtype`, BF16 or F32):
//   safetensors: the DESIGN names, __metadata__ format "retain-gates", gate_kind, memory,
//                gate_hidden, bias_init, base_model, base_config_sha256, step (+ the dims);
//   gguf:        blk.{l}.retention_gate.* tensors and retention.* metadata (docs/formats.md);
//   trimkv:      the directory `out` (refused if it exists unless `replace`): config.json =
//                base_config + the retention fields, and trimkv_weights.pth.
void write_safetensors(const std::string& out, const gates::RetentionGates& g, const GateInfo& info, DType dtype);
void write_gguf(const std::string& out, const gates::RetentionGates& g, const GateInfo& info, DType dtype);
void write_trimkv_dir(const std::string& out, const gates::RetentionGates& g, const GateInfo& info, DType dtype,
                      const nlohmann::ordered_json& base_config, bool replace);

// GGUF ↔ gate-file tensor names: "blk.3.retention_gate.fc1.weight" ↔
// "model.layers.3.self_attn.retention_gate.linear1.weight" (nullopt for other names).
std::optional<std::string> gguf_name(const std::string& gate_name);
std::optional<std::string> gate_name_from_gguf(const std::string& gguf_tensor_name);

}  // namespace retain::gate_export
