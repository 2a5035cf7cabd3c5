#include "model/device_weights.h"

#include <fmt/format.h>

#include "kernels/base/error.h"

namespace retain {

Tensor DeviceWeightProvider::upload(const Tensor& host, DType dtype) {
  // Converted on the host (once per tensor, at start-up), so the device never holds two copies.
  Tensor t = (host.dtype() == dtype ? host : host.to_dtype(dtype)).to(Device::CUDA);
  bytes_ += t.nbytes();
  return t;
}

DeviceWeightProvider::DeviceWeightProvider(std::shared_ptr<const Qwen3Checkpoint> ckpt, DType matmul_dtype)
    : ckpt_(std::move(ckpt)) {
  RETAIN_CHECK(matmul_dtype == DType::BF16 || matmul_dtype == DType::F32,
               "DeviceWeightProvider: matmul weights must be BF16 or F32, not {}", dtype_name(matmul_dtype));
  if (cuda_device_count() == 0)
    fail("{}: no CUDA device to hold the model ({})", ckpt_->dir(),
         cuda_built() ? "cudaGetDeviceCount found none" : "this build has no CUDA support");
  const Qwen3Config& c = config();
  layers_.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const auto tensors = layer_tensors(c, l);
    const auto fields = layer_fields(layers_[static_cast<size_t>(l)]);
    for (size_t i = 0; i < tensors.size(); ++i) {
      const Tensor host = ckpt_->tensor(tensors[i].first);
      *fields[i] = upload(host, layer_tensor_dtype(host.shape(), matmul_dtype));
    }
  }
  const Tensor embed = ckpt_->tensor(names::kEmbed);
  embedding_ = upload(embed, embed.dtype());
  final_norm_ = upload(ckpt_->tensor(names::kFinalNorm), DType::F32);
  if (c.tie_word_embeddings && embedding_.dtype() == matmul_dtype)
    lm_head_ = embedding_;
  else
    lm_head_ = upload(ckpt_->tensor(c.tie_word_embeddings ? names::kEmbed : names::kLmHead), matmul_dtype);
}

const LayerWeights& DeviceWeightProvider::layer(int64_t l) {
  RETAIN_CHECK(0 <= l && l < config().num_hidden_layers, "DeviceWeightProvider: layer {} of {}", l,
               config().num_hidden_layers);
  layer_range_.start(fmt::format("layer {}", l).c_str());
  return layers_[static_cast<size_t>(l)];
}

}  // namespace retain
