// CPU reference for retention-gated attention (DESIGN §4; formulas in docs/math.md,
// "Retention-gated attention"). FlashAttention-style: the T×T score matrix is visited in
// 64×64 tiles and never stored; the forward keeps a running max and sum per query row
// (online softmax), the backward recomputes probabilities from the saved log-sum-exp.
// Tiles that hold no allowed pair (above the diagonal, or whose blocks share no document)
// are skipped. Each output row belongs to exactly one OpenMP work item that visits its
// tiles in a fixed order, so results do not depend on the thread count and need no atomics.
// Inside a tile sums run in float32 (≤ 64 terms); across tiles they run in float64.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/retention_cpu.h"

namespace retain::cpu {

namespace {

constexpr int64_t B = kRetentionBlock;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A query span of Tq tokens against a key span of Tk tokens of one sequence: q0, k0 are the
// global indices of their first tokens (both 0, and the same tokens, for a whole sequence;
// context parallelism passes one rank's chunk against another's). Distances t − i and the
// causal test use the global indices, the document test each span's own doc ids.
struct Operands {
  int64_t Tq, Tk, H, K, d, group;
  int64_t q0, k0;
  const float* q;
  const float* k;
  const float* v;
  const float* log_beta;
  const int32_t* doc_q;
  const int32_t* doc_k;
  float scale;

