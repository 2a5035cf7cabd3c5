#include "model/infer/kvpop_state.h"

#include <algorithm>
#include <cmath>

#include "kernels/kvpop.h"

namespace retain::infer {

KvpopState::KvpopState(const kvpop::Scorers& scorers) {
  if (!scorers.geometry()) fail("kvpop scorers without window/sinks/topk: the kvpop policy needs them");
  geometry_ = *scorers.geometry();
  const kvpop::ScorerDims& dims = scorers.dims();
  kv_heads_ = dims.kv_heads;
  d_ = dims.head_dim;
  r_ = dims.rank();
  every_ = scorers.decay().every;
  const auto values = scorers.head_values();
  for (int64_t l = 0; l < dims.layers; ++l)
    for (int64_t h = 0; h < kv_heads_; ++h) {
      Head head;
      head.p = values[static_cast<size_t>(l)][static_cast<size_t>(h)];
      head.C.assign(static_cast<size_t>(d_ * r_), 0.0);
      head.n.assign(static_cast<size_t>(d_), 0.0);
      head.log_gamma = kvpop::log_gamma(head.p.theta.data<float>()[0], scorers.decay());
      heads_.push_back(std::move(head));
    }
}

std::vector<std::vector<std::pair<int32_t, float>>> KvpopState::feed(int64_t l, const Tensor& k, const Tensor& v) {
  const int64_t T = k.dim(0), d = d_, r = r_, w = geometry_.window;
  RETAIN_CHECK(k.dim(1) == kv_heads_ && k.dim(2) == d, "KvpopState::feed: k {}", shape_str(k.shape()));
  std::vector<std::vector<std::pair<int32_t, float>>> out(static_cast<size_t>(kv_heads_));
  const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t h = 0; h < kv_heads_; ++h) {
    Head& hd = heads_[idx(l, h)];
    Tensor x = Tensor::empty({T, 2 * d}, DType::F32);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < d; ++e) {
        x.data<float>()[t * 2 * d + e] = k.data<float>()[(t * kv_heads_ + h) * d + e];
        x.data<float>()[t * 2 * d + d + e] = v.data<float>()[(t * kv_heads_ + h) * d + e];
      }
    const kvpop::Projected P = kvpop::project(x, hd.p);
    const float* wo = hd.p.w_o.data<float>();
    const double bo = hd.p.b_o.data<float>()[0];
    for (int64_t t = 0; t < T; ++t) {
      const float* kt = P.k.data<float>() + t * d;
      const float* vt = P.v.data<float>() + t * r;
      const double ig = P.igate.data<float>()[t], lf = P.log_f.data<float>()[t];
      const double m_new = std::max(lf + hd.m, ig);
      const double a = std::exp(lf + hd.m - m_new), b = std::exp(ig - m_new);
      for (int64_t i = 0; i < d; ++i) {
        for (int64_t j = 0; j < r; ++j) hd.C[i * r + j] = a * hd.C[i * r + j] + b * kt[i] * vt[j];
        hd.n[i] = a * hd.n[i] + b * kt[i];
      }
      hd.m = m_new;
      hd.recent_q.emplace_back(P.q.data<float>() + t * d, P.q.data<float>() + (t + 1) * d);
      if (static_cast<int64_t>(hd.recent_q.size()) > w) hd.recent_q.erase(hd.recent_q.begin());
      const int64_t u = hd.fed - w + 1;  // this token's position is hd.fed
      ++hd.fed;
      if (u < 0) continue;
      const std::vector<float>& q = hd.recent_q.front();  // u's query: w tokens back, this one included
      double nq = 0;
      for (int64_t i = 0; i < d; ++i) nq += hd.n[i] * q[i] * inv_sqrt_d;
      const double den = std::max(std::abs(nq), std::exp(-hd.m)) + kvpop::kReadoutEps;
      double score = bo;
      for (int64_t j = 0; j < r; ++j) {
        double num = 0;
        for (int64_t i = 0; i < d; ++i) num += hd.C[i * r + j] * q[i] * inv_sqrt_d;
        const double hj = num / den;
        score += wo[j] * hj / (1.0 + std::exp(-hj));
      }
      hd.scores.push_back(score);
      const int64_t steps = every_ == 1 ? u : u / every_;  // ⌊u/n⌋
      out[static_cast<size_t>(h)].emplace_back(static_cast<int32_t>(u),
                                               static_cast<float>(score - static_cast<double>(steps) * hd.log_gamma));
    }
  }
  return out;
}

}  // namespace retain::infer
