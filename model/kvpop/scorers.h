// KVPOP scorer parameters (DESIGN §5): per layer l, stacked over the K KV heads, under
// "model.layers.{l}.self_attn.kvpop." + q_proj.weight, k_proj.weight, v_proj.weight [K, r, 2d],
// igate.weight [K, 2d], igate.bias [K], fgate.weight [K, 2d], fgate.bias [K], out.weight [K, r],
// out.bias [K], decay [K] (θ), with d = head_dim and r = d / 2. The file format is in
// docs/formats.md ("KVPOP scorer files"); window, sinks and topk travel in __metadata__ because
// the policy needs them at inference.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kernels/kvpop.h"
#include "model/config.h"
#include "model/param_set.h"

namespace retain::kvpop {

struct ScorerDims {
  int64_t layers = 0;    // L = num_hidden_layers
  int64_t kv_heads = 0;  // K = num_key_value_heads
  int64_t head_dim = 0;  // d (even)
  int64_t rank() const { return head_dim / 2; }  // r
};

// The policy geometry stored with the scorers (DESIGN §5 cache: sinks ∪ window ∪ top-k).
struct PolicyGeometry {
  int64_t window = 64, sinks = 4, topk = 0;
  bool operator==(const PolicyGeometry&) const = default;
};

// "model.layers.{l}.self_attn.kvpop.{suffix}"
std::string scorer_tensor_name(int64_t layer, std::string_view suffix);
// The decay's __metadata__ entries (decay_every, decay_min, decay_max; empty for the default
// decay, so files of the default rule are as before) and their reader (absent keys: defaults;
// a bad value is one retain::Error naming `source` and the key).
std::map<std::string, std::string> decay_metadata(const Decay& d);
Decay decay_from_metadata(const std::string& source, const std::map<std::string, std::string>& meta);
// The per-layer suffixes, in file (and parameter) order.
const std::vector<std::string>& scorer_suffixes();

class Scorers : public ParameterSet {
 public:
  Scorers() = default;
  // Fresh scorers: the weights (q/k/v_proj, igate/fgate.weight, out.weight) N(0, 0.02), drawn
  // from std::mt19937_64(seed) in parameter order (layer by layer, suffix order); b_i = 0,
  // b_f = 3, out.bias = 0, decay θ = 0.
  static Scorers init(const ScorerDims& dims, const PolicyGeometry& geometry, uint64_t seed);
  // Scorers from a safetensors file / any container's tensors (F32/BF16/F16/F64 → F32) for the
  // model `config`: every tensor present with its shape, nothing else, all finite; __metadata__
  // gate_kind (when present) must be "kvpop"; window/sinks/topk are read when present. Every
  // problem is one retain::Error "<source>: <problem naming the tensor>".
  static Scorers load(const std::string& path, const Qwen3Config& config);
  static Scorers from_tensors(const std::string& source, const std::map<std::string, Tensor>& tensors,
                              const std::map<std::string, std::string>& metadata, const Qwen3Config& config);
  // Dimensions from the model config; fails (naming config.json's fields) for an odd head_dim.
  static ScorerDims dims_for(const Qwen3Config& config);

  // F32 tensors in file order, atomically; __metadata__: format, gate_kind "kvpop",
  // num_hidden_layers, num_key_value_heads, head_dim, window, sinks, topk (when known), then `extra`.
  void save(const std::string& path, const std::map<std::string, std::string>& extra = {}) const override;
  std::vector<std::pair<std::string, Tensor>> named_tensors() const override;

  std::vector<Parameter>& parameters() override { return params_; }
  const std::vector<Parameter>& parameters() const override { return params_; }
  const ScorerDims& dims() const { return dims_; }
  // From init() or a file's __metadata__ (nullopt when a file has none).
  const std::optional<PolicyGeometry>& geometry() const { return geometry_; }
  void set_geometry(const PolicyGeometry& g) { geometry_ = g; }
  // The effective score's decay (every n, range of γ): from init()'s default, set_decay() or a
  // file's __metadata__ decay_every / decay_min / decay_max (absent: the defaults, n = 1 and
  // [0.999, 0.999999]). Written to __metadata__ only where it differs from the default.
  const Decay& decay() const { return decay_; }
  void set_decay(const Decay& d);

  // Per layer and KV head, views (sharing storage) of the stacked values / gradients in the
  // HeadParams layout of kernels/kvpop.h: writing into a gradient view writes the stacked grad.
  std::vector<std::vector<HeadParams>> head_values() const { return heads(false); }
  std::vector<std::vector<HeadParams>> head_grads() const { return heads(true); }

 private:
  explicit Scorers(const ScorerDims& dims);  // zero values and gradients
  std::vector<std::vector<HeadParams>> heads(bool grad) const;

  ScorerDims dims_;
  std::optional<PolicyGeometry> geometry_;
  Decay decay_;
  std::vector<Parameter> params_;  // layer-major, scorer_suffixes() order within a layer
};

}  // namespace retain::kvpop
