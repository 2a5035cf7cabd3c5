// CUBLAS_CHECK(call): every cuBLAS(Lt) call goes through it; a failure becomes a retain::Error
// naming the call, the file and line, and cuBLAS's own status string (as CUDA_CHECK does for
// the runtime).
#pragma once
#include <cublasLt.h>

#include "kernels/base/error.h"

#define CUBLAS_CHECK(call)                                                                  \
  do {                                                                                      \
    const cublasStatus_t status_ = (call);                                                  \
    if (status_ != CUBLAS_STATUS_SUCCESS)                                                   \
      ::retain::fail("cuBLAS error at {}:{}: {}: {}", __FILE__, __LINE__, #call,            \
                     cublasLtGetStatusString(status_));                                     \
  } while (0)
