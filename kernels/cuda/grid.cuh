// Grid-stride loops, shared by the elementwise and row kernels (ops.cu, gates.cu, loss.cu,
// gemm.cu): a grid of elem_blocks(n) blocks (kernels/cuda/host_device.h) covers any n, each
// thread stepping by the grid's size.
#pragma once
#include <cstdint>

#include "kernels/cuda/host_device.h"

namespace retain::cuda {

__device__ __forceinline__ int64_t first_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

}  // namespace retain::cuda
