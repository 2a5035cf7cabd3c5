// CUDA entry points of the GEMM ops and the dtype cast (kernels/ops.h dispatches CUDA tensors
// to them after its shape, dtype, aliasing and device checks). Compiled only in CUDA builds:
// kernels/ops.cpp includes this header and calls into it only under RETAIN_CUDA_KERNELS.
// Implemented in kernels/cuda/gemm.cu (cuBLASLt, CUBLAS_COMPUTE_32F); the cast's per-element
// conversion is in kernels/cuda/cast_rows.h.
//
// Same contracts as kernels/ops.h, every tensor on the current CUDA device. Default stream, no
// host synchronization: the functions return after queuing the work. With F32 weights the
// products are float32 throughout (no TF32); with BF16 weights the F32 activation (x, or dy for
// linear_backward_input) is first rounded to bf16 in a reusable device buffer, then multiplied
// as bf16 with fp32 accumulation. A BF16 x (linear only) is read in place by BF16 weights and
// widened into that buffer for F32 ones. Bitwise repeatable for a given shape on a given device: the
// algorithm cuBLASLt picks for a shape is cached, and none of its reductions use atomics.
//
// NOT YET RUN ON A GPU: no GPU has been lent to this project. The cast's conversions are checked
// by host emulation (tests/cuda/test_cast_rows.cpp); tests/cuda/test_gemm_cuda.cpp is the GPU
// check against the CPU reference and skips without a device.
#pragma once
#include "kernels/tensor.h"

namespace retain::cuda {

void linear(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate);
void linear_backward_input(const Tensor& dy, const Tensor& w, Tensor& dx, bool accumulate);
void linear_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, bool accumulate);
void cast(const Tensor& src, Tensor& dst);

}  // namespace retain::cuda
