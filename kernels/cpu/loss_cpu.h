// CPU reference of ops::kl_ntp_chunked (kernels/loss.h; arguments checked there).
#pragma once
#include <cstdint>

#include "kernels/loss.h"
#include "kernels/loss_positions.h"
#include "kernels/tensor.h"

namespace retain::cpu {

ops::QualitySums kl_ntp_chunked(const Tensor& teacher_hidden, const Tensor& student_hidden, const Tensor& lm_head,
                                const ops::LossPositions& lp, int64_t chunk, double kl_scale, double ntp_scale,
                                Tensor* d_student_hidden, ops::KlDirection kl);

}  // namespace retain::cpu