  const float* q_row(int64_t t, int64_t h) const { return q + (t * H + h) * d; }
};

Operands operands(const Tensor& q, const Tensor& q_doc, int64_t q_start, const Tensor& k, const Tensor& v,
                  const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, float scale) {
  return Operands{q.dim(0),          k.dim(0),         q.dim(1),        k.dim(1),
                  q.dim(2),          q.dim(1) / k.dim(1), q_start,       k_start,
                  q.data<float>(),   k.data<float>(),  v.data<float>(), log_beta.data<float>(),
                  q_doc.data<int32_t>(), k_doc.data<int32_t>(), scale};
}

// The block bookkeeping of both spans: which tiles can hold an allowed pair, and which hold
// nothing else. For a whole sequence these are blocks_may_meet with kb ≤ qb, and tile_all_allowed.
struct SpanBlocks {
  std::vector<DocRange> q, k;
  int64_t q0, k0, Tq;
  SpanBlocks(const Operands& o) : q(block_doc_ranges(o.doc_q, o.Tq)), k(block_doc_ranges(o.doc_k, o.Tk)),
                                  q0(o.q0), k0(o.k0), Tq(o.Tq) {}
  int64_t q_blocks() const { return static_cast<int64_t>(q.size()); }
  int64_t k_blocks() const { return static_cast<int64_t>(k.size()); }
  // The key block's first key is not after the query block's last query (causal), and they
  // may share a document.
  bool meet(int64_t qb, int64_t kb) const {
    const int64_t last_query = q0 + std::min(Tq, qb * B + B) - 1;
    return k0 + kb * B <= last_query && blocks_may_meet(q[static_cast<size_t>(qb)], k[static_cast<size_t>(kb)]);
  }
  // Every key of the block lies before every query of the query block, both full blocks of
  // one and the same document.
  bool all_allowed(int64_t qb, int64_t kb) const {
    const DocRange &a = q[static_cast<size_t>(qb)], &b = k[static_cast<size_t>(kb)];
    return k0 + kb * B + B - 1 < q0 + qb * B && a.single() && b.single() && a.lo == b.lo;
  }
};

// cols_t[j·B + c] = row(i0 + c)[j] for c < n and 0 for n ≤ c < B, where row(i) starts at
// base + i·stride: a key block transposed, so that a tile's dot products vectorize over keys.
void gather_transposed(const float* base, int64_t stride, int64_t i0, int64_t n, int64_t d, float* cols_t) {
  for (int64_t c = 0; c < n; ++c) {
    const float* row = base + (i0 + c) * stride;
    for (int64_t j = 0; j < d; ++j) cols_t[j * B + c] = row[j];
  }
  for (int64_t j = 0; j < d; ++j)
    for (int64_t c = n; c < B; ++c) cols_t[j * B + c] = 0.0f;
}

// out[r·B + c] = Σ_j rows(r)[j] · cols_t[j·B + c] for r < nq, where rows(r) = rows0 + r·stride.
void tile_dots(const float* rows0, int64_t stride, int64_t nq, int64_t d, const float* cols_t, float* out) {
  for (int64_t r = 0; r < nq; ++r) {
    float* o = out + r * B;
    const float* x = rows0 + r * stride;
    for (int64_t c = 0; c < B; ++c) o[c] = 0.0f;
    for (int64_t j = 0; j < d; ++j) {
      const float xj = x[j];
      const float* col = cols_t + j * B;
      for (int64_t c = 0; c < B; ++c) o[c] += xj * col[c];
    }
  }
}

// out[r·d + j] = Σ_c a[r·B + c] · cols_t[j·B + c] for r < nq: a tile times a key block
// (gathered transposed). Eight interleaved partial sums per entry let the sum over keys
// vectorize without reassociation flags; the order is fixed, so results are reproducible.
void tile_times_block(const float* a, int64_t nq, const float* cols_t, int64_t d, float* out) {
  constexpr int64_t W = 8;
  for (int64_t r = 0; r < nq; ++r) {
    const float* ar = a + r * B;
    for (int64_t j = 0; j < d; ++j) {
      const float* col = cols_t + j * B;
      float lane[W] = {};
      for (int64_t c0 = 0; c0 < B; c0 += W)
        for (int64_t u = 0; u < W; ++u) lane[u] += ar[c0 + u] * col[c0 + u];
      out[r * d + j] = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    }
  }
}

// acc_t[j·B + c] += Σ_r a[r·B + c] · rows(r)[j] for r < nq, rows(r) = rows0 + r·stride: a tile
// transposed times query-side rows, accumulated per key (vectorizes over keys).
void tile_t_times_rows(const float* a, int64_t nq, const float* rows0, int64_t stride, int64_t d, float* acc_t) {
  for (int64_t r = 0; r < nq; ++r) {
    const float* ar = a + r * B;
    const float* x = rows0 + r * stride;
    for (int64_t j = 0; j < d; ++j) {
      const float xj = x[j];
      float* acc = acc_t + j * B;
      for (int64_t c = 0; c < B; ++c) acc[c] += ar[c] * xj;
    }
  }
}

// s[r·B + c] = score(t0 + r, i0 + c) of query head h = (q·k)·scale + (t − i)·logβ[i, κ(h)],
// or −inf where the pair is not allowed. The decay of the i = t term is exactly 0 (β⁰ = 1,
// even for logβ = −inf). k_t is the key block gathered by gather_transposed. With
// `all_allowed` (tile_all_allowed) the mask is known and a branch-free loop fills the tile.
void tile_scores(const Operands& o, int64_t h, int64_t t0, int64_t nq, int64_t i0, int64_t nk, const float* k_t,
                 bool all_allowed, float* s) {
  const int64_t kv = h / o.group;
  tile_dots(o.q_row(t0, h), o.H * o.d, nq, o.d, k_t, s);
  if (all_allowed) {  // nq = nk = B and t > i for every pair
    float lb[B], distance0[B];
    for (int64_t c = 0; c < B; ++c) {
      lb[c] = o.log_beta[(i0 + c) * o.K + kv];
      distance0[c] = static_cast<float>((o.q0 + t0) - (o.k0 + i0 + c));
    }
    for (int64_t r = 0; r < B; ++r) {
      float* sr = s + r * B;
      const float fr = static_cast<float>(r);
      for (int64_t c = 0; c < B; ++c) sr[c] = sr[c] * o.scale + (distance0[c] + fr) * lb[c];
    }
    return;
  }
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t t = o.q0 + t0 + r;  // global indices
    const int32_t dt = o.doc_q[t0 + r];
    float* sr = s + r * B;
    for (int64_t c = 0; c < B; ++c) {
      const int64_t i = o.k0 + i0 + c;
      const bool allowed = c < nk && i <= t && dt >= 0 && o.doc_k[i0 + c] == dt;
      // (only where allowed: past a key span's end, i < t does not mean the key exists)
      const float decay = allowed && t > i ? static_cast<float>(t - i) * o.log_beta[(i0 + c) * o.K + kv] : 0.0f;
      sr[c] = allowed ? sr[c] * o.scale + decay : kNegInf;
    }
  }
}

void forward(const Operands& o, float* out_p, float* lse_p) {
  const int64_t T = o.Tq, Tk = o.Tk, H = o.H, K = o.K, d = o.d;
  const SpanBlocks blocks(o);
  const int64_t nb = blocks.q_blocks(), nkb = blocks.k_blocks();

#pragma omp parallel
  {
    std::vector<float> k_t(static_cast<size_t>(B * d)), v_t(static_cast<size_t>(B * d)), s(static_cast<size_t>(B * B));
    std::vector<float> m(B), psum(B), o_tile(static_cast<size_t>(B * d));
    std::vector<double> l(B), alpha(B), acc(static_cast<size_t>(B * d));
    // Later query blocks visit more tiles: hand them out first.
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t qb = nb - 1; qb >= 0; --qb) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t t0 = qb * B, nq = std::min(B, T - t0), kv = h / o.group;
        std::fill(m.begin(), m.end(), kNegInf);
        std::fill(l.begin(), l.end(), 0.0);
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t kb = 0; kb < nkb; ++kb) {
          if (!blocks.meet(qb, kb)) continue;
          const int64_t i0 = kb * B, nk = std::min(B, Tk - i0);
          gather_transposed(o.k + kv * d, K * d, i0, nk, d, k_t.data());
          gather_transposed(o.v + kv * d, K * d, i0, nk, d, v_t.data());
          tile_scores(o, h, t0, nq, i0, nk, k_t.data(), blocks.all_allowed(qb, kb), s.data());
          // Scores become probabilities relative to the new running max, in place.
          for (int64_t r = 0; r < nq; ++r) {
            float* sr = s.data() + r * B;
            float mx = kNegInf;
            for (int64_t c = 0; c < B; ++c) mx = std::max(mx, sr[c]);
            if (mx == kNegInf) {  // no allowed key for this row in this tile
              std::fill(sr, sr + B, 0.0f);
              alpha[r] = 1.0;
              psum[r] = 0.0f;
              continue;
            }
            const float m_new = std::max(m[r], mx);
            alpha[r] = std::exp(static_cast<double>(m[r]) - m_new);  // 0 on a row's first tile
            m[r] = m_new;
            float sum = 0.0f;
            for (int64_t c = 0; c < B; ++c) sum += (sr[c] = exp_or_zero(sr[c] - m_new));
            psum[r] = sum;
          }
          tile_times_block(s.data(), nq, v_t.data(), d, o_tile.data());
          for (int64_t r = 0; r < nq; ++r) {
            l[r] = l[r] * alpha[r] + psum[r];
            for (int64_t j = 0; j < d; ++j) acc[r * d + j] = acc[r * d + j] * alpha[r] + o_tile[r * d + j];
          }
        }
        for (int64_t r = 0; r < nq; ++r) {
          const int64_t t = t0 + r;
          float* orow = out_p + (t * H + h) * d;
          // l ≥ 1 for every row with an allowed key (the row maximum contributes exp(0)); in a
          // whole sequence only padding rows have none, in a span also rows before every key.
          if (l[r] == 0.0) {
            std::memset(orow, 0, sizeof(float) * d);
            lse_p[t * H + h] = kNegInf;
            continue;
          }
          for (int64_t j = 0; j < d; ++j) orow[j] = static_cast<float>(acc[r * d + j] / l[r]);
          lse_p[t * H + h] = static_cast<float>(m[r] + std::log(l[r]));
        }
      }
    }
  }
}

