// Checks, the host's list of loss positions, and the device dispatch of kernels/loss.h. Per chunk
// of gathered loss positions both devices do the same:
//   1. teacher and student logits, chunk × V each (ops::linear: OpenBLAS or cuBLASLt);
//   2. per row, the maxima (exact, so their order is irrelevant);
//   3. per row, Σ e_t, Σ e_s and Σ e_t·(t − s) in float64 with e = exp(logit − max), in a fixed
//      order, so no result depends on the thread count;
//      KL = Σ e_t(t − s)/Z_t − lse_t + lse_s (= Σ p(log p − log q), since Σ p = 1),
//      NTP = lse_s − s_y;
//   4. the logit gradient kl_scale·(q − p) + ntp_scale·(q − onehot) written over the student
//      logits, and one more GEMM, gradient · lm_head, gives the hidden-state gradient.
// The CPU (kernels/cpu/loss.cpp) reduces each row in blocks of logits, CUDA (kernels/cuda/loss.cu)
// gives each row a block of threads; kernels/cuda/loss_rows.h holds the formulas both use.
#include "kernels/loss.h"

#include <cstring>

#include "kernels/base/error.h"
#include "kernels/cpu/loss_cpu.h"
#include "kernels/loss_positions.h"
#include "kernels/cuda/memory.h"
#ifdef RETAIN_CUDA_KERNELS
#include "kernels/cuda/loss_cuda.h"
#endif

