// The backward ops of kernels/ops.h against independent float64 references written here:
// central finite differences of a float64 forward (rmsnorm, swiglu), the plain matrix
// product (linear), and for rope the adjoint identity ⟨rope(x), y⟩ = ⟨x, rope_backward(y)⟩
// with the float32 forward op itself plus its inverse when the attention factor is 1.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <iterator>
#include <random>
#include <vector>

#include "kernels/ops.h"

using namespace retain;

namespace {

using Vec = std::vector<double>;

// Random F32 tensor and its exact float64 copy.
Tensor randn(const Shape& shape, std::mt19937_64& rng, double std = 1.0, double mean = 0.0) {
  std::normal_distribution<double> n(mean, std);
  Tensor t = Tensor::empty(shape, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(n(rng));
  return t;
}

Vec to64(const Tensor& t) { return Vec(t.data<float>(), t.data<float>() + t.numel()); }

// ‖got − want‖ / ‖want‖.
double rel_err(const Vec& got, const Vec& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) num += (got[i] - want[i]) * (got[i] - want[i]), den += want[i] * want[i];
  return std::sqrt(num / den);
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::fabs(double(a.data<float>()[i]) - b.data<float>()[i]));
  return m;
}

// ---- float64 forwards (from the formulas of DESIGN §3, not from the ops) -----------------
// Σ_r Σ_j R[r,j]·rmsnorm(x)[r,j].
double rmsnorm_loss64(const Vec& x, const Vec& w, const Vec& R, int64_t D, double eps) {
  double loss = 0;
  for (size_t r = 0; r < x.size() / static_cast<size_t>(D); ++r) {
    double ss = 0;
    for (int64_t j = 0; j < D; ++j) ss += x[r * D + j] * x[r * D + j];
    const double inv = 1 / std::sqrt(ss / static_cast<double>(D) + eps);
    for (int64_t j = 0; j < D; ++j) loss += R[r * D + j] * w[j] * x[r * D + j] * inv;
  }
  return loss;
}

double silu64(double x) { return x / (1 + std::exp(-x)); }

}  // namespace

TEST(LinearBackwardInput, MatchesFloat64Product) {
  std::mt19937_64 rng(1);
  for (const auto& [N, out, in] : std::vector<std::array<int64_t, 3>>{{1, 1, 1}, {7, 5, 3}, {33, 70, 19}, {4, 256, 96}}) {
    const Tensor dy = randn({N, out}, rng), w = randn({out, in}, rng);
    Vec want(static_cast<size_t>(N * in), 0.0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < in; ++i)
        for (int64_t o = 0; o < out; ++o)
          want[n * in + i] += double(dy.data<float>()[n * out + o]) * w.data<float>()[o * in + i];
    Tensor dx = randn({N, in}, rng);  // overwritten: the prior contents must not matter
    ops::linear_backward_input(dy, w, dx);
    EXPECT_LT(rel_err(to64(dx), want), 2e-6) << N << " " << out << " " << in;

    // accumulate adds onto what is there.
    const Tensor base = randn({N, in}, rng);
    Tensor acc = base.clone();
    ops::linear_backward_input(dy, w, acc, /*accumulate=*/true);
    Vec want_acc = want;
    for (int64_t i = 0; i < N * in; ++i) want_acc[i] += base.data<float>()[i];
    EXPECT_LT(rel_err(to64(acc), want_acc), 2e-6);
  }
}

TEST(LinearBackwardInput, RejectsBadShapesAndAliasing) {
  std::mt19937_64 rng(2);
  const Tensor dy = randn({4, 5}, rng), w = randn({5, 3}, rng);
  Tensor wrong = Tensor::empty({4, 4}, DType::F32);
  EXPECT_THROW(ops::linear_backward_input(dy, w, wrong), Error);
  Tensor square = randn({4, 4}, rng), w4 = randn({4, 4}, rng);
  EXPECT_THROW(ops::linear_backward_input(square, w4, square), Error);
}

