// Naive float64 references for the KVPOP ops, written straight from DESIGN §5 with no chunking,
// no closed forms and no shared code with kernels/cpu/kvpop_*: the projections per token, the
// mLSTM as the literal sequential recurrence (C, n, m per step, reset per document run, the
// delayed readout taken from the state at t = u + w − 1), the target from a dense T×T
// probability matrix, the selection by sorting every query's eligible keys.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "kernels/kvpop.h"

namespace retain::kvpop_test {

using Vec = std::vector<double>;

// One head's parameters in float64 (same layout as kvpop::HeadParams).
struct RefParams {
  int64_t r = 0, n = 0;  // n = 2d = 4r input features
  Vec W_q, W_k, W_v, w_i, w_f;
  double b_i = 0, b_f = 0;
  Vec w_o;
  double b_o = 0, theta = 0;
  // Every parameter in one flat list (for finite differences), in this order.
  std::vector<double*> all() {
    std::vector<double*> out;
    for (Vec* v : {&W_q, &W_k, &W_v, &w_i, &w_f})
      for (double& x : *v) out.push_back(&x);
    out.push_back(&b_i);
    out.push_back(&b_f);
    for (double& x : w_o) out.push_back(&x);
    out.push_back(&b_o);
    out.push_back(&theta);
    return out;
  }
};

struct RefProjected {
  Vec q, k, v, igate, log_f;  // [T, d], [T, d], [T, r], [T], [T]
};

inline double log_sigmoid(double x) { return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x)); }

inline RefProjected ref_project(const Vec& x, int64_t T, const RefParams& p) {
  const int64_t r = p.r, n = p.n, d = 2 * r;
  RefProjected P{Vec(T * d), Vec(T * d), Vec(T * r), Vec(T), Vec(T)};
  for (int64_t t = 0; t < T; ++t) {
    auto lin = [&](const Vec& W, int64_t row) {
      double s = 0;
      for (int64_t c = 0; c < n; ++c) s += W[row * n + c] * x[t * n + c];
      return s;
    };
    for (auto [W, out] : {std::pair{&p.W_q, &P.q}, std::pair{&p.W_k, &P.k}}) {
      Vec z(r);
      for (int64_t j = 0; j < r; ++j) z[j] = lin(*W, j);
      double sp = 0, sn = 0;  // softmax(z) and softmax(−z), unshifted (|z| is small here)
      for (int64_t j = 0; j < r; ++j) {
        sp += std::exp(z[j]);
        sn += std::exp(-z[j]);
      }
      for (int64_t j = 0; j < r; ++j) {
        (*out)[t * d + j] = std::exp(z[j]) / sp;
        (*out)[t * d + r + j] = std::exp(-z[j]) / sn;
      }
    }
    for (int64_t j = 0; j < r; ++j) P.v[t * r + j] = lin(p.W_v, j);
    P.igate[t] = 15.0 * std::tanh((lin(p.w_i, 0) + p.b_i) / 15.0);
    P.log_f[t] = log_sigmoid(15.0 * std::tanh((lin(p.w_f, 0) + p.b_f) / 15.0));
  }
  return P;
}

inline bool ref_same_doc_run(const std::vector<int32_t>& doc, int64_t a, int64_t b) {
  if (doc[a] < 0) return false;
  for (int64_t x = std::min(a, b) + 1; x <= std::max(a, b); ++x)
    if (doc[x] != doc[a]) return false;
  return true;
}

// The sequential recurrence of DESIGN §5 (as mlstm-kernels' native step), scores [T] (0 where
// none) and whether each token is scored.
inline Vec ref_scores(const RefProjected& P, const std::vector<int32_t>& doc, int64_t w, const Vec& w_o, double b_o,
                      std::vector<char>* scored = nullptr) {
  const int64_t T = static_cast<int64_t>(doc.size()), d = static_cast<int64_t>(P.q.size()) / T, r = d / 2;
  Vec C(d * r, 0.0), n(d, 0.0), score(T, 0.0);
  double m = 0;
  if (scored) scored->assign(T, 0);
  for (int64_t t = 0; t < T; ++t) {
    if (doc[t] < 0) continue;
    if (t == 0 || doc[t - 1] != doc[t]) {  // a document starts: fresh state
      std::fill(C.begin(), C.end(), 0.0);
      std::fill(n.begin(), n.end(), 0.0);
      m = 0;
    }
    const double m_new = std::max(P.log_f[t] + m, P.igate[t]);
    const double fa = std::exp(P.log_f[t] + m - m_new), ia = std::exp(P.igate[t] - m_new);
    for (int64_t a = 0; a < d; ++a) {
      n[a] = fa * n[a] + ia * P.k[t * d + a];
      for (int64_t b = 0; b < r; ++b) C[a * r + b] = fa * C[a * r + b] + ia * P.k[t * d + a] * P.v[t * r + b];
    }
    m = m_new;
    const int64_t u = t - w + 1;
    if (u < 0 || !ref_same_doc_run(doc, u, t)) continue;
    double qn = 0;
    Vec h(r, 0.0);
    for (int64_t a = 0; a < d; ++a) {
      const double qa = P.q[u * d + a] / std::sqrt(double(d));
      qn += n[a] * qa;
      for (int64_t b = 0; b < r; ++b) h[b] += C[a * r + b] * qa;
    }
    const double den = std::max(std::abs(qn), std::exp(-m)) + 1e-6;
    double s = b_o;
    for (int64_t b = 0; b < r; ++b) s += w_o[b] * (h[b] / den) / (1 + std::exp(-h[b] / den));
    score[u] = s;
    if (scored) (*scored)[u] = 1;
  }
  return score;
}