namespace retain::ops {

namespace {

void check_f32_2d(const Tensor& t, const char* what) {
  RETAIN_CHECK(t.dtype() == DType::F32 && t.ndim() == 2, "kl_ntp_chunked: {} must be a 2-d F32 tensor, got {} {}", what,
               dtype_name(t.dtype()), shape_str(t.shape()));
}

void check_device(const Tensor& t, Device device, const char* what) {
  if (t.device() != device)
    fail("kl_ntp_chunked: all tensors but ids and mask must be on one device (teacher_hidden is on {}, {} on {})",
         device_name(device), what, device_name(t.device()));
}

LossPositions list_positions(const Tensor& ids, const Tensor& mask, int64_t V) {
  const int64_t T = mask.dim(0);
  const uint8_t* m = mask.data<uint8_t>();
  const int32_t* id = ids.data<int32_t>();
  LossPositions lp;
  for (int64_t t = 0; t < T; ++t) {
    if (!m[t]) continue;
    RETAIN_CHECK(t + 1 < T, "kl_ntp_chunked: position {} is the last of {} and has no target", t, T);
    if (id[t + 1] < 0 || id[t + 1] >= V)
      fail("kl_ntp_chunked: target id {} at position {} is outside the vocabulary [0, {})", id[t + 1], t + 1, V);
    lp.pos.push_back(t);
    lp.target.push_back(id[t + 1]);
  }
  return lp;
}

}  // namespace

KlDirection parse_kl_direction(const std::string& s, const std::string& what) {
  if (s == "forward") return KlDirection::forward;
  if (s == "reverse") return KlDirection::reverse;
  fail("{}: '{}' must be forward or reverse", what, s);
}

const char* kl_direction_name(KlDirection d) { return d == KlDirection::reverse ? "reverse" : "forward"; }

Tensor loss_positions(const Tensor& doc, const Tensor& target_mask) {
  RETAIN_CHECK(doc.dtype() == DType::I32 && doc.ndim() == 1, "loss_positions: doc must be I32 [T], got {} {}",
               dtype_name(doc.dtype()), shape_str(doc.shape()));
  RETAIN_CHECK(target_mask.dtype() == DType::U8 && target_mask.shape() == doc.shape(),
               "loss_positions: target_mask must be U8 {}, got {} {}", shape_str(doc.shape()),
               dtype_name(target_mask.dtype()), shape_str(target_mask.shape()));
  const int64_t T = doc.dim(0);
  Tensor out = Tensor::zeros({T}, DType::U8);
  const int32_t* d = doc.data<int32_t>();
  const uint8_t* tm = target_mask.data<uint8_t>();
  uint8_t* o = out.data<uint8_t>();
  for (int64_t t = 0; t + 1 < T; ++t) o[t] = d[t] >= 0 && d[t + 1] == d[t] && tm[t + 1] != 0 ? 1 : 0;
  return out;
}

namespace {

// The checks and the run both entry points share: `list(V)` lists the loss positions.
template <typename List>
QualitySums run_kl_ntp(const Tensor& teacher_hidden, const Tensor& student_hidden, const Tensor& lm_head,
                       const Tensor& ids, const char* ids_name, int64_t chunk, double kl_scale, double ntp_scale,
                       Tensor* d_student_hidden, KlDirection kl, List list) {
  check_f32_2d(teacher_hidden, "teacher_hidden");
  check_f32_2d(student_hidden, "student_hidden");
  const Device device = teacher_hidden.device();
  check_device(student_hidden, device, "student_hidden");
  check_device(lm_head, device, "lm_head");
  if (device == Device::CPU)
    check_f32_2d(lm_head, "lm_head");
  else
    RETAIN_CHECK((lm_head.dtype() == DType::F32 || lm_head.dtype() == DType::BF16) && lm_head.ndim() == 2,
                 "kl_ntp_chunked: lm_head must be a 2-d F32 or BF16 tensor, got {} {}", dtype_name(lm_head.dtype()),
                 shape_str(lm_head.shape()));
  const int64_t T = teacher_hidden.dim(0), D = teacher_hidden.dim(1), V = lm_head.dim(0);
  RETAIN_CHECK(student_hidden.shape() == teacher_hidden.shape() && lm_head.dim(1) == D,
               "kl_ntp_chunked: teacher {} student {} lm_head {}", shape_str(teacher_hidden.shape()),
               shape_str(student_hidden.shape()), shape_str(lm_head.shape()));
  RETAIN_CHECK(ids.dtype() == DType::I32 && ids.shape() == Shape{T}, "kl_ntp_chunked: {} must be I32 [{}], got {} {}",
               ids_name, T, dtype_name(ids.dtype()), shape_str(ids.shape()));
  RETAIN_CHECK(chunk > 0, "kl_ntp_chunked: chunk {}", chunk);
  RETAIN_CHECK(V > 0, "kl_ntp_chunked: empty vocabulary");
  if (d_student_hidden) {
    check_f32_2d(*d_student_hidden, "d_student_hidden");
    check_device(*d_student_hidden, device, "d_student_hidden");
    RETAIN_CHECK(d_student_hidden->shape() == student_hidden.shape(), "kl_ntp_chunked: d_student_hidden {} for {}",
                 shape_str(d_student_hidden->shape()), shape_str(student_hidden.shape()));
  }
#ifndef RETAIN_CUDA_KERNELS
  if (device != Device::CPU) fail("kl_ntp_chunked: no CUDA implementation in this build");
#endif
  // Zeroed before the targets are checked, as it always was.
  if (d_student_hidden) {
    if (device == Device::CPU)
      std::memset(d_student_hidden->raw(), 0, d_student_hidden->nbytes());
    else
      cuda::memset_device(d_student_hidden->raw(), 0, d_student_hidden->nbytes());
  }

  const LossPositions lp = list(V);
  if (lp.pos.empty()) return {};
#ifdef RETAIN_CUDA_KERNELS
  if (device != Device::CPU)
    return cuda::kl_ntp_chunked(teacher_hidden, student_hidden, lm_head, lp, chunk, kl_scale, ntp_scale,
                                d_student_hidden, kl);
#endif
  return cpu::kl_ntp_chunked(teacher_hidden, student_hidden, lm_head, lp, chunk, kl_scale, ntp_scale,
                             d_student_hidden, kl);
}

}  // namespace

QualitySums kl_ntp_chunked(const Tensor& teacher_hidden, const Tensor& student_hidden, const Tensor& lm_head,
                           const Tensor& ids, const Tensor& mask, int64_t chunk, double kl_scale, double ntp_scale,
                           Tensor* d_student_hidden, KlDirection kl) {
  RETAIN_CHECK(ids.device() == Device::CPU && mask.device() == Device::CPU,
               "kl_ntp_chunked: ids and mask must be CPU tensors (the host lists the loss positions), got {} and {}",
               device_name(ids.device()), device_name(mask.device()));
  const int64_t T = teacher_hidden.ndim() == 2 ? teacher_hidden.dim(0) : -1;
  RETAIN_CHECK(mask.dtype() == DType::U8 && mask.shape() == Shape{T}, "kl_ntp_chunked: mask must be U8 [{}], got {} {}",
               T, dtype_name(mask.dtype()), shape_str(mask.shape()));
  return run_kl_ntp(teacher_hidden, student_hidden, lm_head, ids, "ids", chunk, kl_scale, ntp_scale, d_student_hidden,
                    kl, [&](int64_t V) { return list_positions(ids, mask, V); });
}

QualitySums kl_ntp_chunked_targets(const Tensor& teacher_hidden, const Tensor& student_hidden, const Tensor& lm_head,
                                   const Tensor& targets, int64_t chunk, double kl_scale, double ntp_scale,
                                   Tensor* d_student_hidden, KlDirection kl) {
  RETAIN_CHECK(targets.device() == Device::CPU,
               "kl_ntp_chunked: targets must be a CPU tensor (the host lists the loss positions), got {}",
               device_name(targets.device()));
  return run_kl_ntp(teacher_hidden, student_hidden, lm_head, targets, "targets", chunk, kl_scale, ntp_scale,
                    d_student_hidden, kl, [&](int64_t V) {
                      LossPositions lp;
                      const int32_t* id = targets.data<int32_t>();
                      for (int64_t t = 0; t < targets.numel(); ++t) {
                        if (id[t] < 0) continue;
                        if (id[t] >= V)
                          fail("kl_ntp_chunked: target id {} of position {} is outside the vocabulary [0, {})", id[t],
                               t, V);
                        lp.pos.push_back(t);
                        lp.target.push_back(id[t]);
                      }
                      return lp;
                    });
}

}  // namespace retain::ops