TEST(RmsnormBackward, MatchesCentralDifferencesOfFloat64Forward) {
  std::mt19937_64 rng(3);
  const double eps = 1e-6;
  for (const auto& [rows, D] : std::vector<std::array<int64_t, 2>>{{1, 1}, {3, 8}, {17, 32}, {5, 128}}) {
    // Rows of very different scales, including one far below sqrt(eps) where eps matters.
    Tensor x = randn({rows, D}, rng);
    for (int64_t j = 0; j < D; ++j) x.data<float>()[j] *= 1e-4f;
    if (rows > 1)
      for (int64_t j = 0; j < D; ++j) x.data<float>()[D + j] *= 30.0f;
    const Tensor w = randn({D}, rng, 0.3, 1.0), dy = randn({rows, D}, rng);
    Tensor dx = Tensor::empty({rows, D}, DType::F32);
    ops::rmsnorm_backward(x, w, static_cast<float>(eps), dy, dx);

    const Vec x64 = to64(x), w64 = to64(w), R = to64(dy);
    Vec want(x64.size());
    for (size_t i = 0; i < x64.size(); ++i) {
      // A step relative to the row's scale, so every row is differentiated accurately.
      const size_t r = i / static_cast<size_t>(D);
      double ss = 0;
      for (int64_t j = 0; j < D; ++j) ss += x64[r * D + j] * x64[r * D + j];
      const double h = 1e-5 * std::sqrt(ss / static_cast<double>(D) + eps);
      Vec xp = x64, xm = x64;
      xp[i] += h, xm[i] -= h;
      want[i] = (rmsnorm_loss64(xp, w64, R, D, eps) - rmsnorm_loss64(xm, w64, R, D, eps)) / (2 * h);
    }
    // Row by row: rows of different scale have gradients of very different size.
    const Vec got = to64(dx);
    for (int64_t r = 0; r < rows; ++r) {
      const Vec got_r(got.begin() + r * D, got.begin() + (r + 1) * D);
      const Vec want_r(want.begin() + r * D, want.begin() + (r + 1) * D);
      if (D == 1) {
        // One element: rmsnorm is ±w·x/sqrt(x²+eps), its derivative w·eps/(x²+eps)^1.5 is tiny for |x| ≫ sqrt(eps).
        EXPECT_NEAR(got_r[0], want_r[0], 1e-5 * (std::fabs(want_r[0]) + 1e-3)) << "row " << r;
      } else {
        EXPECT_LT(rel_err(got_r, want_r), 1e-5) << "rows " << rows << " D " << D << " row " << r;
      }
    }

    // dx may alias dy.
    Tensor alias = dy.clone();
    ops::rmsnorm_backward(x, w, static_cast<float>(eps), alias, alias);
    EXPECT_EQ(max_abs_diff(alias, dx), 0.0);

    // accumulate adds into dx bit for bit as add_inplace would; an accumulated dx aliasing dy
    // is refused.
    const Tensor dx0 = randn(x.shape(), rng);
    Tensor acc = dx0.clone(), summed = dx0.clone();
    ops::rmsnorm_backward(x, w, static_cast<float>(eps), dy, acc, /*accumulate=*/true);
    ops::add_inplace(summed, dx);
    EXPECT_EQ(std::memcmp(acc.raw(), summed.raw(), acc.nbytes()), 0) << "rows " << rows << " D " << D;
    EXPECT_THROW(ops::rmsnorm_backward(x, w, static_cast<float>(eps), alias, alias, true), Error);
  }
}

TEST(RmsnormBackward, PerHeadLayoutIsRowWise) {
  // [T, H, d] with w [d], as Qwen3's q_norm is applied: the same as [T·H, d].
  std::mt19937_64 rng(4);
  const Tensor x = randn({5, 3, 8}, rng), w = randn({8}, rng, 0.2, 1.0), dy = randn({5, 3, 8}, rng);
  Tensor a = Tensor::empty({5, 3, 8}, DType::F32), b = Tensor::empty({15, 8}, DType::F32);
  ops::rmsnorm_backward(x, w, 1e-6f, dy, a);
  ops::rmsnorm_backward(x.reshape({15, 8}), w, 1e-6f, dy.reshape({15, 8}), b);
  EXPECT_EQ(max_abs_diff(a.reshape({15, 8}), b), 0.0);
  Tensor bad = Tensor::empty({5, 3, 7}, DType::F32);
  EXPECT_THROW(ops::rmsnorm_backward(x, w, 1e-6f, dy, bad), Error);
}

