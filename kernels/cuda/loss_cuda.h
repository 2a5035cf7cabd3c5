// CUDA side of the fused chunked KL + NTP loss (kernels/loss.h; kernels/loss.cpp checks the
// arguments, lists the loss positions and dispatches CUDA tensors to kl_ntp_chunked below, which
// runs the chunk loop with the GEMMs through ops::linear / ops::linear_backward_input and the
// row kernels below). Kernels in kernels/cuda/loss.cu, their per-row math in
// kernels/cuda/loss_rows.h.
//
// NOT YET RUN ON A GPU: no GPU has been lent to this project's sessions. The row kernel's math
// is checked by host emulation in every build (tests/cuda/test_loss_rows.cpp);
// tests/cuda/test_loss_cuda.cpp is the GPU check, and skips without a device.
//
// `list` is the call's I32 [2, P] device tensor: row 0 the loss positions in order, row 1 the
// target id of each (checked on the host to be in [0, V)); `begin` is the chunk's first index
// into it. Every tensor on the current CUDA device, default stream; the functions return after
// the launches. No atomics in any result: bitwise repeatable.
#pragma once
#include <cstdint>

#include "kernels/loss.h"
#include "kernels/loss_positions.h"
#include "kernels/tensor.h"

namespace retain::cuda {

// ops::kl_ntp_chunked for CUDA tensors, after its checks, with the host's list of positions.
ops::QualitySums kl_ntp_chunked(const Tensor& teacher_hidden, const Tensor& student_hidden, const Tensor& lm_head,
                                const ops::LossPositions& lp, int64_t chunk, double kl_scale, double ntp_scale,
                                Tensor* d_student_hidden, ops::KlDirection kl);

// dst[r, :] = src[list[0, begin + r], :] for r < dst.dim(0). src F32 [T, D], dst F32 [c, D].
void gather_loss_rows(const Tensor& src, const Tensor& list, int64_t begin, Tensor& dst);

// dst[list[0, begin + r], :] = src[r, :] for r < src.dim(0) (other rows untouched; the positions
// are distinct, so no two rows collide). src F32 [c, D], dst F32 [T, D].
void scatter_loss_rows(const Tensor& src, const Tensor& list, int64_t begin, Tensor& dst);

// Per row r < c of teacher_logits / student_logits (F32 [c, V] each), with target
// list[1, begin + r]: KL into row_losses[0, begin + r] and NTP into row_losses[1, begin + r]
// (row_losses F64 [2, P]); with `gradient`, the student logits are overwritten by
// kl_scale·(q − p) + ntp_scale·(q − onehot). One block per row, V of any size.
void kl_ntp_rows(const Tensor& teacher_logits, Tensor& student_logits, const Tensor& list, int64_t begin,
                 double kl_scale, double ntp_scale, bool gradient, Tensor& row_losses,
                 ops::KlDirection kl = ops::KlDirection::forward);

}  // namespace retain::cuda
