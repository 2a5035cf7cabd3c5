// Writing KVPOP scorers into the containers retain-export writes (safetensors, GGUF; DESIGN §5,
// docs/formats.md); reading them is the scorers' own (model/kvpop/scorer_containers.h).
#pragma once
#include <string>

#include "checkpoints/export/gate_export.h"
#include "model/kvpop/scorers.h"

namespace retain::exports {

// Writers (atomic; values as `dtype`, BF16 or F32):
//   safetensors: the §5 names; __metadata__ format "retain-gates", gate_kind "kvpop", window,
//                sinks, topk, the dims, base_model, base_config_sha256, step, max_seq_len;
//   gguf:        blk.{l}.kvpop.{suffix}; retention.kind "kvpop", retention.window/sinks/topk, …
void write_scorers_safetensors(const std::string& out, const kvpop::Scorers& s, const GateInfo& info, DType dtype);
void write_scorers_gguf(const std::string& out, const kvpop::Scorers& s, const GateInfo& info, DType dtype);

}  // namespace retain::exports
