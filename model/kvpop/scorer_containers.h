// Reading KVPOP scorers (DESIGN §5, model/kvpop/scorers.h) from the containers retain-export
// writes and --init-gates reads: retain's safetensors and a GGUF v3 adapter (adapter.type
// "kvpop", tensors blk.{l}.kvpop.*; byte layout in docs/formats.md). The TRIM-KV authors'
// directory has no place for them. The writers are retain-export's (checkpoints/export/kvpop_export.h).
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "model/gates/gate_containers.h"
#include "model/kvpop/scorers.h"

namespace retain::kvpop {

// The version of the score a KVPOP GGUF adapter records: 1: ŝ_i(q) = score_i + (q − i)·log γ with
// log γ = log 0.999 + (log 0.999999 − log 0.999)·σ(θ) (DESIGN §5); 2: ŝ_i(q) = score_i +
// ⌊(q − i)/n⌋·log γ with log γ in [log γ_min, log γ_max], n, γ_min, γ_max in retention.decay_every,
// retention.decay_min, retention.decay_max. Writers use 1 for the default decay (n = 1, the
// default range), so older readers keep reading those files and refuse the others.
inline constexpr uint32_t kScoreVersion = 1;
inline constexpr uint32_t kScoreVersionDecay = 2;

// True when the container holds kvpop scorers: a safetensors file whose __metadata__
// gate_kind is "kvpop" or whose tensors are named *.self_attn.kvpop.*, or a GGUF whose
// adapter.type is "kvpop". Other containers (.pth, TRIM-KV directories) never do.
bool holds_kvpop(const std::string& path);

struct LoadedScorers {
  Scorers scorers;         // F32, geometry from the container when it records one
  gates::GateInfo info;    // step, base_model, base_config_sha256, max_seq_len
  gates::Format format;
};

// Scorers from a safetensors or GGUF container for a model with `config` (every check of
// Scorers::from_tensors; an error names the container and the tensor).
LoadedScorers load_scorers(const std::string& path, const Qwen3Config& config);

// "model.layers.3.self_attn.kvpop.q_proj.weight" ↔ "blk.3.kvpop.q_proj.weight" (nullopt otherwise).
std::optional<std::string> kvpop_gguf_name(const std::string& name);
std::optional<std::string> kvpop_name_from_gguf(const std::string& gguf_name);

}  // namespace retain::kvpop
