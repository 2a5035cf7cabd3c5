// CUDA entry points of the KVPOP ops (kernels/kvpop.h dispatches CUDA tensors to them after its
// shape, dtype, device and document checks). Compiled only in CUDA builds: kernels/kvpop.cpp
// includes this header and calls into it only under RETAIN_CUDA_KERNELS. The kernels are in
// kernels/cuda/kvpop.cu, their per-thread math in kernels/cuda/kvpop_tiles.h.
//
// Every tensor on the CUDA device and contiguous, the outputs allocated there. Default stream;
// the functions return after the launches (temporaries are freed with cudaFree, which waits for
// the device). Results are deterministic: fixed reduction orders, no atomics.
// Not yet run on a GPU (none has been lent): checked by host emulation of the same tile code
// (tests/cuda/test_kvpop_tiles.cpp); tests/cuda/test_kvpop_cuda.cpp is the GPU check.
#pragma once
#include <cstdint>

#include "kernels/kvpop.h"
#include "kernels/tensor.h"

namespace retain::cuda {

// kvpop::future_attention_target: q F32 [T, H, hd], k F32 [T, K, hd], lse F32 [T, H], doc I32
// [T] (contiguous runs, already checked) → log_m F32 [K, T]. Float32 scores and ≤ 64-term
// float32 exp-sums merged in float64. Fails when head_dim needs more shared memory per block
// than the device has (hd ≤ 449 with sm_90's 227 KiB per block).
Tensor kvpop_future_attention_target(const Tensor& q, const Tensor& k, const Tensor& lse, const Tensor& doc,
                                     int64_t w, float scale);
// kvpop::future_attention_sums / _finish (the target by spans; context parallelism), the same
// math as the CPU's: F32 q, k, lse, I32 docs, F64 running mx and sum [Tk, H]; every tensor on the
// device. Unverified on a GPU (emulated: tests/cuda/test_kvpop_cuda.cpp).
void kvpop_future_attention_sums(const Tensor& q, const Tensor& lse, const Tensor& q_doc, int64_t q_start,
                                 const Tensor& k, const Tensor& k_doc, int64_t k_start, int64_t w, float scale, Tensor& mx,
                                 Tensor& sum);
Tensor kvpop_future_attention_finish(const Tensor& mx, const Tensor& sum, int64_t K);

// kvpop::mlstm_scores / mlstm_scores_backward: the same shapes (d = 2r ≤ 256), float64
// throughout as the CPU reference. The backward returns dP and overwrites dw_o [r], db_o [1],
// all on the device.
Tensor kvpop_mlstm_scores(const kvpop::Projected& P, const Tensor& doc, int64_t w, const Tensor& w_o,
                          const Tensor& b_o);
kvpop::Projected kvpop_mlstm_scores_backward(const kvpop::Projected& P, const Tensor& doc, int64_t w,
                                             const Tensor& w_o, const Tensor& dscore, Tensor& dw_o, Tensor& db_o);

}  // namespace retain::cuda
