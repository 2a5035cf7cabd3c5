// The frozen weights a training step reads, for this rank (DESIGN §2: the model asks a
// WeightProvider for layer l). On CUDA the rank first binds its GPU (by node-local rank); one rank
// holds the whole model there in bf16 (model/device_weights.h), several shard it over their GPUs
// (trainer/fsdp.h: bf16 matrices all-gathered through the comm). On the CPU one rank reads the
// mapped checkpoint layer by layer, several shard it (FSDP, F32). `force_gather` takes the FSDP
// provider with one rank too (retain-train --fsdp-force-gather: the overlap measured on one GPU).
// retain-train and retain-bench train both take their weights here.
#pragma once
#include <memory>

#include "kernels/dist/comm.h"
#include "kernels/tensor.h"
#include "model/weights.h"

namespace retain::trainer {

struct StepWeights {
  std::unique_ptr<WeightProvider> weights;
  bool whole_model = true;  // false: FSDP shards (or --fsdp-force-gather)
  int gpu = -1;             // the bound GPU's ordinal on CUDA
  double gb = 0;            // what the provider holds on the GPU (this rank's shards), CUDA only
};

// Collective on CUDA (the node-local rank is counted over the comm) and with FSDP.
StepWeights make_step_weights(std::shared_ptr<const Qwen3Checkpoint> model, Device device, dist::Comm& comm,
                              bool force_gather);

}  // namespace retain::trainer
