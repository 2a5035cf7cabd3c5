// Chunked, fused KL + NTP (DESIGN §4 "Quality"). The host lists the loss positions and checks
// their targets; then, per chunk of gathered loss positions:
//   1. teacher and student logits, chunk × V each (ops::linear: OpenBLAS or cuBLASLt);
//   2. per row, the maxima (exact, so their order is irrelevant);
//   3. per row, Σ e_t, Σ e_s and Σ e_t·(t − s) in float64 with e = exp(logit − max), in a fixed
//      order, so no result depends on the thread count;
//      KL = Σ e_t(t − s)/Z_t − lse_t + lse_s (= Σ p(log p − log q), since Σ p = 1),
//      NTP = lse_s − s_y;
//   4. the logit gradient kl_scale·(q − p) + ntp_scale·(q − onehot) written over the student
//      logits, and one more GEMM, gradient · lm_head, gives the hidden-state gradient.
// The per-row formulas are kernels/cuda/loss_rows.h's, shared by both devices. The CPU reduces
// each row in blocks of kVocabBlock logits (summed sequentially, blocks in order; the e's kept
// in the logit buffers between steps 3 and 4); CUDA (kernels/cuda/loss.cu) gives each row one
// block of threads, reduced as loss_rows.h describes. The per-row KL and NTP are summed in
// position order on the host: per chunk on the CPU, after one device→host copy at the end of the
// call on CUDA.
#include "trainer/loss.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cuda/loss_rows.h"
#include "kernels/ops.h"
#ifdef RETAIN_CUDA_KERNELS
#include "kernels/cuda/loss_cuda.h"
#include "kernels/cuda/memory.h"
#endif

namespace retain::trainer {

namespace {

namespace rows = cuda::loss_rows;

// The vocabulary is reduced in blocks of this many logits: the unit of parallel work (so a
// chunk of one row still uses every thread) and of the fixed-order float64 reduction.
constexpr int64_t kVocabBlock = 4096;

void check_f32_2d(const Tensor& t, const char* what) {
  RETAIN_CHECK(t.dtype() == DType::F32 && t.ndim() == 2, "kl_ntp_chunked: {} must be a 2-d F32 tensor, got {} {}", what,
               dtype_name(t.dtype()), shape_str(t.shape()));
}

void check_device(const Tensor& t, Device device, const char* what) {
  if (t.device() != device)
    fail("kl_ntp_chunked: all tensors but ids and mask must be on one device (teacher_hidden is on {}, {} on {})",
         device_name(device), what, device_name(t.device()));
}

// The loss positions in order, and the target id of each.
struct LossPositions {
  std::vector<int64_t> pos;
  std::vector<int32_t> target;
};

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

QualitySums cpu_loss(const Tensor& teacher_hidden, const Tensor& student_hidden, const Tensor& lm_head,
                     const LossPositions& lp, int64_t chunk, double kl_scale, double ntp_scale,
                     Tensor* d_student_hidden);
#ifdef RETAIN_CUDA_KERNELS
QualitySums cuda_loss(const Tensor& teacher_hidden, const Tensor& student_hidden, const Tensor& lm_head,
                      const LossPositions& lp, int64_t chunk, double kl_scale, double ntp_scale,
                      Tensor* d_student_hidden);
#endif

}  // namespace

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

QualitySums kl_ntp_chunked(const Tensor& teacher_hidden, const Tensor& student_hidden, const Tensor& lm_head,
                           const Tensor& ids, const Tensor& mask, int64_t chunk, double kl_scale, double ntp_scale,
                           Tensor* d_student_hidden) {
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
  RETAIN_CHECK(ids.device() == Device::CPU && mask.device() == Device::CPU,
               "kl_ntp_chunked: ids and mask must be CPU tensors (the host lists the loss positions), got {} and {}",
               device_name(ids.device()), device_name(mask.device()));
  const int64_t T = teacher_hidden.dim(0), D = teacher_hidden.dim(1), V = lm_head.dim(0);
  RETAIN_CHECK(student_hidden.shape() == teacher_hidden.shape() && lm_head.dim(1) == D,
               "kl_ntp_chunked: teacher {} student {} lm_head {}", shape_str(teacher_hidden.shape()),
               shape_str(student_hidden.shape()), shape_str(lm_head.shape()));
  RETAIN_CHECK(ids.dtype() == DType::I32 && ids.shape() == Shape{T}, "kl_ntp_chunked: ids must be I32 [{}], got {} {}",
               T, dtype_name(ids.dtype()), shape_str(ids.shape()));
  RETAIN_CHECK(mask.dtype() == DType::U8 && mask.shape() == Shape{T}, "kl_ntp_chunked: mask must be U8 [{}], got {} {}",
               T, dtype_name(mask.dtype()), shape_str(mask.shape()));
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
#ifdef RETAIN_CUDA_KERNELS
    else
      cuda::memset_device(d_student_hidden->raw(), 0, d_student_hidden->nbytes());
#endif
  }

