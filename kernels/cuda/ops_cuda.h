// CUDA entry points of the Qwen3 row-wise and elementwise ops (kernels/ops.h dispatches CUDA
// tensors to them after its shape, dtype and device checks). Compiled only in CUDA builds:
// kernels/ops.cpp includes this header and calls into it only under RETAIN_CUDA_KERNELS. The
// kernels are in kernels/cuda/ops.cu, their per-element/per-row math in kernels/cuda/ops_rows.h.
//
// Same contracts as the ops in kernels/ops.h (dtypes, shapes, aliasing), every tensor on the
// CUDA device. Default stream; the functions return after the launches, except embedding,
// which copies one value back to check the token ids. Deterministic: fixed reduction orders,
// no atomics in any result.
// Not yet run on a GPU (none has been lent): checked by host emulation of the same math
// (tests/cuda/test_ops_rows.cpp); tests/cuda/test_ops_cuda.cpp is the GPU check.
#pragma once
#include "kernels/tensor.h"

namespace retain::cuda {

void embedding(const Tensor& table, const Tensor& ids, Tensor& out);
void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor& out);
void rmsnorm_backward(const Tensor& x, const Tensor& w, float eps, const Tensor& dy, Tensor& dx, bool accumulate);
void rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, float attention_factor);
void rope_backward(Tensor& dx, const Tensor& positions, const Tensor& inv_freq, float attention_factor);
void swiglu(const Tensor& gate, const Tensor& up, Tensor& out);
void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate, Tensor& dup);
void add_inplace(Tensor& x, const Tensor& y);
void fill(Tensor& x, double value);
void scale_to_f32(const Tensor& src, double scale, Tensor& dst);
void concat_columns(const Tensor& a, const Tensor& b, Tensor& out);
void split_columns_add(const Tensor& src, Tensor& da, Tensor& db);

}  // namespace retain::cuda
