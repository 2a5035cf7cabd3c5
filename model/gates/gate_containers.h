// Reading retention gates from every container retain writes or reads (DESIGN §6; byte layouts in
// docs/formats.md): retain's safetensors gate files, the TRIM-KV authors' directory (config.json +
// trimkv_weights.pth, a torch.save archive, also one written by PyTorch itself), and a GGUF v3
// adapter; the gates are checked against the model. The writers are retain-export's
// (checkpoints/export/gate_export.h).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "model/config.h"
#include "model/gates/gates.h"

namespace retain::gates {

// The TRIM-KV directory's weights file, and the version of the eviction score a GGUF adapter
// records: (q − i)·logβ_i, logβ = logsigmoid(gate MLP(h)).
inline constexpr const char* kTrimkvWeightsFile = "trimkv_weights.pth";
inline constexpr uint32_t kScoreVersion = 1;

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
  RetentionGates gates;  // F32 values, whatever the stored dtype
  GateInfo info;
  Format format;
};

// Gates from any container for a model with `config` (shapes, layer and KV-head counts
// checked; a mismatch names the tensor). `expect` as RetentionGates::load. The gate kind
// comes from the tensors and must agree with what the container says (gate_kind,
// retention_gate "rg"/"rg10", retention.kind).
LoadedGates load_gates(const std::string& path, const Qwen3Config& config,
                       std::optional<GateKind> expect = std::nullopt);

// The base-model identity a container records (safetensors __metadata__ base_model, GGUF
// retention.base_model, a trimkv config's base_model), or "" (a .pth records none).
std::string recorded_base_model(const std::string& path);

// The model config a trimkv directory carries (its config.json is the base config plus the
// retention fields), for sources with no base model directory at hand.
Qwen3Config trimkv_dir_model_config(const std::string& dir);

// GGUF ↔ gate-file tensor names: "blk.3.retention_gate.fc1.weight" ↔
// "model.layers.3.self_attn.retention_gate.linear1.weight" (nullopt for other names).
std::optional<std::string> gguf_name(const std::string& gate_name);
std::optional<std::string> gate_name_from_gguf(const std::string& gguf_tensor_name);

}  // namespace retain::gates
