// What the KVPOP CUDA tests share (tests/cuda/test_kvpop_tiles.cpp: the kernels' tile code
// emulated on the host; tests/cuda/test_kvpop_cuda.cpp: the kernels on a GPU): random inputs
// and the comparisons against the CPU references, with their tolerances.
//
// Target: log m per key within a bound derived from the float32 arithmetic of the kernel
// (kernels/cuda/kvpop_tiles.h "Accuracy"), computed per key from the inputs themselves:
//   |Δ| ≤ max over the key's pairs (γ_hd·scale·Σ_x|q_x k_x|) + 3u·max|s| + 4u + γ_63 + 2u·|log m|
// (dot products; the roundings of s and of s − tile max; expf ≤ 2 ulp; a 64-term float32 sum;
// both sides' float32 output rounding), u = 2^-24, γ_n = n·u/(1 − n·u); −inf exactly where
// the reference has no target.
// mLSTM: both sides evaluate the same float64 formulas (kernels/cpu/kvpop_mlstm.cpp), only in
// different association orders (chunk terms then the chain, fused multiply-adds), which moves
// values by ~1e-15 of the magnitudes involved; each side then rounds to float32 (≤ ½ ulp), so
// outputs lie ≤ 1 ulp apart. Tolerance per element: 2 ulp (2^-22·|want|) + 1e-10·scale, for the
// float64 differences where a sum cancels to far below its terms (dĩ and d log f of a token
// whose score does not depend on them are O(1) terms cancelling to ~1e-17); scale = the
// largest |value| of the score for the score, of all the gradients for a gradient (they are
// all sums of products of the same per-readout factors, so their terms are of that size).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "kernels/kvpop.h"
#include "kernels/retention.h"
#include "kernels/tensor.h"
#include "tests/kvpop/helpers.h"

namespace retain::kvpop_cuda_test {

using kvpop_test::f32;
using kvpop_test::i32;
using kvpop_test::randn;
using kvpop_test::to_vec;
using kvpop_test::Vec;

inline constexpr double kU = 1.0 / (1 << 24);  // float32 unit roundoff
inline double gamma(int64_t n) { return static_cast<double>(n) * kU / (1 - static_cast<double>(n) * kU); }

// Random documents (kvpop_test::packed_docs) redrawn until one non-padding run is longer than
// w, so that the case has targets and readouts (a draw can be all padding), when T allows it.
inline std::vector<int32_t> docs_longer_than(int64_t T, std::mt19937& rng, int64_t max_doc, int64_t w) {
  std::vector<int32_t> doc;
  for (int attempt = 0; attempt < 1000; ++attempt) {
    doc = kvpop_test::packed_docs(T, rng, max_doc);
    for (int64_t t = 0, run = 0; t < T; ++t) {
      run = doc[t] >= 0 && t > 0 && doc[t] == doc[t - 1] ? run + 1 : 1;
      if (doc[t] >= 0 && run > w) return doc;
    }
  }
  return doc;  // T ≤ w, or max_doc ≤ w: no such run exists
}

// ---- target -------------------------------------------------------------------------------
struct TargetCase {
  int64_t T, H, K, hd, w, max_doc;
};
inline void PrintTo(const TargetCase& c, std::ostream* os) {
  *os << "T=" << c.T << " H=" << c.H << " K=" << c.K << " hd=" << c.hd << " w=" << c.w << " max_doc=" << c.max_doc;
}

struct TargetInputs {
  TargetCase c;
  std::vector<int32_t> doc;
  Vec q, k;      // [T, H, hd], [T, K, hd] (float32 values)
  Tensor lse;    // F32 [T, H], the dense causal attention's (CPU op, logβ ≡ 0)
  float scale;
};

inline TargetInputs make_target_inputs(const TargetCase& c, std::mt19937& rng) {
  TargetInputs in{c, docs_longer_than(c.T, rng, c.max_doc, c.w), randn(c.T * c.H * c.hd, rng, 0.8),
                  randn(c.T * c.K * c.hd, rng, 0.8), Tensor(), 1.0f / std::sqrt(static_cast<float>(c.hd))};
  Tensor out = Tensor::empty({c.T, c.H, c.hd}, DType::F32);
  in.lse = Tensor::empty({c.T, c.H}, DType::F32);
  ops::gated_attention(f32(in.q, {c.T, c.H, c.hd}), f32(in.k, {c.T, c.K, c.hd}), f32(randn(c.T * c.K * c.hd, rng), {c.T, c.K, c.hd}),
                       Tensor::zeros({c.T, c.K}, DType::F32), i32(in.doc), in.scale, out, in.lse);
  return in;
}

// The per-(κ, t) bound of the header comment, for reference values want [K, T].
inline Vec target_bound(const TargetInputs& in, const Vec& want) {
  const TargetCase& c = in.c;
  const int64_t G = c.H / c.K;
  const float* lse = in.lse.data<float>();
  Vec bound(static_cast<size_t>(c.K * c.T), 0.0);
  for (int64_t kv = 0; kv < c.K; ++kv)
    for (int64_t t = 0; t < c.T; ++t) {
      if (in.doc[t] < 0) continue;
      double dot_err = 0, s_max = 0;
      for (int64_t d = t + c.w; d < c.T && in.doc[d] == in.doc[t]; ++d)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = kv * G + g;
          double dot = 0, abs_sum = 0;
          for (int64_t x = 0; x < c.hd; ++x) {
            const double p = in.q[(d * c.H + h) * c.hd + x] * in.k[(t * c.K + kv) * c.hd + x];
            dot += p;
            abs_sum += std::abs(p);
          }
          dot_err = std::max(dot_err, gamma(c.hd) * in.scale * abs_sum);
          s_max = std::max(s_max, std::abs(dot * in.scale - lse[d * c.H + h]));
        }
      const double w = want[kv * c.T + t];
      bound[kv * c.T + t] = dot_err + 3 * kU * s_max + 4 * kU + gamma(63) + 2 * kU * (std::isfinite(w) ? std::abs(w) : 0.0);
    }
  return bound;
}

