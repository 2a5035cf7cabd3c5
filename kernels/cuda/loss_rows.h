// The per-row math of the fused KL + NTP loss (DESIGN §4 "Quality"; kernels/loss.h), written as
// __host__ __device__ functions so that one copy of every formula serves three callers: the
// CUDA row kernel (kernels/cuda/loss.cu), the CPU loss (kernels/cpu/loss.cpp, whose results these
// expressions reproduce bit for bit), and tests/cuda/test_loss_rows.cpp, which runs the kernel's
// reduction thread by thread on the CPU in every build. Plain C++ when not compiled by nvcc.
// Not yet run on a GPU (none has been lent); tests/cuda/test_loss_cuda.cpp is the GPU check.
//
// One row = one loss position: teacher logits t[V], student logits s[V] (float32), target y.
//   m_t = max t, m_s = max s (exact in float32, so the order of the max is irrelevant);
//   e_t = exp(t − m_t), e_s = exp(s − m_s) in float64;
//   Z_t = Σ e_t, Z_s = Σ e_s, A = Σ e_t·(t − s), B = Σ e_s·(s − t) (float64);
//   KL = A/Z_t − lse_t + lse_s (= Σ p(log p − log q), since Σ p = 1), lse = m + log Z;
//   reverse KL = B/Z_s − lse_s + lse_t (= Σ q(log q − log p));
//   NTP = lse_s − s_y;
//   gradient g_v = kl·(q_v − p_v) + ntp·(q_v − [v = y]) with p = float(e_t)/Z_t,
//   q = float(e_s)/Z_s: the exponentials go through float32 because the CPU keeps them in its
//   float logit buffers, and the GPU rounds them the same way so that both use one formula;
//   reverse: g_v = kl·q_v·((s_v − t_v) − c) + ntp·(q_v − [v = y]), c = lse_s − lse_t + KL_rev
//   (log q_v − log p_v − KL_rev, from the logits, not from exponentials that may underflow).
//
// The GPU reduction (one block of kLossThreads per row): thread i takes v = i, i + kLossThreads,
// ... in that order (row_max_partial, row_sums_partial), then the block folds the partials as a
// fixed pairwise tree in shared memory (slot i takes slot i + s for s = kLossThreads/2, ..., 1;
// fold_max, fold_sums). No atomics: bitwise repeatable. A sum folded so has at most
// ⌈V/kLossThreads⌉ + log2(kLossThreads) roundings on any path (602 at V = 151936) against the
// CPU's min(V, 4096) + ⌈V/4096⌉ (its blocks of 4096 are summed sequentially).
//
// Every float64 add, subtract and multiply below goes through add/sub/mul: nvcc would otherwise
// fuse a·b + c into one FMA (one rounding instead of two), and the GPU would no longer compute
// what the CPU (x86-64 without FMA; the build sets no -march) and this header's emulation do.
#pragma once
#include <cmath>
#include <cstdint>

#include "kernels/cuda/host_device.h"

