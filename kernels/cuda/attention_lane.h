// The per-lane arithmetic of the CUDA attention kernels (gated_attention.cu) on their mma
// fragments: masks, decays, the online softmax, the recomputed probabilities and the gradient
// terms. __host__ __device__, so tests/cuda/test_attention_tiles.cpp runs the kernels' very
// element code in a CPU emulation of whole CTAs (with emulated ldmatrix/mma) and compares it to
// the CPU reference op. What stays device-only: quad reductions (shuffles; the emulation adds
// across the 4 lanes), shared-memory staging and barriers.
//
// A warp's tile fragment is float s[NT][4]: element (nt, e) of lane `lane` sits at fragment row
// c_row(lane, e) (this lane's row e / 2 of {group, group + 8}) and column 8·nt + c_col(lane, e).
// Logits are in base-2 units (·log2 e) so that exp is exp2.
#pragma once
#include <math.h>

#include <cstdint>

#include "kernels/cuda/attention_tiles.h"
#include "kernels/cuda/fast_exp2.h"

namespace retain::cuda::tiles {

inline constexpr float kLn2 = 0.6931471805599453f;
using cuda::exp2_ftz;  // one MUFU.EX2 per probability (kernels/cuda/fast_exp2.h)
using cuda::kLog2e;

// ---- what the kernels stage per key -------------------------------------------------------
// lb2 = logβ·log2 e, clamped at kMinLb2 so that a −inf logβ stays finite in the unmasked tiles'
// fused form below (there t − i ≥ 1, so such a key's weight is still exp2(≤ −1e30) = 0, as
// with −inf; the masked tiles' decay() gives the i = t term 0 either way; with t − i < 2^24 no
// product overflows). Padding keys stage 0. For key column c of a query-side tile the kernels
// also stage −c·lb2, which makes the decay (t − i)·lb2 = (t − i0 − c)·lb2 one FMA on the row's
// float distance to the tile, t − i0.
inline constexpr float kMinLb2 = -1e30f;
RETAIN_HD float staged_lb2(float log_beta) { return fmaxf(log_beta * kLog2e, kMinLb2); }
RETAIN_HD float staged_neg_c_lb2(int c, float lb2) { return -static_cast<float>(c) * lb2; }

// ---- query rows × key columns (forward, dq) --------------------------------------------
// Row x ∈ {0, 1} of this lane is query t[x] (document doc_t[x], -1 past T); column c is key
// i0 + c, with lb2[c] = staged_lb2(logβ_i), ncl[c] = staged_neg_c_lb2(c, lb2[c]) and doc_k[c]
// its document (-1 past T), c ∈ [0, 64). q·k in s becomes the base-2 logit
// (q·k)·scale·log2 e + (t − i)·logβ_i·log2 e, or −inf where the pair is not allowed.
// all_allowed (tile_all_allowed: no mask needed, every t − i ≥ 1) takes separate code: two
// FMAs per element on float distances; the masked tiles (diagonal, document edges, padding)
// test each pair and keep the exact i = t term.
template <int NT>
RETAIN_HD void query_row_logits(float (&s)[NT][4], int lane, const int64_t (&t)[2], const int32_t (&doc_t)[2],
                                int64_t i0, const float* lb2, const float* ncl, const int32_t* doc_k,
                                bool all_allowed, float scale2) {
  if (all_allowed) {
    const float dt[2] = {static_cast<float>(t[0] - i0), static_cast<float>(t[1] - i0)};  // exact: < 2^24
RETAIN_UNROLL
    for (int nt = 0; nt < NT; ++nt)
RETAIN_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int c = 8 * nt + c_col(lane, e);
        s[nt][e] = fmaf(s[nt][e], scale2, fmaf(dt[e / 2], lb2[c], ncl[c]));
      }
    return;
  }
RETAIN_UNROLL
  for (int nt = 0; nt < NT; ++nt)
RETAIN_UNROLL
    for (int e = 0; e < 4; ++e) {
      const int x = e / 2, c = 8 * nt + c_col(lane, e);
      const int64_t i = i0 + c;
      const float val = s[nt][e] * scale2 + decay(t[x], i, lb2[c]);
      s[nt][e] = pair_allowed(t[x], i, doc_t[x], doc_k[c]) ? val : -INFINITY;
    }
}