// got vs want [K, T]: −inf exactly where want is; elsewhere within the bound. Prints the worst
// error as a fraction of its bound.
inline void expect_target_close(const TargetInputs& in, const Vec& got, const Vec& want, const char* what) {
  const Vec bound = target_bound(in, want);
  double worst = 0, worst_abs = 0;
  int64_t finite = 0, failures = 0;
  for (size_t x = 0; x < want.size(); ++x) {
    if (std::isinf(want[x])) {
      if (got[x] != want[x] && failures++ < 5) ADD_FAILURE() << what << ": log_m[" << x << "] = " << got[x] << ", want −inf";
      continue;
    }
    ++finite;
    const double err = std::abs(got[x] - want[x]);
    worst = std::max(worst, err / bound[x]);
    worst_abs = std::max(worst_abs, err);
    if (!(err <= bound[x]) && failures++ < 5)
      ADD_FAILURE() << what << ": log_m[" << x / in.c.T << ", " << x % in.c.T << "] = " << got[x] << ", want " << want[x]
                    << " (|Δ| " << err << " > bound " << bound[x] << ")";
  }
  EXPECT_EQ(failures, 0) << what;
  std::printf("%s: %ld targets, max |Δ log m| %.3g, at most %.3f of the bound\n", what, static_cast<long>(finite),
              worst_abs, worst);
}

// ---- mLSTM --------------------------------------------------------------------------------
struct MlstmCase {
  int64_t T, r, w, max_doc;
  bool extreme;  // gates at the ends of the soft cap, long stretches without forgetting
};
inline void PrintTo(const MlstmCase& c, std::ostream* os) {
  *os << "T=" << c.T << " r=" << c.r << " w=" << c.w << " max_doc=" << c.max_doc << (c.extreme ? " extreme" : "");
}

struct MlstmInputs {
  kvpop::Projected P;  // CPU
  std::vector<int32_t> doc;
  Tensor w_o, b_o, dscore;
};

// Hedgehog-like features (two softmaxes of r), as kvpop::project makes them.
inline Vec hedgehog(int64_t T, int64_t r, std::mt19937& rng, double spread) {
  const Vec z = randn(T * 2 * r, rng, spread);
  Vec out(z.size());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t o = t * 2 * r + half * r;
      double sum = 0;
      for (int64_t j = 0; j < r; ++j) sum += std::exp(z[o + j]);
      for (int64_t j = 0; j < r; ++j) out[o + j] = static_cast<float>(std::exp(z[o + j]) / sum);
    }
  return out;
}

