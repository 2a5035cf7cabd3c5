// What the two tests of the CUDA row/elementwise ops share (tests/cuda/test_ops_rows.cpp: the
// kernels' math emulated on the host; tests/cuda/test_ops_cuda.cpp: the kernels on a GPU):
// random inputs, the CPU reference outputs (kernels/ops.h on CPU tensors), and per-element
// error bounds derived from the float32 operations of kernels/cuda/ops_rows.h.
//
// Bounds (u = 2^-24; n = ⌈D/kRowThreads⌉ partial terms per thread, L = log2 kRowThreads tree
// levels; first-order, each then doubled for the test):
//   rmsnorm    Σx² of non-negative terms: ≤ (n+L)u relative; /D, +eps: 2u; sqrt halves it;
//              1/: u/2; the CPU rounds its float64 r to float: u/2; two products each side: 2u.
//              r: ε_r = ((n+L+2)/2 + 1.5)u;  out: (ε_r + 2.5u)·|out|.
//   rmsnorm'   r·(w·dy): (ε_r + 3u)·|r·w·dy|;  c·x with c = r³·dot/D, dot's error ≤ (n+L+2)u·Σ|w·dy·x|
//              (signed terms: relative to the sum of magnitudes): (n+L+2 + 3·ε_r/u + 6)u·|x|·r³·Σ|w·dy·x|/D.
//   rope       cosf/sinf ≤ 2 ulp (CUDA) against the host's: c, s ≤ 6u relative after ·factor;
//              a·c ∓ b·s: 9u·(|a·c| + |b·s|), written 9u·factor·(|a| + |b|).
//   swiglu     expf ≤ 2 ulp (4u) + the host's u; 1+e, /, ·u: ≤ 10u·|out|.
//   swiglu'    dup: 10u·|dout·g·σ|; dgate: σ ≤ 8u, 1−σ ≤ 8u·σ + u absolute, ·g, 1+, ·: ≤
//              20u·|dout·up|·σ·(1 + |g|) (bounded by magnitudes, so a zero of silu' is fine).
//   embedding, add_inplace: exact (the same conversion / the same one float add).
#pragma once
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/base/half.h"
#include "kernels/cuda/ops_rows.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace retain::ops_test {

using Vec = std::vector<float>;
inline constexpr double kU = 1.0 / (1 << 24);

inline Tensor f32(const Vec& v, const Shape& s) { return Tensor::from_vector(v, s); }
inline Tensor i32(const std::vector<int32_t>& v) { return Tensor::from_vector(v, {static_cast<int64_t>(v.size())}); }
inline Vec to_vec(const Tensor& t) {
  const Tensor h = t.on(Device::CPU);
  return Vec(h.data<float>(), h.data<float>() + h.numel());
}

// Values of mixed signs and scales (a row-dependent scale from 1e-3 to 1e3).
inline Vec random_rows(int64_t rows, int64_t D, std::mt19937& rng, bool scaled = true) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> e(-3.0f, 3.0f);
  Vec v(static_cast<size_t>(rows * D));
  for (int64_t r = 0; r < rows; ++r) {
    const float s = scaled ? std::pow(10.0f, e(rng)) : 1.0f;
    for (int64_t j = 0; j < D; ++j) v[r * D + j] = s * n(rng);
  }
  return v;
}

// Elementwise inputs: normal·4 plus the edges of silu (0, ±20, ±100).
inline Vec random_elems(int64_t n, std::mt19937& rng) {
  Vec v = random_rows(1, n, rng, false);
  for (float& x : v) x *= 4.0f;
  const float edges[] = {0.0f, 20.0f, -20.0f, 100.0f, -100.0f};
  for (int64_t i = 0; i < n && i < 5; ++i) v[i * 7 % n] = edges[i];
  return v;
}

// T token ids uniform over [0, V).
inline std::vector<int32_t> random_ids(int64_t V, int64_t T, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(V - 1));
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (auto& i : ids) i = id(rng);
  return ids;
}

// A [V, D] table of `dtype` (values rounded to it), with subnormal, inf and NaN halves in F16.
inline Tensor random_table(int64_t V, int64_t D, DType dtype, std::mt19937& rng) {
  const Vec v = random_rows(V, D, rng);
  if (dtype == DType::F32) return f32(v, {V, D});
  Tensor t = Tensor::empty({V, D}, dtype);
  auto* p = static_cast<uint16_t*>(t.raw());
  for (size_t i = 0; i < v.size(); ++i) p[i] = dtype == DType::BF16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
  if (dtype == DType::F16 && V * D > 2) {  // subnormal, inf and NaN halves too
    p[0] = 0x0001;
    p[1] = 0x7c00;
    p[2] = 0x7e01;
  }
  return t;
}

// Positions with restarts and large values (to 2^17); inv_freq of the default (theta^(−2j/d)) or
// a YaRN-like profile (low frequencies divided by the factor, a ramp between).
inline std::vector<int32_t> random_positions(int64_t T, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> big(0, 131071);
  std::vector<int32_t> p(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) p[t] = (t % 3 == 0) ? big(rng) : static_cast<int32_t>(t);
  return p;
}
inline Vec make_inv_freq(int64_t d, bool yarn) {
  const int64_t half = d / 2;
  Vec f(static_cast<size_t>(half));
  for (int64_t j = 0; j < half; ++j) {
    const double base = std::pow(1.0e6, -2.0 * static_cast<double>(j) / static_cast<double>(d));
    const double ramp = half > 1 ? static_cast<double>(j) / static_cast<double>(half - 1) : 0.0;
    f[j] = static_cast<float>(yarn ? base * (1.0 - ramp) + base / 4.0 * ramp : base);
  }
  return f;
}

