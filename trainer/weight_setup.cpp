#include "trainer/weight_setup.h"

#include "kernels/device.h"
#include "model/device_weights.h"
#include "trainer/fsdp.h"

namespace retain::trainer {

StepWeights make_step_weights(std::shared_ptr<const Qwen3Checkpoint> model, Device device, dist::Comm& comm,
                              bool force_gather) {
  StepWeights out;
  out.whole_model = comm.size() == 1 && !force_gather;
  if (device == Device::CUDA) {
    out.gpu = bind_local_gpu(dist::node_local_rank(comm));  // first: a collective
    if (out.whole_model) {
      auto whole = std::make_unique<DeviceWeightProvider>(model);
      out.gb = static_cast<double>(whole->bytes()) / 1e9;
      out.weights = std::move(whole);
    } else {
      auto sharded = std::make_unique<FsdpWeightProvider>(model, comm, FsdpOptions{Device::CUDA, DType::BF16, force_gather});
      out.gb = static_cast<double>(sharded->shard_bytes()) / 1e9;
      out.weights = std::move(sharded);
    }
    return out;
  }
  if (out.whole_model)
    out.weights = std::make_unique<LocalWeightProvider>(model);
  else
    out.weights = std::make_unique<FsdpWeightProvider>(model, comm, FsdpOptions{Device::CPU, DType::F32, force_gather});
  return out;
}

}  // namespace retain::trainer
