// The quality losses of DESIGN §4: forward KL from the teacher's next-token distribution to
// the student's, and the student's next-token NLL, summed over the loss positions of one
// sequence, with the gradient into the student's final hidden states. The logits are never
// held for the whole sequence: `chunk` loss positions at a time are gathered, their teacher
// and student logits formed (chunk × V each), and log-softmax, KL, NTP and the logit gradient
// fused over them. The trainer divides the sums by the global count of loss positions.
// One op, one dispatch on the device (kernels/loss.cpp): the CPU reference in kernels/cpu/loss.cpp,
// the CUDA chunk loop and its row kernels in kernels/cuda/loss.cu; both share the per-row formulas
// of kernels/cuda/loss_rows.h.
#pragma once
#include <cstdint>
#include <string>

#include "kernels/tensor.h"

namespace retain::ops {

// U8 [T]: 1 where t is a loss position: t+1 < T, doc[t] >= 0, doc[t+1] == doc[t],
// target_mask[t+1] != 0. doc I32 [T], target_mask U8 [T].
Tensor loss_positions(const Tensor& doc, const Tensor& target_mask);

// Which KL the quality loss takes (retain-train --kl). forward: KL(p‖q) = Σ p(log p − log q), the
// teacher's distribution p first (DESIGN §4, TRIM-KV's and DBTrimKV's loss); reverse: KL(q‖p) =
// Σ q(log q − log p), the student's q first (TRIM-KV's Fig. 9 ablation): mode-seeking.
enum class KlDirection { forward, reverse };
// "forward" / "reverse"; anything else fails with "<what>: ... must be forward or reverse".
KlDirection parse_kl_direction(const std::string& s, const std::string& what = "--kl");
const char* kl_direction_name(KlDirection d);

struct QualitySums {
  double kl = 0, ntp = 0;  // Σ KL_t, Σ NTP_t over loss positions (unscaled)
  int64_t positions = 0;   // number of loss positions
};

// teacher_hidden, student_hidden F32 [T, D] (final-RMSNorm outputs); lm_head [V, D];
// ids I32 [T] (the target of position t is ids[t+1]); mask U8 [T] from loss_positions.
// Devices: teacher_hidden, student_hidden, lm_head and d_student_hidden on one device, CPU or
// CUDA; ids and mask always CPU tensors (the host lists the loss positions and checks their
// targets). lm_head is F32 on the CPU, F32 or BF16 on CUDA (the GPU trainer keeps a BF16
// lm_head; ops::linear then rounds the hidden rows, and the backward GEMM the logit gradient,
// to bf16). Mixed devices are a one-line retain::Error; so is a CUDA tensor in a build without
// the CUDA kernels. On CUDA (kernels/cuda/loss.cu; not yet run on a GPU) the positions and
// targets go to the device once per call, each chunk's rows are gathered, reduced and
// scattered there, and the per-row KL and NTP come back in one copy at the end of the call.
// Logits = hidden · lm_headᵀ for the loss positions only, `chunk` of them at a time.
// KL_t = Σ_v p(log p − log q) (forward; reverse: Σ_v q(log q − log p)), p = softmax(teacher),
// q = softmax(student), temperature 1; NTP_t = −log q(ids[t+1]). Sums in float64.
// When d_student_hidden is given (F32 [T, D], OVERWRITTEN, rows without a loss position = 0):
// ∂(kl_scale·ΣKL + ntp_scale·ΣNTP)/∂student_hidden = (kl_scale·g_KL + ntp_scale·(q − onehot))·lm_head,
// g_KL = q − p (forward) or q·(log q − log p − KL_t) (reverse).
// The result depends neither on the thread count nor (beyond the GEMM's float rounding) on
// `chunk`: each row's vocabulary is reduced in a fixed order (CPU: blocks of 4096 logits, in
// order; CUDA: one thread block per row, strided partials and a fixed tree), and the rows are
// summed in position order. Both devices share the per-row formulas (kernels/cuda/loss_rows.h);
// they differ by their GEMMs' rounding and their float64 reduction orders.
// A target id outside [0, V) is a retain::Error naming the position.
QualitySums kl_ntp_chunked(const Tensor& teacher_hidden, const Tensor& student_hidden, const Tensor& lm_head,
                           const Tensor& ids, const Tensor& mask, int64_t chunk, double kl_scale, double ntp_scale,
                           Tensor* d_student_hidden, KlDirection kl = KlDirection::forward);

// The same with each row's target given: targets I32 [T] (a CPU tensor), the target id of row t,
// or −1 where t is not a loss position. What a rank of a context-parallel group passes: its rows
// are two chunks of a longer sequence, and a row's next token may live on another rank.
// kl_ntp_chunked(…, ids, mask, …) is this with targets[t] = mask[t] ? ids[t + 1] : −1.
QualitySums kl_ntp_chunked_targets(const Tensor& teacher_hidden, const Tensor& student_hidden, const Tensor& lm_head,
                                   const Tensor& targets, int64_t chunk, double kl_scale, double ntp_scale,
                                   Tensor* d_student_hidden, KlDirection kl = KlDirection::forward);

}  // namespace retain::ops