// The gradients of a span pair. `add`: the results are added to dq, dk, dv, dlog_beta (one
// rounding more per span) instead of overwriting them.
void backward(const Operands& o, const Tensor& out, const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk,
              Tensor& dv, Tensor& dlog_beta, bool add) {
  const int64_t T = o.Tq, Tk = o.Tk, H = o.H, K = o.K, d = o.d;
  const SpanBlocks blocks(o);
  const int64_t nb = blocks.q_blocks(), nkb = blocks.k_blocks();
  const float* out_p = out.data<float>();
  const float* lse_p = lse.data<float>();
  const float* dout_p = dout.data<float>();
  float* dq_p = dq.data<float>();
  float* dk_p = dk.data<float>();
  float* dv_p = dv.data<float>();
  float* dlb_p = dlog_beta.data<float>();
  auto put = [add](float& dst, double value) { dst = add ? dst + static_cast<float>(value) : static_cast<float>(value); };

  // D[t, h] = Σ_j dout·out = Σ_i P_ti·dP_ti, the softmax-backward row term.
  std::vector<double> D(static_cast<size_t>(T * H));
#pragma omp parallel for schedule(static)
  for (int64_t th = 0; th < T * H; ++th) {
    double sum = 0;
    for (int64_t j = 0; j < d; ++j) sum += static_cast<double>(dout_p[th * d + j]) * out_p[th * d + j];
    D[th] = sum;
  }

  // Turns a tile of scores into probabilities P = exp(s − lse_t) and a tile of dP = dout·v
  // into dS = P∘(dP − D_t), both in place. Disallowed pairs (s = −inf) give 0, padding rows too.
  auto probabilities = [&](int64_t h, int64_t t0, int64_t nq, float* s, float* dp) {
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t t = t0 + r;
      const float lse_t = lse_p[t * H + h], D_t = static_cast<float>(D[t * H + h]);
      for (int64_t c = 0; c < B; ++c) {
        const float p = s[r * B + c] == kNegInf ? 0.0f : exp_or_zero(s[r * B + c] - lse_t);
        s[r * B + c] = p;
        dp[r * B + c] = p * (dp[r * B + c] - D_t);
      }
    }
  };

  // dq: one work item per (query block, query head), over key blocks 0..qb.
