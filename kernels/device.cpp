#include "kernels/device.h"

#include <cerrno>
#include <climits>
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

int local_rank_from_env(int fallback) {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"}) {
    const char* v = std::getenv(var);
    if (!v || !*v) continue;
    char* end = nullptr;
    errno = 0;
    const long local = std::strtol(v, &end, 10);
    if (errno != 0 || *end != '\0' || local < 0 || local > INT_MAX)
      fail("{}='{}' is not a node-local rank (a non-negative integer)", var, v);
    return static_cast<int>(local);
  }
  return fallback;
}

int bind_local_gpu(int fallback_local_rank) {
  const int count = cuda_device_count();
  if (count == 0) fail("no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)");
  const int ordinal = local_rank_from_env(fallback_local_rank) % count;
  cuda::set_device(ordinal);
  return ordinal;
}

}  // namespace retain
