// The fused chunked KL + NTP loss on the CPU (kernels/loss.cpp describes the steps): each row's
// vocabulary reduced in blocks of kVocabBlock logits (summed sequentially, blocks in order; the
// exponentials kept in the logit buffers between steps 3 and 4), the rows summed in position order.
#include "kernels/cpu/loss_cpu.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cuda/loss_rows.h"
#include "kernels/ops.h"

namespace retain::cpu {

namespace {

namespace rows = cuda::loss_rows;

// The vocabulary is reduced in blocks of this many logits: the unit of parallel work (so a
// chunk of one row still uses every thread) and of the fixed-order float64 reduction.
constexpr int64_t kVocabBlock = 4096;

}  // namespace

ops::QualitySums kl_ntp_chunked(const Tensor& teacher_hidden, const Tensor& student_hidden, const Tensor& lm_head,
                                const ops::LossPositions& lp, int64_t chunk, double kl_scale, double ntp_scale,
                                Tensor* d_student_hidden, ops::KlDirection kl) {
  const int64_t D = teacher_hidden.dim(1), V = lm_head.dim(0);
  const std::vector<int64_t>& pos = lp.pos;
  ops::QualitySums sums;
  sums.positions = static_cast<int64_t>(pos.size());
  const int64_t P = sums.positions, C = std::min(chunk, P), NB = (V + kVocabBlock - 1) / kVocabBlock;
  Tensor th = Tensor::empty({C, D}, DType::F32), sh = Tensor::empty({C, D}, DType::F32);
  Tensor lt = Tensor::empty({C, V}, DType::F32), ls = Tensor::empty({C, V}, DType::F32);
  Tensor dh = d_student_hidden ? Tensor::empty({C, D}, DType::F32) : Tensor();
  std::vector<float> bmax_t(static_cast<size_t>(C * NB)), bmax_s(static_cast<size_t>(C * NB));
  std::vector<double> bz_t(static_cast<size_t>(C * NB)), bz_s(static_cast<size_t>(C * NB)),
      ba(static_cast<size_t>(C * NB)), bb(static_cast<size_t>(C * NB));
  std::vector<double> max_t(static_cast<size_t>(C)), max_s(static_cast<size_t>(C)), z_t(static_cast<size_t>(C)),
      z_s(static_cast<size_t>(C)), log_ratio(static_cast<size_t>(C));
  // The reverse KL's gradient reads the logits themselves (log q − log p from exponentials that
  // underflow would be −inf): they stay, and the student's exponentials go to a buffer of their own.
  const bool reverse = kl == ops::KlDirection::reverse;
  Tensor es_buf = reverse ? Tensor::empty({C, V}, DType::F32) : Tensor();
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
    // Block sums; the exponentials replace the logits (forward KL) or go to es_buf (reverse).
#pragma omp parallel for schedule(static)
    for (int64_t w = 0; w < work; ++w) {
      const int64_t r = w / NB, b0 = (w % NB) * kVocabBlock, b1 = std::min(V, b0 + kVocabBlock);
      float* xt = L_t + r * V;
      float* xs = L_s + r * V;
      float* es_out = reverse ? es_buf.data<float>() + r * V : nullptr;
      const double mt = max_t[static_cast<size_t>(r)], ms = max_s[static_cast<size_t>(r)];
      rows::RowSums b{0.0, 0.0, 0.0, 0.0};
      for (int64_t v = b0; v < b1; ++v) {
        const double et = rows::shifted_exp(xt[v], mt), es = rows::shifted_exp(xs[v], ms);
        rows::accumulate(b, et, es, xt[v], xs[v]);
        if (reverse) {
          es_out[v] = static_cast<float>(es);
        } else {
          xt[v] = static_cast<float>(et);
          xs[v] = static_cast<float>(es);
        }
      }
      bz_t[static_cast<size_t>(w)] = b.zt;
      bz_s[static_cast<size_t>(w)] = b.zs;
      ba[static_cast<size_t>(w)] = b.a;
      bb[static_cast<size_t>(w)] = b.b;
    }
    for (int64_t r = 0; r < c; ++r) {
      rows::RowSums total{0.0, 0.0, 0.0, 0.0};
      for (int64_t b = 0; b < NB; ++b) {
        total.zt += bz_t[static_cast<size_t>(r * NB + b)];
        total.zs += bz_s[static_cast<size_t>(r * NB + b)];
        total.a += ba[static_cast<size_t>(r * NB + b)];
        total.b += bb[static_cast<size_t>(r * NB + b)];
      }
      z_t[static_cast<size_t>(r)] = total.zt;
      z_s[static_cast<size_t>(r)] = total.zs;
      const rows::RowLoss loss = rows::row_loss(total, max_t[static_cast<size_t>(r)], max_s[static_cast<size_t>(r)],
                                                target_logit[static_cast<size_t>(r)], reverse);
      log_ratio[static_cast<size_t>(r)] = loss.log_ratio;
      sums.kl += loss.kl;
      sums.ntp += loss.ntp;
    }
    if (!d_student_hidden) continue;

    // Logit gradient over the student logits, then back through lm_head.
    const rows::GradScales scales = rows::grad_scales(kl_scale, ntp_scale, reverse);
#pragma omp parallel for schedule(static)
    for (int64_t w = 0; w < work; ++w) {
      const int64_t r = w / NB, b0 = (w % NB) * kVocabBlock, b1 = std::min(V, b0 + kVocabBlock);
      if (reverse) {
        const float* t = L_t + r * V;
        const float* es = es_buf.data<float>() + r * V;
        float* g = L_s + r * V;  // the student's logits, each read once and replaced by its gradient
        const double inv_zs = 1.0 / z_s[static_cast<size_t>(r)], c_r = log_ratio[static_cast<size_t>(r)];
        const int64_t y = ctarget[r];
        for (int64_t v = b0; v < b1; ++v) g[v] = rows::reverse_gradient(t[v], g[v], es[v], inv_zs, c_r, v == y, scales);
        continue;
      }
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

}  // namespace retain::cpu