#pragma omp parallel
  {
    std::vector<float> k_t(static_cast<size_t>(B * d)), v_t(static_cast<size_t>(B * d));
    std::vector<float> s(static_cast<size_t>(B * B)), dp(static_cast<size_t>(B * B)), dq_tile(static_cast<size_t>(B * d));
    std::vector<double> acc(static_cast<size_t>(B * d));
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t qb = nb - 1; qb >= 0; --qb) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t t0 = qb * B, nq = std::min(B, T - t0), kv = h / o.group;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t kb = 0; kb < nkb; ++kb) {
          if (!blocks.meet(qb, kb)) continue;
          const int64_t i0 = kb * B, nk = std::min(B, Tk - i0);
          gather_transposed(o.k + kv * d, K * d, i0, nk, d, k_t.data());
          gather_transposed(o.v + kv * d, K * d, i0, nk, d, v_t.data());
          tile_scores(o, h, t0, nq, i0, nk, k_t.data(), blocks.all_allowed(qb, kb), s.data());
          tile_dots(dout_p + (t0 * H + h) * d, H * d, nq, d, v_t.data(), dp.data());
          probabilities(h, t0, nq, s.data(), dp.data());
          tile_times_block(dp.data(), nq, k_t.data(), d, dq_tile.data());  // Σ_c dS_rc k_c
          for (int64_t x = 0; x < nq * d; ++x) acc[x] += dq_tile[x];
        }
        for (int64_t r = 0; r < nq; ++r)
          for (int64_t j = 0; j < d; ++j)
            put(dq_p[((t0 + r) * H + h) * d + j], acc[r * d + j] * o.scale);
      }
    }
  }

  // dk, dv, dlogβ: one work item per (key block, KV head), over the group's query heads and
  // the query blocks qb ≥ kb. dlogβ_i = Σ_{h in group} Σ_t (t − i)·dS_ti.
#pragma omp parallel
  {
    std::vector<float> k_t(static_cast<size_t>(B * d)), v_t(static_cast<size_t>(B * d));
    std::vector<float> s(static_cast<size_t>(B * B)), dp(static_cast<size_t>(B * B));
    // dk_t, dv_t: a key block's per-tile gradients, transposed ([j·B + c]) to vectorize over keys.
    std::vector<float> dk_t(static_cast<size_t>(B * d)), dv_t(static_cast<size_t>(B * d)), dlb_tile(B), distance0(B);
    std::vector<double> dk_acc(static_cast<size_t>(B * d)), dv_acc(static_cast<size_t>(B * d)), dlb_acc(B);
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t kb = 0; kb < nkb; ++kb) {  // early key blocks meet the most query blocks
      for (int64_t kv = 0; kv < K; ++kv) {
        const int64_t i0 = kb * B, nk = std::min(B, Tk - i0);
        std::fill(dk_acc.begin(), dk_acc.end(), 0.0);
        std::fill(dv_acc.begin(), dv_acc.end(), 0.0);
        std::fill(dlb_acc.begin(), dlb_acc.end(), 0.0);
        gather_transposed(o.k + kv * d, K * d, i0, nk, d, k_t.data());
        gather_transposed(o.v + kv * d, K * d, i0, nk, d, v_t.data());
        for (int64_t h = kv * o.group; h < (kv + 1) * o.group; ++h) {
          for (int64_t qb = 0; qb < nb; ++qb) {
            if (!blocks.meet(qb, kb)) continue;
            const int64_t t0 = qb * B, nq = std::min(B, T - t0);
            tile_scores(o, h, t0, nq, i0, nk, k_t.data(), blocks.all_allowed(qb, kb), s.data());
            tile_dots(dout_p + (t0 * H + h) * d, H * d, nq, d, v_t.data(), dp.data());
            probabilities(h, t0, nq, s.data(), dp.data());
            std::fill(dk_t.begin(), dk_t.end(), 0.0f);
            std::fill(dv_t.begin(), dv_t.end(), 0.0f);
            std::fill(dlb_tile.begin(), dlb_tile.end(), 0.0f);
            // P and dS are 0 wherever the pair is not allowed (and in padding rows).
            tile_t_times_rows(s.data(), nq, dout_p + (t0 * H + h) * d, H * d, d, dv_t.data());
            tile_t_times_rows(dp.data(), nq, o.q_row(t0, h), H * d, d, dk_t.data());
            for (int64_t c = 0; c < B; ++c) distance0[c] = static_cast<float>((o.q0 + t0) - (o.k0 + i0 + c));
            for (int64_t r = 0; r < nq; ++r) {  // (t − i)·dS, exact distances in float32
              const float fr = static_cast<float>(r);
              for (int64_t c = 0; c < B; ++c) dlb_tile[c] += (distance0[c] + fr) * dp[r * B + c];
            }
            for (int64_t c = 0; c < nk; ++c)
              for (int64_t j = 0; j < d; ++j) {
                dk_acc[c * d + j] += dk_t[j * B + c];
                dv_acc[c * d + j] += dv_t[j * B + c];
              }
            for (int64_t c = 0; c < nk; ++c) dlb_acc[c] += dlb_tile[c];
          }
        }
        for (int64_t c = 0; c < nk; ++c) {
          const int64_t i = i0 + c;
          for (int64_t j = 0; j < d; ++j) {
            put(dk_p[(i * K + kv) * d + j], dk_acc[c * d + j] * o.scale);
            put(dv_p[(i * K + kv) * d + j], dv_acc[c * d + j]);
          }
          put(dlb_p[i * K + kv], dlb_acc[c]);
        }
      }
    }
  }
}

}  // namespace

