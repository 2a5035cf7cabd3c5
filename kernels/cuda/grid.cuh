// Grid-stride launches, shared by the elementwise and row kernels (ops.cu, gates.cu, loss.cu):
// a grid of at most `max_blocks` blocks covers any n, each thread stepping by the grid's size.
#pragma once
#include <cstdint>

namespace retain::cuda {

inline unsigned grid_blocks(int64_t n, int threads, int64_t max_blocks) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < max_blocks ? b : max_blocks);
}

__device__ __forceinline__ int64_t first_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

}  // namespace retain::cuda
