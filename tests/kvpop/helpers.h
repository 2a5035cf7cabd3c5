// Random inputs and float32 ↔ float64 conversions shared by tests/kvpop/*.
#pragma once
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/kvpop.h"
#include "kernels/tensor.h"
#include "tests/kvpop/reference.h"

namespace retain::kvpop_test {

// float32 draws kept as float64, so op and reference see the same numbers.
inline Vec randn(int64_t n, std::mt19937& rng, double std = 1.0, double mean = 0.0) {
  std::normal_distribution<float> dist(static_cast<float>(mean), static_cast<float>(std));
  Vec v(static_cast<size_t>(n));
  for (double& x : v) x = dist(rng);
  return v;
}

inline Tensor f32(const Vec& v, const Shape& shape) {
  std::vector<float> f(v.begin(), v.end());
  return Tensor::from_vector<float>(f, shape);
}
inline Tensor f32(double x) { return f32(Vec{x}, {1}); }

inline Vec to_vec(const Tensor& t) {
  const float* p = t.data<float>();
  return Vec(p, p + t.numel());
}

inline double rel_err(const Vec& got, const Vec& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Random parameters with gates spread over both branches of the stabilizer's max (ĩ around
// −2 ± 3, log f mostly near 0 as b_f = 3 makes it, sometimes far below).
inline RefParams random_params(int64_t r, std::mt19937& rng) {
  RefParams p;
  p.r = r;
  p.n = 4 * r;
  p.W_q = randn(r * p.n, rng, 0.3);
  p.W_k = randn(r * p.n, rng, 0.3);
  p.W_v = randn(r * p.n, rng, 0.3);
  p.w_i = randn(p.n, rng, 0.6);
  p.w_f = randn(p.n, rng, 0.6);
  p.b_i = randn(1, rng, 0.5, -2.0)[0];
  p.b_f = randn(1, rng, 0.5, 3.0)[0];
  p.w_o = randn(r, rng, 0.5);
  p.b_o = randn(1, rng, 0.5)[0];
  p.theta = randn(1, rng, 1.0)[0];
  return p;
}

inline kvpop::HeadParams to_head(const RefParams& p) {
  const int64_t r = p.r, n = p.n;
  return {f32(p.W_q, {r, n}), f32(p.W_k, {r, n}), f32(p.W_v, {r, n}), f32(p.w_i, {n}), f32(p.w_f, {n}),
          f32(p.b_i),         f32(p.b_f),         f32(p.w_o, {r}),    f32(p.b_o),       f32(p.theta)};
}

// Contiguous documents of random lengths (1..max_len) with padding runs (−1) between some.
inline std::vector<int32_t> packed_docs(int64_t T, std::mt19937& rng, int64_t max_len) {
  std::vector<int32_t> doc;
  int32_t id = 0;
  std::uniform_int_distribution<int64_t> len(1, max_len);
  std::bernoulli_distribution pad(0.15);
  while (static_cast<int64_t>(doc.size()) < T) {
    const int32_t value = pad(rng) ? -1 : id++;
    for (int64_t n = len(rng); n > 0 && static_cast<int64_t>(doc.size()) < T; --n) doc.push_back(value);
  }
  return doc;
}

inline Tensor i32(const std::vector<int32_t>& v) {
  return Tensor::from_vector<int32_t>(v, {static_cast<int64_t>(v.size())});
}

}  // namespace retain::kvpop_test
