// RoPE inverse frequencies and the cos/sin attention factor for a Qwen3 config,
// computed the way transformers computes them (float32 steps where it uses float32),
// so that our angles match Hugging Face's bit for bit in the common cases.
#pragma once
#include "kernels/tensor.h"
#include "model/config.h"

namespace retain {

struct RopeParams {
  Tensor inv_freq;  // F32 [head_dim / 2]
  float attention_factor = 1.0f;
};

// inv_freq is computed on the host and placed on `device`, where the pass's RoPE runs.
RopeParams compute_rope_params(const Qwen3Config& config, Device device = Device::CPU);

}  // namespace retain
