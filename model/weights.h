// Qwen3 weights: the checkpoint on disk (validated against the config) and the
// WeightProvider through which the model graph asks for one layer at a time.
// The graph never knows where weights live: one rank hands out views/conversions of
// the memory-mapped checkpoint; FSDP (trainer/fsdp.h) all-gathers into a buffer.
#pragma once
#include <array>
#include <memory>
#include <string>
#include <vector>

#include "kernels/tensor.h"
#include "model/config.h"
#include "data/formats/safetensors.h"

namespace retain {

// Parameter names, as in Hugging Face's Qwen3ForCausalLM.
namespace names {
std::string layer(int64_t l, const char* suffix);  // "model.layers.{l}.{suffix}"
inline constexpr const char* kEmbed = "model.embed_tokens.weight";
inline constexpr const char* kFinalNorm = "model.norm.weight";
inline constexpr const char* kLmHead = "lm_head.weight";
}  // namespace names

// One decoder layer, F32, shapes as in nn.Linear ([out, in]).
struct LayerWeights {
  Tensor input_norm;  // [D]
  Tensor q_proj;      // [H·d, D]
  Tensor k_proj;      // [K·d, D]
  Tensor v_proj;      // [K·d, D]
  Tensor o_proj;      // [D, H·d]
  Tensor q_norm;      // [d]
  Tensor k_norm;      // [d]
  Tensor post_norm;   // [D]
  Tensor gate_proj;   // [I, D]
  Tensor up_proj;     // [I, D]
  Tensor down_proj;   // [D, I]
};

// Layer l's tensors (full name, shape) in LayerWeights field order, and those fields in the
// same order: layer_fields(w)[i] holds layer_tensors(c, l)[i].
std::vector<std::pair<std::string, Shape>> layer_tensors(const Qwen3Config& config, int64_t l);
std::array<Tensor*, 11> layer_fields(LayerWeights& w);

// The dtype a GPU provider keeps a layer tensor of `shape` in: norm weights (1-D) F32, which the
// row ops read; projections the GEMMs' `matmul_dtype`. DeviceWeightProvider and the FSDP
// provider both follow it, so their weights are the same bytes.
inline DType layer_tensor_dtype(const Shape& shape, DType matmul_dtype) {
  return shape.size() == 1 ? DType::F32 : matmul_dtype;
}

// Every tensor Qwen3ForCausalLM has for `config`, with its shape, in a stable order.
std::vector<std::pair<std::string, Shape>> expected_tensors(const Qwen3Config& config);

// A Hugging Face model directory: config.json + model.safetensors (or the sharded
// index), memory-mapped and checked: every expected tensor present with its exact shape
// and a float dtype, nothing unexpected.
class Qwen3Checkpoint {
 public:
  static Qwen3Checkpoint open(const std::string& dir);
  const Qwen3Config& config() const { return config_; }
  const std::string& dir() const { return dir_; }
  Tensor tensor(const std::string& name) const { return files_.tensor(name); }

 private:
  std::string dir_;
  Qwen3Config config_;
  formats::SafetensorsSet files_;
};

class WeightProvider {
 public:
  virtual ~WeightProvider() = default;
  virtual const Qwen3Config& config() const = 0;
  // Where the tensors it hands out live; the model computes there.
  virtual Device device() const { return Device::CPU; }
  // Layer l's weights; valid until the next call to layer().
  virtual const LayerWeights& layer(int64_t l) = 0;
  virtual const Tensor& embedding() = 0;   // [V, D]; F32, BF16 or F16 (the embedding op reads any)
  virtual const Tensor& final_norm() = 0;  // F32 [D]
  virtual const Tensor& lm_head() = 0;     // [V, D] (the embedding when tied); F32, or BF16 on a device
  // A hint that embedding() and lm_head() are not needed for a while (e.g. after the loss
  // phase): a provider that gathers them (FSDP) frees them. Tensors they returned are
  // invalid afterwards. The local provider keeps its copies and ignores it.
  virtual void release_global() {}
};

// Single-process provider over a checkpoint: F32 tensors are handed out as views of the
// mapping; BF16/F16 are converted on each request, replacing the previous layer's copies,
// so at most one layer is held in F32 at a time (the lm_head is converted once and kept).
class LocalWeightProvider : public WeightProvider {
 public:
  explicit LocalWeightProvider(std::shared_ptr<const Qwen3Checkpoint> ckpt);
  const Qwen3Config& config() const override { return ckpt_->config(); }
  const LayerWeights& layer(int64_t l) override;
  const Tensor& embedding() override { return embedding_; }
  const Tensor& final_norm() override { return final_norm_; }
  const Tensor& lm_head() override;

 private:
  std::shared_ptr<const Qwen3Checkpoint> ckpt_;
  LayerWeights layer_;
  Tensor embedding_, final_norm_, lm_head_;
};

}  // namespace retain