// Each got[i] within tol[i] of want[i] (NaN where want is NaN); reports the worst few.
inline void expect_close(const Vec& got, const Vec& want, const std::vector<double>& tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0;
  double worst = 0;
  std::string first;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool ok = std::isnan(want[i]) ? std::isnan(got[i])
                                        : (got[i] == want[i] || std::fabs(double(got[i]) - want[i]) <= tol[i]);
    if (ok) continue;
    const double ratio = std::fabs(double(got[i]) - want[i]) / std::max(tol[i], 1e-300);
    if (bad++ < 3) first += fmt::format(" [{}] got {:.9g} want {:.9g} tol {:.3g};", i, got[i], want[i], tol[i]);
    worst = std::max(worst, ratio);
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " outside the bound (worst "
                    << worst << "× it):" << first;
}

inline double log2_row_threads() { return std::log2(static_cast<double>(cuda::ops_rows::kRowThreads)); }
inline double eps_r(int64_t D) {
  const double n = std::ceil(static_cast<double>(D) / cuda::ops_rows::kRowThreads);
  return ((n + log2_row_threads() + 2) / 2 + 1.5) * kU;
}

inline std::vector<double> rmsnorm_forward_tol(const Vec& want, int64_t D) {
  std::vector<double> t(want.size());
  for (size_t i = 0; i < want.size(); ++i) t[i] = 2 * (eps_r(D) + 2.5 * kU) * std::fabs(want[i]) + 1e-37;
  return t;
}

inline std::vector<double> rmsnorm_backward_tol(const Vec& x, const Vec& w, const Vec& dy, float eps, int64_t D) {
  const int64_t rows = D == 0 ? 0 : static_cast<int64_t>(x.size()) / D;
  const double n = std::ceil(static_cast<double>(D) / cuda::ops_rows::kRowThreads), er = eps_r(D);
  const double e1 = er + 3 * kU, e2 = (n + log2_row_threads() + 2 + 3 * er / kU + 6) * kU;
  std::vector<double> t(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0, sabs = 0;
    for (int64_t j = 0; j < D; ++j) {
      ss += double(x[r * D + j]) * x[r * D + j];
      sabs += std::fabs(double(w[j]) * dy[r * D + j] * x[r * D + j]);
    }
    const double inv = 1.0 / std::sqrt(ss / double(D) + eps);
    for (int64_t j = 0; j < D; ++j) {
      const size_t i = static_cast<size_t>(r * D + j);
      t[i] = 2 * (e1 * std::fabs(inv * w[j] * dy[i]) + e2 * std::fabs(x[i]) * inv * inv * inv * sabs / double(D)) +
             1e-37;
    }
  }
  return t;
}

inline std::vector<double> rope_tol(const Vec& x, int64_t heads, int64_t d, float factor) {
  std::vector<double> t(x.size());
  const int64_t half = d / 2, T = heads * d == 0 ? 0 : static_cast<int64_t>(x.size()) / (heads * d);
  for (int64_t r = 0; r < T * heads; ++r)
    for (int64_t j = 0; j < half; ++j) {
      const double m = 2 * 9 * kU * std::fabs(factor) * (std::fabs(x[r * d + j]) + std::fabs(x[r * d + j + half]));
      t[r * d + j] = t[r * d + j + half] = m + 1e-37;
    }
  return t;
}

inline std::vector<double> swiglu_tol(const Vec& want) {
  std::vector<double> t(want.size());
  for (size_t i = 0; i < want.size(); ++i) t[i] = 2 * 10 * kU * std::fabs(want[i]) + 1e-37;
  return t;
}

inline double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }

inline std::vector<double> swiglu_dgate_tol(const Vec& g, const Vec& u, const Vec& o) {
  std::vector<double> t(g.size());
  for (size_t i = 0; i < g.size(); ++i)
    t[i] = 2 * 20 * kU * std::fabs(double(o[i]) * u[i]) * sigmoid(g[i]) * (1 + std::fabs(g[i])) + 1e-37;
  return t;
}

inline std::vector<double> swiglu_dup_tol(const Vec& g, const Vec& o) {
  std::vector<double> t(g.size());
  for (size_t i = 0; i < g.size(); ++i) t[i] = 2 * 10 * kU * std::fabs(double(o[i]) * g[i]) * sigmoid(g[i]) + 1e-37;
  return t;
}

inline std::vector<double> exact(size_t n) { return std::vector<double>(n, 0.0); }

// The shapes every test visits: odd sizes, one row, a row longer than a block, Qwen3's D.
struct RowShape {
  int64_t rows, D;
};
inline const std::vector<RowShape>& row_shapes() {
  static const std::vector<RowShape> s{{1, 1}, {3, 7}, {5, 128}, {17, 130}, {2, 300}, {4, 2560}, {9, 1000}};
  return s;
}
struct RopeShape {
  int64_t T, heads, d;
};
inline const std::vector<RopeShape>& rope_shapes() {
  static const std::vector<RopeShape> s{{1, 1, 2}, {9, 3, 8}, {70, 2, 64}, {33, 5, 128}};
  return s;
}
inline const std::vector<int64_t>& elem_sizes() {
  static const std::vector<int64_t> s{1, 7, 1000, 70001};
  return s;
}

}  // namespace retain::ops_test
