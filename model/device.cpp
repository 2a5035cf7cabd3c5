#include "model/device.h"

#include <cstdlib>
#include <string_view>

#include "kernels/base/error.h"
#include "kernels/cuda/memory.h"

namespace retain {

Device resolve_device(const std::string& flag, const std::string& flag_name) {
  std::string want = flag;
  std::string source = flag_name;
  if (want.empty()) {
    if (const char* env = std::getenv("RETAIN_DEVICE"); env && *env) {
      want = env;
      source = "RETAIN_DEVICE";
    } else {
      return cuda_device_count() > 0 ? Device::CUDA : Device::CPU;
    }
  }
  if (want == "cpu") return Device::CPU;
  if (want != "cuda") fail("{}: unknown device '{}' (expected cpu or cuda)", source, want);
  if (!cuda_built()) fail("{} cuda: this build of retain has no CUDA support (nvcc was not found at configure time)", source);
  if (cuda_device_count() == 0)
    fail("{} cuda: no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)", source);
  return Device::CUDA;
}

int bind_local_gpu() {
  const int count = cuda_device_count();
  if (count == 0) fail("no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)");
  int local = 0;
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"})
    if (const char* v = std::getenv(var); v && *v) {
      local = std::atoi(v);
      break;
    }
  const int ordinal = local % count;
  cuda::set_device(ordinal);
  return ordinal;
}

}  // namespace retain
