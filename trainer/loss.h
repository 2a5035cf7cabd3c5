// The quality losses of DESIGN §4: forward KL from the teacher's next-token distribution to
// the student's, and the student's next-token NLL, summed over the loss positions of one
// sequence, with the gradient into the student's final hidden states. The logits are never
// held for the whole sequence: `chunk` loss positions at a time are gathered, their teacher
// and student logits formed (chunk × V each), and log-softmax, KL, NTP and the logit gradient
// fused over them. The trainer divides the sums by the global count of loss positions.
#pragma once
#include <cstdint>

#include "kernels/tensor.h"

namespace retain::trainer {

// U8 [T]: 1 where t is a loss position: t+1 < T, doc[t] >= 0, doc[t+1] == doc[t],
// target_mask[t+1] != 0. doc I32 [T], target_mask U8 [T].
Tensor loss_positions(const Tensor& doc, const Tensor& target_mask);

struct QualitySums {
  double kl = 0, ntp = 0;  // Σ KL_t, Σ NTP_t over loss positions (unscaled)
  int64_t positions = 0;   // number of loss positions
};

// teacher_hidden, student_hidden F32 [T, D] (final-RMSNorm outputs); lm_head F32 [V, D];
// ids I32 [T] (the target of position t is ids[t+1]); mask U8 [T] from loss_positions.
// Logits = hidden · lm_headᵀ for the loss positions only, `chunk` of them at a time.
// KL_t = Σ_v p(log p − log q), p = softmax(teacher), q = softmax(student), temperature 1;
// NTP_t = −log q(ids[t+1]). Sums in float64.
// When d_student_hidden is given (F32 [T, D], OVERWRITTEN, rows without a loss position = 0):
// ∂(kl_scale·ΣKL + ntp_scale·ΣNTP)/∂student_hidden = (kl_scale·(q − p) + ntp_scale·(q − onehot))·lm_head.
// The result depends neither on the thread count nor (beyond the GEMM's float rounding) on
// `chunk`: each row's vocabulary is reduced in fixed blocks combined in a fixed order.
// A target id outside [0, V) is a retain::Error naming the position.
QualitySums kl_ntp_chunked(const Tensor& teacher_hidden, const Tensor& student_hidden, const Tensor& lm_head,
                           const Tensor& ids, const Tensor& mask, int64_t chunk, double kl_scale, double ntp_scale,
                           Tensor* d_student_hidden);

}  // namespace retain::trainer