inline MlstmInputs make_mlstm_inputs(const MlstmCase& c, std::mt19937& rng) {
  MlstmInputs in;
  const int64_t T = c.T, r = c.r, d = 2 * r;
  in.doc = docs_longer_than(T, rng, c.max_doc, c.w);
  if (!c.extreme) {  // the scorer's own projections of random inputs
    const kvpop_test::RefParams p = kvpop_test::random_params(r, rng);
    in.P = kvpop::project(f32(randn(T * 4 * r, rng), {T, 4 * r}), kvpop_test::to_head(p));
  } else {
    std::uniform_real_distribution<float> u(-15.0f, 15.0f);
    Vec ig(T), lf(T);
    for (int64_t t = 0; t < T; ++t) {
      ig[t] = u(rng);
      const double ft = (t / 100) % 2 ? u(rng) : 15.0 - 2.0 * std::abs(u(rng)) / 15.0;
      lf[t] = static_cast<float>(kvpop_test::log_sigmoid(ft));
    }
    in.P = {f32(hedgehog(T, r, rng, 2.0), {T, d}), f32(hedgehog(T, r, rng, 2.0), {T, d}), f32(randn(T * r, rng), {T, r}),
            f32(ig, {T}), f32(lf, {T})};
  }
  in.w_o = f32(randn(r, rng, 0.5), {r});
  in.b_o = f32(randn(1, rng, 0.5), {1});
  in.dscore = f32(randn(T, rng), {T});
  return in;
}

// Element-wise: |got − want| ≤ 2^-22·|want| + 1e-10·scale (header comment). Prints the worst
// error as a fraction of its tolerance, and in float32 ulps of the reference over the values
// that are not cancellation noise (|want| ≥ 1e-6·scale).
inline void expect_mlstm_close(const char* what, const Vec& got, const Vec& want, double scale) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst_ulps = 0, worst_fraction = 0;
  int failures = 0;
  for (size_t x = 0; x < want.size(); ++x) {
    const double err = std::abs(got[x] - want[x]);
    const double tol = std::ldexp(std::abs(want[x]), -22) + 1e-10 * scale;
    worst_fraction = std::max(worst_fraction, tol > 0 ? err / tol : (err > 0 ? INFINITY : 0.0));
    if (std::abs(want[x]) >= 1e-6 * scale && want[x] != 0)
      worst_ulps = std::max(worst_ulps, err / std::ldexp(std::abs(want[x]), -23));
    if (!(err <= tol) && failures++ < 5)
      ADD_FAILURE() << what << "[" << x << "] = " << got[x] << ", want " << want[x] << " (|Δ| " << err << " > " << tol << ")";
  }
  EXPECT_EQ(failures, 0) << what;
  std::printf("  %-8s %6zu values: worst %.2f ulp, %.3f of the tolerance\n", what, want.size(), worst_ulps, worst_fraction);
}

inline Vec host_vec(const Tensor& t) { return to_vec(t.on(Device::CPU)); }

// Forward and backward of one case against the CPU reference, by `run`: a callable
// (MlstmInputs) -> {score, dP, dw_o, db_o} evaluated the way under test.
struct MlstmResult {
  Tensor score;
  kvpop::Projected dP;
  Tensor dw_o, db_o;
};
inline MlstmResult reference_mlstm(const MlstmInputs& in, int64_t w) {
  MlstmResult r;
  r.score = kvpop::mlstm_scores(in.P, i32(in.doc), w, in.w_o, in.b_o);
  r.dP = kvpop::mlstm_scores_backward(in.P, i32(in.doc), w, in.w_o, in.b_o, in.dscore, r.dw_o, r.db_o);
  return r;
}
inline double max_abs(const Vec& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}
inline void expect_mlstm_result(const MlstmResult& got, const MlstmResult& want) {
  const Vec score = host_vec(want.score);
  expect_mlstm_close("score", host_vec(got.score), score, max_abs(score));
  const std::pair<const char*, const Tensor*> grads[] = {
      {"dq", &want.dP.q},         {"dk", &want.dP.k},   {"dv", &want.dP.v},   {"digate", &want.dP.igate},
      {"dlog_f", &want.dP.log_f}, {"dw_o", &want.dw_o}, {"db_o", &want.db_o}};
  const Tensor* got_grads[] = {&got.dP.q, &got.dP.k, &got.dP.v, &got.dP.igate, &got.dP.log_f, &got.dw_o, &got.db_o};
  double scale = 0;
  for (const auto& g : grads) scale = std::max(scale, max_abs(host_vec(*g.second)));
  for (size_t i = 0; i < std::size(grads); ++i)
    expect_mlstm_close(grads[i].first, host_vec(*got_grads[i]), host_vec(*grads[i].second), scale);
}

}  // namespace retain::kvpop_cuda_test
