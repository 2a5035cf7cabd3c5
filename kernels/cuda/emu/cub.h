// The CUB calls retain makes, for the CUDA emulator: CUB's device-wide algorithms are kernels
// of NVIDIA's, not ours, so here they are their plain sequential meaning on the emulated
// device's memory (which is host memory). The two-call protocol (size query, then the run) and
// the argument checks are kept, so the caller's code runs unchanged.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

namespace cub {

struct DeviceScan {
  // out[i] = in[0] op in[1] op … op in[i].
  template <class In, class Out, class Op>
  static cudaError_t InclusiveScan(void* temp, size_t& temp_bytes, In in, Out out, Op op, int n,
                                   cudaStream_t = nullptr) {
    if (temp == nullptr) {
      temp_bytes = 1;
      return cudaSuccess;
    }
    if (temp_bytes < 1 || n < 0) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    auto acc = in[0];
    out[0] = acc;
    for (int i = 1; i < n; ++i) {
      acc = op(acc, in[i]);
      out[i] = acc;
    }
    return cudaSuccess;
  }
};

}  // namespace cub