void gated_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& log_beta, const Tensor& doc,
                     float scale, Tensor& out, Tensor& lse) {
  forward(operands(q, doc, 0, k, v, log_beta, doc, 0, scale), out.data<float>(), lse.data<float>());
}

void gated_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& log_beta,
                              const Tensor& doc, float scale, const Tensor& out, const Tensor& lse,
                              const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dlog_beta) {
  backward(operands(q, doc, 0, k, v, log_beta, doc, 0, scale), out, lse, dout, dq, dk, dv, dlog_beta, false);
}

void gated_attention_span(const Tensor& q, const Tensor& q_doc, int64_t q_start, const Tensor& k, const Tensor& v,
                          const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, float scale, Tensor& out,
                          Tensor& lse) {
  forward(operands(q, q_doc, q_start, k, v, log_beta, k_doc, k_start, scale), out.data<float>(), lse.data<float>());
}

void gated_attention_span_backward(const Tensor& q, const Tensor& q_doc, int64_t q_start, const Tensor& k,
                                   const Tensor& v, const Tensor& log_beta, const Tensor& k_doc, int64_t k_start,
                                   float scale, const Tensor& out, const Tensor& lse, const Tensor& dout, Tensor& dq,
                                   Tensor& dk, Tensor& dv, Tensor& dlog_beta) {
  backward(operands(q, q_doc, q_start, k, v, log_beta, k_doc, k_start, scale), out, lse, dout, dq, dk, dv, dlog_beta,
           true);
}

void merge_attention(Tensor& out, Tensor& lse, const Tensor& part_out, const Tensor& part_lse) {
  const int64_t rows = lse.numel(), d = out.numel() / std::max<int64_t>(rows, 1);
  float* o = out.data<float>();
  float* l = lse.data<float>();
  const float* po = part_out.data<float>();
  const float* pl = part_lse.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t x = 0; x < rows; ++x) {
    if (pl[x] == kNegInf) continue;  // the part has no allowed key for this row
    if (l[x] == kNegInf) {
      std::memcpy(o + x * d, po + x * d, sizeof(float) * static_cast<size_t>(d));
      l[x] = pl[x];
      continue;
    }
    // out·e^{lse} is the row's unnormalized sum: the merged row is their sum over e^{lse'}.
    const double a = l[x], b = pl[x], m = std::max(a, b);
    const double total = m + std::log(std::exp(a - m) + std::exp(b - m));
    const double wa = std::exp(a - total), wb = std::exp(b - total);
    for (int64_t j = 0; j < d; ++j)
      o[x * d + j] = static_cast<float>(wa * o[x * d + j] + wb * po[x * d + j]);
    l[x] = static_cast<float>(total);
  }
}

}  // namespace retain::cpu
