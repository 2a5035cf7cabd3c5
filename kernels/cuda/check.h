// CUDA_CHECK(call): every CUDA runtime call goes through it; a failure becomes a
// retain::Error naming the call, the file and line, and CUDA's own message.
#pragma once
#include <cuda_runtime.h>

#include "kernels/base/error.h"

#define CUDA_CHECK(call)                                                                  \
  do {                                                                                    \
    cudaError_t err_ = (call);                                                            \
    if (err_ != cudaSuccess)                                                              \
      ::retain::fail("CUDA error at {}:{}: {}: {}", __FILE__, __LINE__, #call,            \
                     cudaGetErrorString(err_));                                           \
  } while (0)