// This lane's maxima of its two rows (to be reduced over the 4 lanes of the quad).
template <int NT>
RETAIN_HD void lane_row_max(const float (&s)[NT][4], float (&mx)[2]) {
  mx[0] = mx[1] = -INFINITY;
RETAIN_UNROLL
  for (int nt = 0; nt < NT; ++nt)
RETAIN_UNROLL
    for (int e = 0; e < 4; ++e) mx[e / 2] = fmaxf(mx[e / 2], s[nt][e]);
}

// One online-softmax step: tile_max = the rows' maxima over this tile (whole quad), m the
// running maxima (−inf: nothing allowed yet), l this lane's running partial sums relative to
// m. Logits in s become probabilities relative to the new maxima; alpha = exp2(m_old − m_new)
// rescales what was accumulated before (0 when nothing was; exactly 1 when the maximum held,
// which the forward kernel tests to skip the rescale). A row with nothing allowed so far
// keeps m = −inf and uses 0 as its reference, so no −inf − (−inf) ever occurs.
template <int NT>
RETAIN_HD void online_softmax_step(float (&s)[NT][4], const float (&tile_max)[2], float (&m)[2], float (&l)[2],
                                   float (&alpha)[2]) {
  float m_use[2];
RETAIN_UNROLL
  for (int x = 0; x < 2; ++x) {
    const float m_new = fmaxf(m[x], tile_max[x]);
    m_use[x] = m_new == -INFINITY ? 0.0f : m_new;
    alpha[x] = m_new == m[x] ? 1.0f : exp2_ftz(m[x] - m_use[x]);  // exactly 1 when the maximum held
    m[x] = m_new;
  }
  float rowsum[2] = {0.0f, 0.0f};
RETAIN_UNROLL
  for (int nt = 0; nt < NT; ++nt)
RETAIN_UNROLL
    for (int e = 0; e < 4; ++e) {
      const float p = exp2_ftz(s[nt][e] - m_use[e / 2]);  // masked: exp2(−inf) = 0
      s[nt][e] = p;
      rowsum[e / 2] += p;
    }
RETAIN_UNROLL
  for (int x = 0; x < 2; ++x) l[x] = l[x] * alpha[x] + rowsum[x];
}

// A finished row: l = the whole row's sum (quad-reduced), m its maximum. inv multiplies the
// accumulated output (0 for a row with nothing allowed: padding, past T), lse is natural-log.
// A row whose largest logit is at most kNoMass2 has only keys of β = 0 (clamped lb2, t − i ≥ 1:
// logits ≤ −1e30 + |q·k|): a weight of exactly 0 for each, i.e. no allowed key, as the CPU
// reference has it. Only a span pair meets such a row (kernels/retention_spans.h: a chunk before
// the queries, without their own keys); in one sequence every row has its own key at weight 1.
inline constexpr float kNoMass2 = 0.5f * kMinLb2;
RETAIN_HD void finish_row(float l, float m, float& inv, float& lse) {
  const bool mass = l > 0.0f && m > kNoMass2;
  inv = mass ? 1.0f / l : 0.0f;
  lse = mass ? (m + log2f(l)) * kLn2 : -INFINITY;
}

// The saved lse of a row in base-2 units, 0 for −inf (rows that allow nothing, whose
// probabilities are masked to 0 before this value could matter).
RETAIN_HD float lse_base2(float lse) { return lse == -INFINITY ? 0.0f : lse * kLog2e; }