// Dense float64 targets for one KV head κ: q [T, H, hd], k [T, K, hd]; -inf where no target.
inline Vec ref_target(const Vec& q, const Vec& k, const std::vector<int32_t>& doc, int64_t H, int64_t K, int64_t hd,
                      int64_t kv, int64_t w, double scale) {
  const int64_t T = static_cast<int64_t>(doc.size()), G = H / K;
  const double inf = std::numeric_limits<double>::infinity();
  Vec best(T, -inf);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = kv * G + g;
    std::vector<Vec> P(T, Vec(T, 0.0));  // the T×T probabilities, on purpose
    for (int64_t dq = 0; dq < T; ++dq) {
      if (doc[dq] < 0) continue;
      Vec s(T, -inf);
      double mx = -inf;
      for (int64_t t = 0; t <= dq; ++t) {
        if (doc[t] != doc[dq]) continue;
        double dot = 0;
        for (int64_t x = 0; x < hd; ++x) dot += q[(dq * H + h) * hd + x] * k[(t * K + kv) * hd + x];
        s[t] = dot * scale;
        mx = std::max(mx, s[t]);
      }
      double z = 0;
      for (int64_t t = 0; t <= dq; ++t) z += std::exp(s[t] - mx);
      for (int64_t t = 0; t <= dq; ++t) P[dq][t] = std::exp(s[t] - mx) / z;
    }
    for (int64_t t = 0; t < T; ++t) {
      double sum = 0;
      bool any = false;
      for (int64_t dq = t + w; dq < T; ++dq)
        if (doc[t] >= 0 && doc[dq] == doc[t]) {
          sum += P[dq][t];
          any = true;
        }
      if (any) best[t] = std::max(best[t], std::log(sum));
    }
  }
  return best;
}

// The decisions by sorting every query's eligible keys (ties: higher log m, then lower index).
inline std::vector<kvpop::Decision> brute_decisions(const Vec& lm, const std::vector<int32_t>& doc, int64_t w, int64_t sinks,
                                             int64_t k) {
  const int64_t T = static_cast<int64_t>(doc.size());
  std::vector<kvpop::Decision> out;
  for (int64_t q = 0; q < T; ++q) {
    const int64_t t_new = q - w;
    if (t_new < 0 || !ref_same_doc_run(doc, t_new, q)) continue;
    int64_t st = t_new;
    while (st > 0 && doc[st - 1] == doc[t_new]) --st;
    if (t_new - st < sinks) continue;
    std::vector<int64_t> others;
    for (int64_t i = st + sinks; i < t_new; ++i) others.push_back(i);
    if (static_cast<int64_t>(others.size()) < k) continue;
    std::sort(others.begin(), others.end(), [&](int64_t a, int64_t b) { return lm[a] != lm[b] ? lm[a] > lm[b] : a < b; });
    const int64_t b = others[static_cast<size_t>(k - 1)];
    out.push_back({q, t_new, b, lm[t_new] > lm[b] ? 1 : -1, static_cast<float>(std::abs(lm[t_new] - lm[b]))});
  }
  return out;
}

// The decisions of the KVPOP paper's rule by brute force: at each q the other eligible keys
// sorted by their effective target log m_i + floor((q − i)/every)·lg (ties: lower index), y and
// the margin on the effective targets. Straight from the definition, no residue trick.
inline std::vector<kvpop::Decision> brute_effective_decisions(const Vec& lm, const std::vector<int32_t>& doc, int64_t w,
                                                              int64_t sinks, int64_t k, double lg, int64_t every) {
  const int64_t T = static_cast<int64_t>(doc.size());
  std::vector<kvpop::Decision> out;
  for (int64_t q = 0; q < T; ++q) {
    const int64_t t_new = q - w;
    if (t_new < 0 || !ref_same_doc_run(doc, t_new, q)) continue;
    int64_t st = t_new;
    while (st > 0 && doc[st - 1] == doc[t_new]) --st;
    if (t_new - st < sinks) continue;
    auto eff = [&](int64_t i) { return lm[i] + std::floor(double(q - i) / double(every)) * lg; };
    std::vector<int64_t> others;
    for (int64_t i = st + sinks; i < t_new; ++i) others.push_back(i);
    if (static_cast<int64_t>(others.size()) < k) continue;
    std::sort(others.begin(), others.end(), [&](int64_t a, int64_t b) { return eff(a) != eff(b) ? eff(a) > eff(b) : a < b; });
    const int64_t b = others[static_cast<size_t>(k - 1)];
    out.push_back({q, t_new, b, eff(t_new) > eff(b) ? 1 : -1, static_cast<float>(std::abs(eff(t_new) - eff(b)))});
  }
  return out;
}

// Σ a·softplus(−y·(ŝ_new − ŝ_b)/τ) with ŝ_i(q) = score_i + floor((q − i)/every)·log γ and
// log γ = log γ_min + (log γ_max − log γ_min)·σ(θ), in float64 from the definition.
inline double ref_pair_loss(const Vec& score, double theta, const std::vector<kvpop::Decision>& ds, double margin_scale,
                     double tau, int64_t every = 1, double gamma_min = 0.999, double gamma_max = 0.999999) {
  const double lg = std::log(gamma_min) + (std::log(gamma_max) - std::log(gamma_min)) / (1 + std::exp(-theta));
  double sum = 0;
  for (const auto& dc : ds) {
    const double s_new = score[dc.t_new] + std::floor(double(dc.q - dc.t_new) / double(every)) * lg,
                 s_b = score[dc.b] + std::floor(double(dc.q - dc.b) / double(every)) * lg;
    const double a = margin_scale > 0 ? dc.margin * margin_scale : 1.0;
    sum += a * std::log1p(std::exp(-dc.y * (s_new - s_b) / tau));
  }
  return sum;
}


}  // namespace retain::kvpop_test
