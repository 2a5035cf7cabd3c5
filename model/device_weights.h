// The whole frozen Qwen3 resident on the current CUDA device: what one GPU needs to train
// gates on its own (single GPU, or data parallel where every rank's GPU holds every layer).
// Sharding the weights over GPUs (FSDP over NCCL) is the multi-GPU issue's, not this class's.
#pragma once
#include <memory>
#include <vector>

#include "kernels/base/nvtx.h"
#include "model/weights.h"

namespace retain {

// Uploads every tensor once. The projections and the lm_head become `matmul_dtype`: BF16 is
// what the GPU trainer multiplies (cuBLASLt bf16 in, fp32 accumulate) and halves the memory
// (Qwen3-4B: 8.0 GB); F32 keeps a float32 checkpoint exact, for comparisons with the CPU.
// Norm weights are F32 (the row ops read F32). The embedding keeps the checkpoint's dtype
// (ops::embedding reads F32/BF16/F16); a tied lm_head of the same dtype shares its memory.
class DeviceWeightProvider : public WeightProvider {
 public:
  explicit DeviceWeightProvider(std::shared_ptr<const Qwen3Checkpoint> ckpt, DType matmul_dtype = DType::BF16);
  const Qwen3Config& config() const override { return ckpt_->config(); }
  Device device() const override { return Device::CUDA; }
  // layer(l) opens the NVTX range "layer l" until the next layer(), embedding() or lm_head() call,
  // as FsdpWeightProvider does: the layers on an Nsight timeline, whichever provider serves them.
  const LayerWeights& layer(int64_t l) override;
  const Tensor& embedding() override {
    layer_range_.end();
    return embedding_;
  }
  const Tensor& final_norm() override { return final_norm_; }
  const Tensor& lm_head() override {
    layer_range_.end();
    return lm_head_;
  }
  // Bytes of device memory the weights hold.
  size_t bytes() const { return bytes_; }

 private:
  Tensor upload(const Tensor& host, DType dtype);

  std::shared_ptr<const Qwen3Checkpoint> ckpt_;
  std::vector<LayerWeights> layers_;
  Tensor embedding_, final_norm_, lm_head_;
  size_t bytes_ = 0;
  NvtxSpan layer_range_;
};

}  // namespace retain