namespace retain::cuda::loss_rows {

inline constexpr int kLossThreads = 256;  // threads per row block (a power of two)
inline constexpr int kLossTreeLevels = 8;  // log2(kLossThreads)
static_assert(1 << kLossTreeLevels == kLossThreads);

// ---- float64 arithmetic with one rounding per operation ------------------------------------

RETAIN_HD double add(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
RETAIN_HD double sub(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
RETAIN_HD double mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

// std::max's comparison (a NaN in the running maximum stays; a NaN logit is skipped), which
// the CPU uses; fmaxf would treat NaN differently.
RETAIN_HD float max_of(float m, float x) { return m < x ? x : m; }

// e = exp(x − m) in float64. The CUDA exp is within 1 ulp of the host's (glibc), so the GPU's
// exponentials may differ from the CPU's in the last bit: within the bounds of the tests, not
// bit for bit.
RETAIN_HD double shifted_exp(float x, double m) { return exp(sub(static_cast<double>(x), m)); }

// ---- row maxima ------------------------------------------------------------------------------

struct RowMax {
  float t, s;
};

RETAIN_HD RowMax row_max_partial(const float* t, const float* s, int64_t V, int tid) {
  RowMax m{-INFINITY, -INFINITY};
  for (int64_t v = tid; v < V; v += kLossThreads) {
    m.t = max_of(m.t, t[v]);
    m.s = max_of(m.s, s[v]);
  }
  return m;
}

// One level of the block's tree: slot i (< s) takes slot i + s.
RETAIN_HD void fold_max(RowMax* slots, int i, int s) {
  slots[i].t = max_of(slots[i].t, slots[i + s].t);
  slots[i].s = max_of(slots[i].s, slots[i + s].s);
}

// ---- row sums --------------------------------------------------------------------------------

struct RowSums {
  double zt, zs, a, b;  // Σ e_t, Σ e_s, Σ e_t·(t − s), Σ e_s·(s − t)
};

// One logit's terms, added in the CPU's order (which the CPU loop calls too).
RETAIN_HD void accumulate(RowSums& r, double et, double es, float t, float s) {
  const double d = sub(static_cast<double>(t), static_cast<double>(s));
  r.zt = add(r.zt, et);
  r.zs = add(r.zs, es);
  r.a = add(r.a, mul(et, d));
  r.b = sub(r.b, mul(es, d));
}

RETAIN_HD RowSums row_sums_partial(const float* t, const float* s, int64_t V, double mt, double ms, int tid) {
  RowSums r{0.0, 0.0, 0.0, 0.0};
  for (int64_t v = tid; v < V; v += kLossThreads)
    accumulate(r, shifted_exp(t[v], mt), shifted_exp(s[v], ms), t[v], s[v]);
  return r;
}

RETAIN_HD void fold_sums(RowSums* slots, int i, int s) {
  slots[i].zt = add(slots[i].zt, slots[i + s].zt);
  slots[i].zs = add(slots[i].zs, slots[i + s].zs);
  slots[i].a = add(slots[i].a, slots[i + s].a);
  slots[i].b = add(slots[i].b, slots[i + s].b);
}

// ---- the row's losses --------------------------------------------------------------------------

struct RowLoss {
  double kl, ntp;
  double log_ratio;  // lse_s − lse_t + KL: with the logits, log q_v − log p_v − KL = (s_v − t_v) − this
};

// target_logit: the student's logit of the target, s_y (read before any gradient overwrites it).
// reverse: the KL is KL(q‖p) (kernels/loss.h's KlDirection::reverse).
RETAIN_HD RowLoss row_loss(const RowSums& r, double mt, double ms, double target_logit, bool reverse = false) {
  const double lse_t = add(mt, log(r.zt)), lse_s = add(ms, log(r.zs));
  const double kl = reverse ? add(sub(r.b / r.zs, lse_s), lse_t) : add(sub(r.a / r.zt, lse_t), lse_s);
  return {kl, sub(lse_s, target_logit), add(sub(lse_s, lse_t), kl)};
}

// ---- the logit gradient ----------------------------------------------------------------------

struct GradScales {
  double kl, ntp, q;  // kl_scale, ntp_scale, and kl_scale + ntp_scale (q's coefficient)
  bool reverse;       // the KL is KL(q‖p)
};
RETAIN_HD GradScales grad_scales(double kl_scale, double ntp_scale, bool reverse = false) {
  return {kl_scale, ntp_scale, add(kl_scale, ntp_scale), reverse};
}

// g = q·(e_s/Z_s) − kl·(e_t/Z_t) for v ≠ y; e_t, e_s are the float32-rounded exponentials.
RETAIN_HD float logit_gradient(float et, float es, double inv_zt, double inv_zs, const GradScales& c) {
  return static_cast<float>(sub(mul(c.q, mul(es, inv_zs)), mul(c.kl, mul(et, inv_zt))));
}
// The same at v = y, less ntp_scale (the one-hot).
RETAIN_HD float target_gradient(float et, float es, double inv_zt, double inv_zs, const GradScales& c) {
  return static_cast<float>(sub(sub(mul(c.q, mul(es, inv_zs)), mul(c.kl, mul(et, inv_zt))), c.ntp));
}

// The reverse KL's gradient at logit v from the raw logits t, s and the float32-rounded e_s:
// q·(kl·((s − t) − log_ratio) + ntp), less ntp at v = y.
RETAIN_HD float reverse_gradient(float t, float s, float es, double inv_zs, double log_ratio, bool target,
                                 const GradScales& c) {
  const double q = mul(es, inv_zs);
  const double d = sub(sub(static_cast<double>(s), static_cast<double>(t)), log_ratio);
  const double g = mul(q, add(mul(c.kl, d), c.ntp));
  return static_cast<float>(target ? sub(g, c.ntp) : g);
}

// The GPU's third pass at logit v: the exponentials again (not stored between passes: that
// would cost two more [c, V] writes), rounded to float32 as the CPU stores them, then the
// gradient.
// log_ratio: row_loss's, read only by the reverse KL.
RETAIN_HD float gradient_at(float t, float s, double mt, double ms, double inv_zt, double inv_zs, bool target,
                            const GradScales& c, double log_ratio = 0.0) {
  const float es = static_cast<float>(shifted_exp(s, ms));
  if (c.reverse) return reverse_gradient(t, s, es, inv_zs, log_ratio, target, c);
  const float et = static_cast<float>(shifted_exp(t, mt));
  return target ? target_gradient(et, es, inv_zt, inv_zs, c) : logit_gradient(et, es, inv_zt, inv_zs, c);
}

}  // namespace retain::cuda::loss_rows
