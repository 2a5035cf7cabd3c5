// Chunked, fused KL + NTP (DESIGN §4 "Quality"). Per chunk of gathered loss positions:
//   1. teacher and student logits, chunk × V each (OpenBLAS through ops::linear);
//   2. per row and vocabulary block, the block maxima (exact, so their order is irrelevant);
//   3. per row and block, Σ e_t, Σ e_s and Σ e_t·(t − s) in float64 with e = exp(logit − max),
//      the e's kept (float) in the logit buffers for step 4; blocks combined per row in block
//      order, rows summed in position order, so no result depends on the thread count;
//      KL = Σ e_t(t − s)/Z_t − lse_t + lse_s (= Σ p(log p − log q), since Σ p = 1),
//      NTP = lse_s − s_y;
//   4. the logit gradient kl_scale·(q − p) + ntp_scale·(q − onehot) written over the student
//      logits, and one more GEMM, gradient · lm_head, gives the hidden-state gradient.
#include "trainer/loss.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/ops.h"

namespace retain::trainer {

namespace {

// The vocabulary is reduced in blocks of this many logits: the unit of parallel work (so a
// chunk of one row still uses every thread) and of the fixed-order float64 reduction.
constexpr int64_t kVocabBlock = 4096;

void check_f32_2d(const Tensor& t, const char* what) {
  RETAIN_CHECK(t.dtype() == DType::F32 && t.ndim() == 2 && t.device() == Device::CPU,
               "kl_ntp_chunked: {} must be a 2-d F32 CPU tensor, got {} {}", what, dtype_name(t.dtype()),
               shape_str(t.shape()));
}

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
  check_f32_2d(lm_head, "lm_head");
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
    RETAIN_CHECK(d_student_hidden->shape() == student_hidden.shape(), "kl_ntp_chunked: d_student_hidden {} for {}",
                 shape_str(d_student_hidden->shape()), shape_str(student_hidden.shape()));
    std::memset(d_student_hidden->raw(), 0, d_student_hidden->nbytes());
  }

  // The loss positions and their targets.
  const uint8_t* m = mask.data<uint8_t>();
  const int32_t* id = ids.data<int32_t>();
  std::vector<int64_t> pos;
  for (int64_t t = 0; t < T; ++t) {
    if (!m[t]) continue;
    RETAIN_CHECK(t + 1 < T, "kl_ntp_chunked: position {} is the last of {} and has no target", t, T);
    if (id[t + 1] < 0 || id[t + 1] >= V)
      fail("kl_ntp_chunked: target id {} at position {} is outside the vocabulary [0, {})", id[t + 1], t + 1, V);
    pos.push_back(t);
  }
  QualitySums sums;
  sums.positions = static_cast<int64_t>(pos.size());
  if (pos.empty()) return sums;

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
      float mt = -std::numeric_limits<float>::infinity(), ms = mt;
      for (int64_t v = b0; v < b1; ++v) {
        mt = std::max(mt, xt[v]);
        ms = std::max(ms, xs[v]);
      }
      bmax_t[static_cast<size_t>(w)] = mt;
      bmax_s[static_cast<size_t>(w)] = ms;
    }
    // Row maxima, and the student logit of each target before step 3 overwrites it.
    std::vector<double> target_logit(static_cast<size_t>(c));
    for (int64_t r = 0; r < c; ++r) {
      const float* bt = bmax_t.data() + r * NB;
      const float* bs = bmax_s.data() + r * NB;
      max_t[static_cast<size_t>(r)] = *std::max_element(bt, bt + NB);
      max_s[static_cast<size_t>(r)] = *std::max_element(bs, bs + NB);
      target_logit[static_cast<size_t>(r)] = L_s[r * V + id[cpos[r] + 1]];
    }
    // Block sums; the exponentials replace the logits.
#pragma omp parallel for schedule(static)
    for (int64_t w = 0; w < work; ++w) {
      const int64_t r = w / NB, b0 = (w % NB) * kVocabBlock, b1 = std::min(V, b0 + kVocabBlock);
      float* xt = L_t + r * V;
      float* xs = L_s + r * V;
      const double mt = max_t[static_cast<size_t>(r)], ms = max_s[static_cast<size_t>(r)];
      double zt = 0, zs = 0, a = 0;
      for (int64_t v = b0; v < b1; ++v) {
        const double et = std::exp(double(xt[v]) - mt), es = std::exp(double(xs[v]) - ms);
        zt += et;
        zs += es;
        a += et * (double(xt[v]) - double(xs[v]));
        xt[v] = static_cast<float>(et);
        xs[v] = static_cast<float>(es);
      }
      bz_t[static_cast<size_t>(w)] = zt;
      bz_s[static_cast<size_t>(w)] = zs;
      ba[static_cast<size_t>(w)] = a;
    }
    for (int64_t r = 0; r < c; ++r) {
      double zt = 0, zs = 0, a = 0;
      for (int64_t b = 0; b < NB; ++b) {
        zt += bz_t[static_cast<size_t>(r * NB + b)];
        zs += bz_s[static_cast<size_t>(r * NB + b)];
        a += ba[static_cast<size_t>(r * NB + b)];
      }
      z_t[static_cast<size_t>(r)] = zt;
      z_s[static_cast<size_t>(r)] = zs;
      const double lse_t = max_t[static_cast<size_t>(r)] + std::log(zt);
      const double lse_s = max_s[static_cast<size_t>(r)] + std::log(zs);
      sums.kl += a / zt - lse_t + lse_s;
      sums.ntp += lse_s - target_logit[static_cast<size_t>(r)];
    }
    if (!d_student_hidden) continue;

    // Logit gradient over the student logits, then back through lm_head.
#pragma omp parallel for schedule(static)
    for (int64_t w = 0; w < work; ++w) {
      const int64_t r = w / NB, b0 = (w % NB) * kVocabBlock, b1 = std::min(V, b0 + kVocabBlock);
      const float* et = L_t + r * V;
      float* g = L_s + r * V;
      const double inv_zt = 1.0 / z_t[static_cast<size_t>(r)], inv_zs = 1.0 / z_s[static_cast<size_t>(r)];
      const double qs = kl_scale + ntp_scale;
      const int64_t y = id[cpos[r] + 1];
      const bool has_y = y >= b0 && y < b1;
      const double es_y = has_y ? g[y] : 0;
      for (int64_t v = b0; v < b1; ++v) g[v] = static_cast<float>(qs * (g[v] * inv_zs) - kl_scale * (et[v] * inv_zt));
      if (has_y) g[y] = static_cast<float>(qs * (es_y * inv_zs) - kl_scale * (et[y] * inv_zt) - ntp_scale);
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

}  // namespace retain::trainer