  const LossPositions lp = list_positions(ids, mask, V);
  if (lp.pos.empty()) return {};
#ifdef RETAIN_CUDA_KERNELS
  if (device != Device::CPU)
    return cuda_loss(teacher_hidden, student_hidden, lm_head, lp, chunk, kl_scale, ntp_scale, d_student_hidden);
#endif
  return cpu_loss(teacher_hidden, student_hidden, lm_head, lp, chunk, kl_scale, ntp_scale, d_student_hidden);
}

namespace {

QualitySums cpu_loss(const Tensor& teacher_hidden, const Tensor& student_hidden, const Tensor& lm_head,
                     const LossPositions& lp, int64_t chunk, double kl_scale, double ntp_scale,
                     Tensor* d_student_hidden) {
  const int64_t D = teacher_hidden.dim(1), V = lm_head.dim(0);
  const std::vector<int64_t>& pos = lp.pos;
  QualitySums sums;
  sums.positions = static_cast<int64_t>(pos.size());
  const int64_t P = sums.positions, C = std::min(chunk, P), NB = (V + kVocabBlock - 1) / kVocabBlock;
  Tensor th = Tensor::empty({C, D}, DType::F32), sh = Tensor::empty({C, D}, DType::F32);
  Tensor lt = Tensor::empty({C, V}, DType::F32), ls = Tensor::empty({C, V}, DType::F32);
  Tensor dh = d_student_hidden ? Tensor::empty({C, D}, DType::F32) : Tensor();
  std::vector<float> bmax_t(static_cast<size_t>(C * NB)), bmax_s(static_cast<size_t>(C * NB));
  std::vector<double> bz_t(static_cast<size_t>(C * NB)), bz_s(static_cast<size_t>(C * NB)),
      ba(static_cast<size_t>(C * NB));
  std::vector<double> max_t(static_cast<size_t>(C)), max_s(static_cast<size_t>(C)), z_t(static_cast<size_t>(C)),
      z_s(static_cast<size_t>(C));
  const float* teacher = teacher_hidden.data<float>();
  const float* student = student_hidden.data<float>();
  const size_t row_bytes = sizeof(float) * static_cast<size_t>(D);

  for (int64_t s0 = 0; s0 < P; s0 += C) {
    const int64_t c = std::min(C, P - s0);
    const int64_t* cpos = pos.data() + s0;
    const int32_t* ctarget = lp.target.data() + s0;
    for (int64_t r = 0; r < c; ++r) {
      std::memcpy(th.data<float>() + r * D, teacher + cpos[r] * D, row_bytes);
      std::memcpy(sh.data<float>() + r * D, student + cpos[r] * D, row_bytes);
    }
    Tensor ltc = lt.rows(0, c), lsc = ls.rows(0, c);
    ops::linear(th.rows(0, c), lm_head, ltc);
    ops::linear(sh.rows(0, c), lm_head, lsc);
    float* L_t = lt.data<float>();
    float* L_s = ls.data<float>();

    // Block maxima.
    const int64_t work = c * NB;
#pragma omp parallel for schedule(static)
    for (int64_t w = 0; w < work; ++w) {
      const int64_t r = w / NB, b0 = (w % NB) * kVocabBlock, b1 = std::min(V, b0 + kVocabBlock);
      const float* xt = L_t + r * V;
      const float* xs = L_s + r * V;
      rows::RowMax m{-std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
      for (int64_t v = b0; v < b1; ++v) {
        m.t = rows::max_of(m.t, xt[v]);
        m.s = rows::max_of(m.s, xs[v]);
      }
      bmax_t[static_cast<size_t>(w)] = m.t;
      bmax_s[static_cast<size_t>(w)] = m.s;
    }
    // Row maxima, and the student logit of each target before step 3 overwrites it.
    std::vector<double> target_logit(static_cast<size_t>(c));
    for (int64_t r = 0; r < c; ++r) {
      const float* bt = bmax_t.data() + r * NB;
      const float* bs = bmax_s.data() + r * NB;
      max_t[static_cast<size_t>(r)] = *std::max_element(bt, bt + NB);
      max_s[static_cast<size_t>(r)] = *std::max_element(bs, bs + NB);
      target_logit[static_cast<size_t>(r)] = L_s[r * V + ctarget[r]];
    }
    // Block sums; the exponentials replace the logits.
#pragma omp parallel for schedule(static)
    for (int64_t w = 0; w < work; ++w) {
      const int64_t r = w / NB, b0 = (w % NB) * kVocabBlock, b1 = std::min(V, b0 + kVocabBlock);
      float* xt = L_t + r * V;
      float* xs = L_s + r * V;
      const double mt = max_t[static_cast<size_t>(r)], ms = max_s[static_cast<size_t>(r)];
      rows::RowSums b{0.0, 0.0, 0.0};
      for (int64_t v = b0; v < b1; ++v) {
        const double et = rows::shifted_exp(xt[v], mt), es = rows::shifted_exp(xs[v], ms);
        rows::accumulate(b, et, es, xt[v], xs[v]);
        xt[v] = static_cast<float>(et);
        xs[v] = static_cast<float>(es);
      }
      bz_t[static_cast<size_t>(w)] = b.zt;
      bz_s[static_cast<size_t>(w)] = b.zs;
      ba[static_cast<size_t>(w)] = b.a;
    }
    for (int64_t r = 0; r < c; ++r) {
      rows::RowSums total{0.0, 0.0, 0.0};
      for (int64_t b = 0; b < NB; ++b) {
        total.zt += bz_t[static_cast<size_t>(r * NB + b)];
        total.zs += bz_s[static_cast<size_t>(r * NB + b)];
        total.a += ba[static_cast<size_t>(r * NB + b)];
      }
      z_t[static_cast<size_t>(r)] = total.zt;
      z_s[static_cast<size_t>(r)] = total.zs;
      const rows::RowLoss loss = rows::row_loss(total, max_t[static_cast<size_t>(r)], max_s[static_cast<size_t>(r)],
                                                target_logit[static_cast<size_t>(r)]);
      sums.kl += loss.kl;
      sums.ntp += loss.ntp;
    }
    if (!d_student_hidden) continue;

    // Logit gradient over the student logits, then back through lm_head.
    const rows::GradScales scales = rows::grad_scales(kl_scale, ntp_scale);
#pragma omp parallel for schedule(static)
    for (int64_t w = 0; w < work; ++w) {
      const int64_t r = w / NB, b0 = (w % NB) * kVocabBlock, b1 = std::min(V, b0 + kVocabBlock);
      const float* et = L_t + r * V;
      float* g = L_s + r * V;
      const double inv_zt = 1.0 / z_t[static_cast<size_t>(r)], inv_zs = 1.0 / z_s[static_cast<size_t>(r)];
      const int64_t y = ctarget[r];
      const bool has_y = y >= b0 && y < b1;
      const float es_y = has_y ? g[y] : 0.0f;
      for (int64_t v = b0; v < b1; ++v) g[v] = rows::logit_gradient(et[v], g[v], inv_zt, inv_zs, scales);
      if (has_y) g[y] = rows::target_gradient(et[y], es_y, inv_zt, inv_zs, scales);
    }
    // dh[c, D] = g[c, V] · lm_head[V, D]
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(c), static_cast<int>(D),
                static_cast<int>(V), 1.0f, L_s, static_cast<int>(V), lm_head.data<float>(), static_cast<int>(D), 0.0f,
                dh.data<float>(), static_cast<int>(D));
    float* out = d_student_hidden->data<float>();
    for (int64_t r = 0; r < c; ++r) std::memcpy(out + cpos[r] * D, dh.data<float>() + r * D, row_bytes);
  }
  return sums;
}

#ifdef RETAIN_CUDA_KERNELS
// The same steps on the device: no [T, V] buffer and no host synchronisation until the end.
QualitySums cuda_loss(const Tensor& teacher_hidden, const Tensor& student_hidden, const Tensor& lm_head,
                      const LossPositions& lp, int64_t chunk, double kl_scale, double ntp_scale,
                      Tensor* d_student_hidden) {
  const int64_t D = teacher_hidden.dim(1), V = lm_head.dim(0), P = static_cast<int64_t>(lp.pos.size());
  RETAIN_CHECK(teacher_hidden.dim(0) <= std::numeric_limits<int32_t>::max(),
               "kl_ntp_chunked: {} tokens do not fit the device's int32 positions", teacher_hidden.dim(0));
  // One upload per call: the positions, then their targets.
  std::vector<int32_t> host(static_cast<size_t>(2 * P));
  for (int64_t i = 0; i < P; ++i) {
    host[static_cast<size_t>(i)] = static_cast<int32_t>(lp.pos[static_cast<size_t>(i)]);
    host[static_cast<size_t>(P + i)] = lp.target[static_cast<size_t>(i)];
  }
  const Tensor list = Tensor::from_vector(host, {2, P}).to(Device::CUDA);

  const int64_t C = std::min(chunk, P);
  Tensor th = Tensor::empty({C, D}, DType::F32, Device::CUDA), sh = Tensor::empty({C, D}, DType::F32, Device::CUDA);
  Tensor lt = Tensor::empty({C, V}, DType::F32, Device::CUDA), ls = Tensor::empty({C, V}, DType::F32, Device::CUDA);
  Tensor dh = d_student_hidden ? Tensor::empty({C, D}, DType::F32, Device::CUDA) : Tensor();
  Tensor row_losses = Tensor::empty({2, P}, DType::F64, Device::CUDA);
  for (int64_t s0 = 0; s0 < P; s0 += C) {
    const int64_t c = std::min(C, P - s0);
    Tensor thc = th.rows(0, c), shc = sh.rows(0, c), ltc = lt.rows(0, c), lsc = ls.rows(0, c);
    cuda::gather_loss_rows(teacher_hidden, list, s0, thc);
    cuda::gather_loss_rows(student_hidden, list, s0, shc);
    ops::linear(thc, lm_head, ltc);
    ops::linear(shc, lm_head, lsc);
    cuda::kl_ntp_rows(ltc, lsc, list, s0, kl_scale, ntp_scale, d_student_hidden != nullptr, row_losses);
    if (!d_student_hidden) continue;
    Tensor dhc = dh.rows(0, c);
    ops::linear_backward_input(lsc, lm_head, dhc);
    cuda::scatter_loss_rows(dhc, list, s0, *d_student_hidden);
  }

  // The one device→host copy; the rows summed in position order, as on the CPU.
  const Tensor losses = row_losses.to(Device::CPU);
  const double* kl = losses.data<double>();
  QualitySums sums;
  sums.positions = P;
  for (int64_t i = 0; i < P; ++i) {
    sums.kl += kl[i];
    sums.ntp += kl[P + i];
  }
  return sums;
}
#endif

}  // namespace

}  // namespace retain::trainer
