// What every CUDA kernel header shares with the CPU tests that emulate it: RETAIN_HD marks
// functions compiled for both the device and the host (plain inline C++ when not compiled by
// nvcc), and the launch geometry of the grid-stride elementwise kernels, so an emulation walks
// the very grid the kernel gets.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define RETAIN_HD __host__ __device__ __forceinline__
#else
#define RETAIN_HD inline
#endif

namespace retain::cuda {

inline constexpr int kElemThreads = 256;          // threads per block of the elementwise kernels
inline constexpr int64_t kMaxElemBlocks = 65536;  // grid-stride beyond this

// Blocks of kElemThreads for n elements, at most kMaxElemBlocks.
inline unsigned elem_blocks(int64_t n) {
  const int64_t b = (n + kElemThreads - 1) / kElemThreads;
  return static_cast<unsigned>(b < kMaxElemBlocks ? b : kMaxElemBlocks);
}

}  // namespace retain::cuda
