// Naive float64 references for the retention ops, written straight from DESIGN §4 with no
// tiling, skipping or online softmax: the independent side of tests/retention/*.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "kernels/retention.h"
#include "kernels/tensor.h"

namespace retain::test {

inline constexpr double kInf = std::numeric_limits<double>::infinity();

inline std::vector<double> to_f64(const Tensor& t) {
  const float* p = t.data<float>();
  return std::vector<double>(p, p + t.numel());
}

inline Tensor f32(const std::vector<double>& v, const Shape& shape) {
  std::vector<float> f(v.begin(), v.end());
  return Tensor::from_vector<float>(f, shape);
}

inline Tensor i32(const std::vector<int32_t>& v) {
  return Tensor::from_vector<int32_t>(v, {static_cast<int64_t>(v.size())});
}

// Values drawn in float32 and kept as float64 copies, so the op and the reference see the
// same numbers.
inline std::vector<double> randn(int64_t n, std::mt19937& rng, double std = 1.0) {
  std::normal_distribution<float> dist(0.0f, static_cast<float>(std));
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = dist(rng);
  return v;
}

// ‖got − want‖ / (‖want‖ + ‖floor‖): relative error, measured against ‖floor‖ (a float32
// noise scale) where the true values are far smaller than that.
inline double rel_err(const std::vector<double>& got, const std::vector<double>& want,
                      const std::vector<double>& floor) {
  double num = 0, den = 0, fl = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
    fl += floor[i] * floor[i];
  }
  const double scale = std::sqrt(den) + std::sqrt(fl);
  return scale == 0 ? std::sqrt(num) : std::sqrt(num) / scale;
}

// ‖got − want‖ / ‖want‖ (0 when both are 0).
inline double rel_err(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

inline bool allowed(const std::vector<int32_t>& doc, int64_t t, int64_t i) {
  return i <= t && doc[t] >= 0 && doc[i] == doc[t];
}

// Inputs of one gated attention call, in float64.
struct Attn {
  int64_t T, H, K, d;
  double scale;
  std::vector<double> q, k, v, lb;  // [T,H,d], [T,K,d], [T,K,d], [T,K]
  std::vector<int32_t> doc;

  int64_t kv(int64_t h) const { return h / (H / K); }
  double score(int64_t t, int64_t h, int64_t i) const {
    double s = 0;
    for (int64_t j = 0; j < d; ++j) s += q[(t * H + h) * d + j] * k[(i * K + kv(h)) * d + j];
    return s * scale + static_cast<double>(t - i) * (t == i ? 0.0 : lb[i * K + kv(h)]);
  }
};

// One query row: probabilities over i (0 where not allowed), the output row and lse.
struct AttnRow {
  std::vector<double> p, out;
  double lse = -kInf;
};

inline AttnRow attention_row(const Attn& a, int64_t t, int64_t h) {
  AttnRow row;
  row.p.assign(static_cast<size_t>(t + 1), 0.0);
  row.out.assign(static_cast<size_t>(a.d), 0.0);
  if (a.doc[t] < 0) return row;
  double mx = -kInf;
  for (int64_t i = 0; i <= t; ++i)
    if (allowed(a.doc, t, i)) row.p[i] = a.score(t, h, i), mx = std::max(mx, row.p[i]);
  double sum = 0;
  for (int64_t i = 0; i <= t; ++i)
    if (allowed(a.doc, t, i)) sum += (row.p[i] = std::exp(row.p[i] - mx));
  for (int64_t i = 0; i <= t; ++i) {
    if (!allowed(a.doc, t, i)) continue;
    row.p[i] /= sum;
    for (int64_t j = 0; j < a.d; ++j) row.out[j] += row.p[i] * a.v[(i * a.K + a.kv(h)) * a.d + j];
  }
  row.lse = mx + std::log(sum);
  return row;
}

struct AttnOut {
  std::vector<double> out, lse;
};

inline AttnOut attention_forward(const Attn& a) {
  AttnOut r{std::vector<double>(static_cast<size_t>(a.T * a.H * a.d)), std::vector<double>(static_cast<size_t>(a.T * a.H))};
  for (int64_t t = 0; t < a.T; ++t)
    for (int64_t h = 0; h < a.H; ++h) {
      const AttnRow row = attention_row(a, t, h);
      std::copy(row.out.begin(), row.out.end(), r.out.begin() + (t * a.H + h) * a.d);
      r.lse[t * a.H + h] = row.lse;
    }
  return r;
}

struct AttnGrads {
  std::vector<double> dq, dk, dv, dlb;
};

// Analytic float64 gradients of L = Σ out·R (R = dout), written from the chain rule:
// dP_ti = R_t·v_i, D_t = Σ_i P_ti dP_ti, dS = P(dP − D); dq_t = scale Σ_i dS_ti k_i,
// dk_i = scale Σ_t dS_ti q_t, dv_i = Σ_t P_ti R_t, dlogβ_i = Σ_{h in group} Σ_t (t − i) dS_ti.
// With `magnitude`, the same sums of absolute values with dS replaced by P(|dP| + |D|): the
// scale against which a float32 evaluation of these sums can be accurate. (When one key takes
// nearly all of a row's probability, dP − D cancels and the true dq, dk are far below it.)
inline AttnGrads attention_backward(const Attn& a, const std::vector<double>& R, bool magnitude = false) {
  const int64_t T = a.T, H = a.H, K = a.K, d = a.d;
  AttnGrads g{std::vector<double>(static_cast<size_t>(T * H * d)), std::vector<double>(static_cast<size_t>(T * K * d)),
              std::vector<double>(static_cast<size_t>(T * K * d)), std::vector<double>(static_cast<size_t>(T * K))};
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      if (a.doc[t] < 0) continue;
      const AttnRow row = attention_row(a, t, h);
      const int64_t kv = a.kv(h);
      const double* Rt = R.data() + (t * H + h) * d;
      std::vector<double> dP(static_cast<size_t>(t + 1), 0.0);
      double D = 0;
      for (int64_t i = 0; i <= t; ++i) {
        if (!allowed(a.doc, t, i)) continue;
        for (int64_t j = 0; j < d; ++j) dP[i] += Rt[j] * a.v[(i * K + kv) * d + j];
        D += row.p[i] * dP[i];
      }
      for (int64_t i = 0; i <= t; ++i) {
        if (!allowed(a.doc, t, i)) continue;
        const double dS = magnitude ? row.p[i] * (std::abs(dP[i]) + std::abs(D)) : row.p[i] * (dP[i] - D);
        auto m = [magnitude](double x) { return magnitude ? std::abs(x) : x; };
        for (int64_t j = 0; j < d; ++j) {
          g.dq[(t * H + h) * d + j] += a.scale * dS * m(a.k[(i * K + kv) * d + j]);
          g.dk[(i * K + kv) * d + j] += a.scale * dS * m(a.q[(t * H + h) * d + j]);
          g.dv[(i * K + kv) * d + j] += row.p[i] * m(Rt[j]);
        }
        g.dlb[i * K + kv] += static_cast<double>(t - i) * dS;
      }
    }
  return g;
}