// dq: s = q·k and dp = dO·v of a tile → dS = P∘(dP − D_t) in s, P = exp2(logit − lse2_t)
// (lse2, delta: this lane's two rows; lb2, ncl, all_allowed as in query_row_logits).
template <int NT>
RETAIN_HD void query_row_dscores(float (&s)[NT][4], const float (&dp)[NT][4], int lane, const int64_t (&t)[2],
                                 const int32_t (&doc_t)[2], int64_t i0, const float* lb2, const float* ncl,
                                 const int32_t* doc_k, bool all_allowed, float scale2, const float (&lse2)[2],
                                 const float (&delta)[2]) {
  if (all_allowed) {
    const float dt[2] = {static_cast<float>(t[0] - i0), static_cast<float>(t[1] - i0)};
RETAIN_UNROLL
    for (int nt = 0; nt < NT; ++nt)
RETAIN_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int x = e / 2, c = 8 * nt + c_col(lane, e);
        const float val = fmaf(s[nt][e], scale2, fmaf(dt[x], lb2[c], ncl[c]));
        s[nt][e] = exp2_ftz(val - lse2[x]) * (dp[nt][e] - delta[x]);
      }
    return;
  }
RETAIN_UNROLL
  for (int nt = 0; nt < NT; ++nt)
RETAIN_UNROLL
    for (int e = 0; e < 4; ++e) {
      const int x = e / 2, c = 8 * nt + c_col(lane, e);
      const int64_t i = i0 + c;
      const bool allowed = pair_allowed(t[x], i, doc_t[x], doc_k[c]);
      const float val = s[nt][e] * scale2 + decay(t[x], i, lb2[c]);
      const float p = allowed ? exp2_ftz(val - lse2[x]) : 0.0f;
      s[nt][e] = p * (dp[nt][e] - delta[x]);
    }
}

// ---- key rows × query columns (dk, dv, dlogβ) ------------------------------------------
// Row x of this lane is key i[x] (document doc_i[x], -1 past T; lb2_i[x] = staged_lb2(logβ));
// column c (relative to the tile) is query q0 + c with lse2[c], delta[c], doc_q[c] from the
// tile's staged rows; the fragment's columns start at tile column col0. s = k·q, dp = v·dO
// become P (in s) and dS = P∘(dP − D_t) (in dp), and dlb[x] += Σ (t − i)·dS over the fragment
// (fp32 dS: the bf16 rounding only enters dk's product). Unmasked tiles (all_allowed) take the
// distance t − i as the float d0[x] + (8·nt + e % 2) (exact), one add per element, no masks.
template <int NT>
RETAIN_HD void key_row_grads(float (&s)[NT][4], float (&dp)[NT][4], int lane, const int64_t (&i)[2],
                             const int32_t (&doc_i)[2], const float (&lb2_i)[2], int64_t q0, int col0,
                             const float* lse2, const float* delta, const int32_t* doc_q, bool all_allowed,
                             float scale2, float (&dlb)[2]) {
  if (all_allowed) {
    const int64_t first = q0 + col0 + c_col(lane, 0);  // this lane's column 0, nt = 0
    const float d0[2] = {static_cast<float>(first - i[0]), static_cast<float>(first - i[1])};
RETAIN_UNROLL
    for (int nt = 0; nt < NT; ++nt)
RETAIN_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int x = e / 2, c = col0 + 8 * nt + c_col(lane, e);
        const float d = d0[x] + static_cast<float>(8 * nt + e % 2);  // t − i, exact
        const float p = exp2_ftz(fmaf(s[nt][e], scale2, d * lb2_i[x]) - lse2[c]);
        const float ds = p * (dp[nt][e] - delta[c]);
        dlb[x] = fmaf(d, ds, dlb[x]);
        s[nt][e] = p;
        dp[nt][e] = ds;
      }
    return;
  }
RETAIN_UNROLL
  for (int nt = 0; nt < NT; ++nt)
RETAIN_UNROLL
    for (int e = 0; e < 4; ++e) {
      const int x = e / 2, c = col0 + 8 * nt + c_col(lane, e);
      const int64_t t = q0 + c;
      const bool allowed = pair_allowed(t, i[x], doc_q[c], doc_i[x]);
      const float val = s[nt][e] * scale2 + decay(t, i[x], lb2_i[x]);
      const float p = allowed ? exp2_ftz(val - lse2[c]) : 0.0f;
      const float ds = p * (dp[nt][e] - delta[c]);
      dlb[x] += allowed ? static_cast<float>(t - i[x]) * ds : 0.0f;  // t − i ≥ 0 where allowed
      s[nt][e] = p;
      dp[nt][e] = ds;
    }
}

}  // namespace retain::cuda::tiles
