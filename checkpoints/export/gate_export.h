// Writing retention gates into every container retain-export writes (DESIGN §6; byte layouts in
// docs/formats.md): retain's safetensors, the TRIM-KV authors' directory, a GGUF v3 adapter.
// Reading any of them is the gates' own (model/gates/gate_containers.h). The namespace is
// `exports`: `export` is a C++ keyword.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/gates/gate_containers.h"
#include "model/param_set.h"

namespace retain::exports {

using gates::GateInfo;

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

}  // namespace retain::exports