inline double attention_loss(const Attn& a, const std::vector<double>& R) {
  const AttnOut o = attention_forward(a);
  double L = 0;
  for (size_t x = 0; x < R.size(); ++x) L += o.out[x] * R[x];
  return L;
}

// Capacity sums in float64: S[l, t, κ] = Σ_{allowed i} exp((t − i)·logβ[l, i, κ]).
inline std::vector<double> capacity_sums(const std::vector<double>& lb, const std::vector<int32_t>& doc, int64_t L,
                                         int64_t K) {
  const int64_t T = static_cast<int64_t>(doc.size());
  std::vector<double> S(static_cast<size_t>(L * T * K), 0.0);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i <= t; ++i)
        if (allowed(doc, t, i))
          for (int64_t k = 0; k < K; ++k)
            S[(l * T + t) * K + k] += t == i ? 1.0 : std::exp(static_cast<double>(t - i) * lb[(l * T + i) * K + k]);
  return S;
}

// Σℓ and #{ℓ > 0} of the capacity hinge, from the formulas of DESIGN §4.
inline ops::CapacityLoss capacity_loss(const std::vector<double>& lb, const std::vector<int32_t>& doc,
                                       const std::vector<int32_t>& pos, int64_t L, int64_t K, double M,
                                       ops::CapacityMode mode) {
  const int64_t T = static_cast<int64_t>(doc.size());
  const std::vector<double> S = capacity_sums(lb, doc, L, K);
  ops::CapacityLoss r;
  auto add = [&](double ell) {
    if (ell > 0) r.sum += ell, ++r.positive;
  };
  for (int64_t t = 0; t < T; ++t) {
    if (doc[t] < 0) continue;
    if (mode == ops::CapacityMode::local) {
      for (int64_t l = 0; l < L; ++l)
        for (int64_t k = 0; k < K; ++k)
          add(std::max(0.0, (S[(l * T + t) * K + k] - M) / std::max(pos[t] - M, 1.0)));
    } else {
      const double N = static_cast<double>(L * K);
      double total = 0;
      for (int64_t l = 0; l < L; ++l)
        for (int64_t k = 0; k < K; ++k) total += S[(l * T + t) * K + k];
      add(std::max(0.0, (total - M * N) / std::max(pos[t] * N - M * N, 1.0)));
    }
  }
  return r;
}

}  // namespace retain::test
