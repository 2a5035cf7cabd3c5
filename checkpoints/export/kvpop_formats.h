// KVPOP scorers (DESIGN §5, model/kvpop/scorers.h) in the containers retain-export writes and
// --init-gates reads: retain's safetensors and a GGUF v3 adapter (adapter.type "kvpop", tensors
// blk.{l}.kvpop.*; byte layout in docs/formats.md). The TRIM-KV authors' directory has no
// place for them.
#pragma once
#include <string>

#include "checkpoints/export/gate_formats.h"
#include "model/kvpop/scorers.h"

namespace retain::gate_export {

// True when the container holds kvpop scorers: a safetensors file whose __metadata__
// gate_kind is "kvpop" or whose tensors are named *.self_attn.kvpop.*, or a GGUF whose
// adapter.type is "kvpop". Other containers (.pth, TRIM-KV directories) never do.
bool holds_kvpop(const std::string& path);

struct LoadedScorers {
  kvpop::Scorers scorers;  // F32, geometry from the container when it records one
  GateInfo info;           // step, base_model, base_config_sha256, max_seq_len
  Format format;
};

// Scorers from a safetensors or GGUF container for a model with `config` (every check of
// Scorers::from_tensors; an error names the container and the tensor).
LoadedScorers load_scorers(const std::string& path, const Qwen3Config& config);

// Writers (atomic; values as `dtype`, BF16 or F32):
//   safetensors: the §5 names; __metadata__ format "retain-gates", gate_kind "kvpop", window,
//                sinks, topk, the dims, base_model, base_config_sha256, step, max_seq_len;
//   gguf:        blk.{l}.kvpop.{suffix}; retention.kind "kvpop", retention.window/sinks/topk, …
void write_scorers_safetensors(const std::string& out, const kvpop::Scorers& s, const GateInfo& info, DType dtype);
void write_scorers_gguf(const std::string& out, const kvpop::Scorers& s, const GateInfo& info, DType dtype);

// "model.layers.3.self_attn.kvpop.q_proj.weight" ↔ "blk.3.kvpop.q_proj.weight" (nullopt otherwise).
std::optional<std::string> kvpop_gguf_name(const std::string& name);
std::optional<std::string> kvpop_name_from_gguf(const std::string& gguf_name);

}  // namespace retain::gate_export