TEST(RopeBackward, IsTheAdjointOfRope) {
  std::mt19937_64 rng(5);
  for (const float factor : {1.0f, 1.1386f, 0.7f}) {
    const int64_t T = 37, heads = 3, d = 16;
    std::vector<int32_t> pos(T);
    std::uniform_int_distribution<int32_t> p(0, 40000);  // long-context angles
    for (int32_t& v : pos) v = p(rng);
    const Tensor positions = Tensor::from_vector(pos, {T});
    std::vector<float> f(d / 2);
    for (int64_t j = 0; j < d / 2; ++j) f[j] = static_cast<float>(std::pow(1e6, -2.0 * j / d));
    const Tensor inv_freq = Tensor::from_vector(f, {d / 2});

    const Tensor x = randn({T, heads, d}, rng), y = randn({T, heads, d}, rng);
    Tensor rx = x.clone(), ry = y.clone();
    ops::rope(rx, positions, inv_freq, factor);
    ops::rope_backward(ry, positions, inv_freq, factor);
    double lhs = 0, rhs = 0, norm = 0;
    for (int64_t i = 0; i < x.numel(); ++i) {
      lhs += double(rx.data<float>()[i]) * y.data<float>()[i];
      rhs += double(x.data<float>()[i]) * ry.data<float>()[i];
      norm += std::fabs(double(x.data<float>()[i]) * y.data<float>()[i]);
    }
    EXPECT_NEAR(lhs, rhs, 1e-6 * norm * factor * factor) << "factor " << factor;

    // Element by element against the transposed rotation in float64 (same float32 angle).
    double worst = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < d / 2; ++j) {
        const float angle = static_cast<float>(pos[t]) * f[j];
        const double c = double(std::cos(angle)) * factor, s = double(std::sin(angle)) * factor;
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t o = (t * heads + h) * d;
          const double a = y.data<float>()[o + j], b = y.data<float>()[o + j + d / 2];
          worst = std::max(worst, std::fabs(ry.data<float>()[o + j] - (a * c + b * s)));
          worst = std::max(worst, std::fabs(ry.data<float>()[o + j + d / 2] - (b * c - a * s)));
        }
      }
    EXPECT_LT(worst, 1e-5);

    // With factor 1 the rotation is orthogonal: the backward undoes the forward.
    if (factor == 1.0f) {
      Tensor back = rx.clone();
      ops::rope_backward(back, positions, inv_freq, factor);
      EXPECT_LT(max_abs_diff(back, x), 1e-5);
    }
  }
}

TEST(SwigluBackward, MatchesCentralDifferencesOfFloat64Forward) {
  std::mt19937_64 rng(6);
  const int64_t n = 300;
  Tensor gate = randn({3, n / 3}, rng, 3.0), up = randn({3, n / 3}, rng), dout = randn({3, n / 3}, rng);
  // Saturated gates, where a naive σ would overflow or lose 1 − σ.
  const float extremes[] = {-120.f, -90.f, -40.f, -17.f, 0.f, 17.f, 40.f, 90.f, 120.f};
  for (size_t i = 0; i < std::size(extremes); ++i) gate.data<float>()[i] = extremes[i];
  Tensor dg = Tensor::empty(gate.shape(), DType::F32), du = Tensor::empty(gate.shape(), DType::F32);
  ops::swiglu_backward(gate, up, dout, dg, du);
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate.data<float>()[i], u = up.data<float>()[i], o = dout.data<float>()[i];
    const double h = 1e-5 * std::max(1.0, std::fabs(g));
    const double want_g = o * u * (silu64(g + h) - silu64(g - h)) / (2 * h);
    const double want_u = o * silu64(g);
    // silu'(g) = σ(1 + g(1 − σ)) cancels near its root g ≈ −1.28: float32 gets it to ~1e-7
    // absolute (times |dout·up|), not relative.
    EXPECT_NEAR(dg.data<float>()[i], want_g, 1e-5 * std::fabs(want_g) + 1e-6 * std::fabs(o * u)) << "gate " << g;
    EXPECT_NEAR(du.data<float>()[i], want_u, 1e-6 * (std::fabs(want_u) + 1e-6)) << "gate " << g;
    EXPECT_TRUE(std::isfinite(dg.data<float>()[i]) && std::isfinite(du.data<float>()[i]));
  }

  // The documented aliasing: outputs over the inputs (in the two ways the student uses).
  Tensor g1 = gate.clone(), u1 = up.clone();
  ops::swiglu_backward(g1, u1, dout, g1, u1);
  EXPECT_EQ(max_abs_diff(g1, dg), 0.0);
  EXPECT_EQ(max_abs_diff(u1, du), 0.0);
  Tensor o2 = dout.clone(), u2 = up.clone();
  ops::swiglu_backward(gate, u2, o2, o2, u2);
  EXPECT_EQ(max_abs_diff(o2, dg), 0.0);
  EXPECT_EQ(max_abs_diff(u2, du), 0.0);
  EXPECT_THROW(ops::swiglu_backward(gate, up, dout, dg, dg), Error);
}
