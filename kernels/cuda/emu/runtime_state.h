// What the emulator's grid executor (scheduler.cpp) asks of its CUDA runtime (cudart.cpp).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

namespace retain::cuda_emu::runtime {

void set_launch_error(cudaError_t e);  // what the next cudaGetLastError reports
// Whether `bytes` of dynamic shared memory may be launched with: 48 KB, or up to the opt-in
// maximum once cudaFuncSetAttribute(kernel, MaxDynamicSharedMemorySize) raised it.
bool dynamic_shared_allowed(const void* kernel, size_t bytes);

}  // namespace retain::cuda_emu::runtime
