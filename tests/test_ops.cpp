// Each CPU op against a naive float64 computation written out from its definition.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/base/half.h"
#include "kernels/ops.h"

using namespace retain;

namespace {

Tensor randn(const Shape& shape, std::mt19937& rng, float std = 1.0f) {
  Tensor t = Tensor::empty(shape, DType::F32);
  std::normal_distribution<float> n(0.0f, std);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = n(rng);
  return t;
}

Tensor ints(const std::vector<int32_t>& v) { return Tensor::from_vector<int32_t>(v, {static_cast<int64_t>(v.size())}); }

// ‖got − want‖ / ‖want‖ with the reference in float64.
double rel_err(const Tensor& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = got.data<float>()[i] - want[i];
    num += d * d;
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace

TEST(Ops, EmbeddingReadsF32AndBF16TablesAndRejectsBadIds) {
  std::mt19937 rng(1);
  Tensor table = randn({10, 6}, rng);
  Tensor ids = ints({3, 0, 9, 3});
  Tensor out = Tensor::empty({4, 6}, DType::F32);
  ops::embedding(table, ids, out);
  for (int t = 0; t < 4; ++t)
    for (int j = 0; j < 6; ++j)
      EXPECT_EQ(out.data<float>()[t * 6 + j], table.data<float>()[ids.data<int32_t>()[t] * 6 + j]);

  Tensor bf = table.to_dtype(DType::BF16);
  ops::embedding(bf, ids, out);
  for (int t = 0; t < 4; ++t)
    for (int j = 0; j < 6; ++j)
      EXPECT_EQ(out.data<float>()[t * 6 + j],
                bf16_to_f32(static_cast<const uint16_t*>(bf.raw())[ids.data<int32_t>()[t] * 6 + j]));

  Tensor bad = ints({3, 10});
  Tensor out2 = Tensor::empty({2, 6}, DType::F32);
  EXPECT_THROW(ops::embedding(table, bad, out2), Error);
  EXPECT_THROW(ops::embedding(table, ints({-1, 0}), out2), Error);
}

TEST(Ops, LinearMatchesFloat64) {
  std::mt19937 rng(2);
  for (auto [N, in, out] : {std::tuple{7, 13, 5}, std::tuple{1, 64, 96}, std::tuple{33, 3, 1}}) {
    Tensor x = randn({N, in}, rng), w = randn({out, in}, rng), y = Tensor::empty({N, out}, DType::F32);
    ops::linear(x, w, y);
    std::vector<double> want(static_cast<size_t>(N * out));
    for (int n = 0; n < N; ++n)
      for (int o = 0; o < out; ++o) {
        double s = 0;
        for (int i = 0; i < in; ++i) s += double(x.data<float>()[n * in + i]) * w.data<float>()[o * in + i];
        want[n * out + o] = s;
      }
    EXPECT_LT(rel_err(y, want), 1e-6) << N << "x" << in << "x" << out;
  }
  Tensor x = randn({2, 3}, rng), w = randn({4, 5}, rng), y = Tensor::empty({2, 4}, DType::F32);
  EXPECT_THROW(ops::linear(x, w, y), Error);
}

TEST(Ops, RmsNormMatchesFloat64IncludingPerHeadUse) {
  std::mt19937 rng(3);
  const float eps = 1e-6f;
  for (auto [rows, D] : {std::pair{5, 64}, std::pair{12 * 4, 32}}) {  // second: [T·H, head_dim]
    Tensor x = randn({rows, D}, rng, 3.0f), w = randn({D}, rng), out = Tensor::empty({rows, D}, DType::F32);
    ops::rmsnorm(x, w, eps, out);
    std::vector<double> want(static_cast<size_t>(rows * D));
    for (int r = 0; r < rows; ++r) {
      double ss = 0;
      for (int j = 0; j < D; ++j) ss += double(x.data<float>()[r * D + j]) * x.data<float>()[r * D + j];
      const double inv = 1.0 / std::sqrt(ss / D + eps);
      for (int j = 0; j < D; ++j) want[r * D + j] = double(w.data<float>()[j]) * x.data<float>()[r * D + j] * inv;
    }
    EXPECT_LT(rel_err(out, want), 1e-6);
    ops::rmsnorm(x, w, eps, x);  // in place gives the same
    EXPECT_LT(rel_err(x, want), 1e-6);
  }
}

TEST(Ops, RopeRotatesHalvesByPositionTimesFrequency) {
  std::mt19937 rng(4);
  const int T = 9, heads = 3, d = 8;
  Tensor x = randn({T, heads, d}, rng), orig = x.clone();
  Tensor pos = ints({0, 1, 2, 0, 1, 5, 100, 7, 3});
  Tensor inv = Tensor::from_vector<float>({1.0f, 0.1f, 0.01f, 0.001f}, {4});
  const float af = 1.25f;
  ops::rope(x, pos, inv, af);
  std::vector<double> want(static_cast<size_t>(T * heads * d));
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < heads; ++h)
      for (int j = 0; j < d / 2; ++j) {
        const double a = double(pos.data<int32_t>()[t]) * inv.data<float>()[j];
        const float* o = orig.data<float>() + (t * heads + h) * d;
        const size_t base = static_cast<size_t>((t * heads + h) * d);
        want[base + j] = af * (o[j] * std::cos(a) - o[j + d / 2] * std::sin(a));
        want[base + j + d / 2] = af * (o[j + d / 2] * std::cos(a) + o[j] * std::sin(a));
      }
  EXPECT_LT(rel_err(x, want), 1e-6);
  // Position 0 with attention factor 1 is the identity.
  Tensor y = orig.rows(0, 1).clone();
  ops::rope(y, ints({0}), inv, 1.0f);
  for (int i = 0; i < heads * d; ++i) EXPECT_EQ(y.data<float>()[i], orig.data<float>()[i]);
}

TEST(Ops, SwiGluAndAdd) {
  std::mt19937 rng(5);
  Tensor g = randn({4, 7}, rng, 4.0f), u = randn({4, 7}, rng), out = Tensor::empty({4, 7}, DType::F32);
  ops::swiglu(g, u, out);
  std::vector<double> want(28);
  for (int i = 0; i < 28; ++i) {
    const double a = g.data<float>()[i];
    want[i] = a / (1 + std::exp(-a)) * u.data<float>()[i];
  }
  EXPECT_LT(rel_err(out, want), 1e-6);
  Tensor s = g.clone();
  ops::add_inplace(s, u);
  for (int i = 0; i < 28; ++i) EXPECT_EQ(s.data<float>()[i], g.data<float>()[i] + u.data<float>()[i]);
}

// The ring sums' helpers: F64 add, fill, and F64 → F32 scaled (rounded once, as float(scale·x)).
TEST(Ops, F64AddFillAndScaleToF32) {
  Tensor a = Tensor::from_vector<double>({1.0, 0.1, -2.5, 1e300}, {2, 2});
  const Tensor b = Tensor::from_vector<double>({0.25, 0.2, 2.5, 1e300}, {2, 2});
  ops::add_inplace(a, b);
  EXPECT_EQ(a.data<double>()[0], 1.25);
  EXPECT_EQ(a.data<double>()[1], 0.1 + 0.2);  // the F64 sum, not a float one
  EXPECT_EQ(a.data<double>()[2], 0.0);
  EXPECT_EQ(a.data<double>()[3], 2e300);
  Tensor f = Tensor::empty({4}, DType::F32);
  ops::scale_to_f32(a, 0.5, f);
  EXPECT_EQ(f.data<float>()[0], 0.625f);
  EXPECT_EQ(f.data<float>()[1], static_cast<float>(0.5 * (0.1 + 0.2)));
  EXPECT_EQ(f.data<float>()[3], INFINITY);  // beyond float's range
  ops::fill(f, -INFINITY);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(f.data<float>()[i], -INFINITY);
  ops::fill(a, 0.1);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(a.data<double>()[i], 0.1);
  Tensor i32 = Tensor::zeros({2}, DType::I32);
  EXPECT_THROW(ops::fill(i32, 1.0), Error);
  EXPECT_THROW(ops::add_inplace(a, Tensor::zeros({2, 2}, DType::F32)), Error);
  EXPECT_THROW(ops::scale_to_f32(f, 1.0, f), Error);
}

// [a ‖ b] row by row, and its backward adding each part of the joined gradient into its own
// gradient; shapes with empty parts and rows; errors for wrong shapes and aliasing.
TEST(Ops, ConcatColumnsAndSplitColumnsAdd) {
  std::mt19937 rng(9);
  for (auto [T, A, B] : {std::tuple{5, 3, 4}, std::tuple{1, 1, 1}, std::tuple{0, 2, 3}, std::tuple{4, 0, 2}}) {
    const Tensor a = randn({T, A}, rng), b = randn({T, B}, rng);
    Tensor out = Tensor::empty({T, A + B}, DType::F32);
    ops::concat_columns(a, b, out);
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < A + B; ++j)
        EXPECT_EQ(out.data<float>()[t * (A + B) + j], j < A ? a.data<float>()[t * A + j] : b.data<float>()[t * B + j - A]);
    const Tensor g = randn({T, A + B}, rng);
    Tensor da = a.clone(), db = b.clone();
    ops::split_columns_add(g, da, db);
    for (int t = 0; t < T; ++t) {
      for (int j = 0; j < A; ++j)
        EXPECT_EQ(da.data<float>()[t * A + j], a.data<float>()[t * A + j] + g.data<float>()[t * (A + B) + j]);
      for (int j = 0; j < B; ++j)
        EXPECT_EQ(db.data<float>()[t * B + j], b.data<float>()[t * B + j] + g.data<float>()[t * (A + B) + A + j]);
    }
  }
  Tensor a = randn({3, 2}, rng), b = randn({3, 2}, rng), wrong = Tensor::empty({3, 5}, DType::F32);
  EXPECT_THROW(ops::concat_columns(a, b, wrong), Error);
  EXPECT_THROW(ops::concat_columns(a, randn({2, 2}, rng), wrong), Error);
  Tensor joined = Tensor::empty({3, 4}, DType::F32), part = joined.reshape({6, 2}).rows(0, 3);
  EXPECT_THROW(ops::concat_columns(part, b, joined), Error);  // a part inside the joined buffer
}

TEST(Ops, DocumentPositionsRestartPerDocument) {
  Tensor p = ops::document_positions(ints({0, 0, 0, 1, 2, 2, -1, -1, 5}));
  const std::vector<int32_t> want = {0, 1, 2, 0, 0, 1, 0, 0, 0};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(p.data<int32_t>()[i], want[i]) << i;
}

// Attention against the full T×T float64 computation, for GQA groups 1, 2, 4, several
// documents and padding.
TEST(Ops, AttentionMatchesNaiveFloat64WithDocumentsAndGqa) {
  std::mt19937 rng(6);
  for (int group : {1, 2, 4}) {
    const int T = 23, K = 2, H = K * group, d = 16;
    Tensor q = randn({T, H, d}, rng), k = randn({T, K, d}, rng), v = randn({T, K, d}, rng);
    std::vector<int32_t> docv(T);
    for (int t = 0; t < T; ++t) docv[t] = t < 9 ? 0 : t < 10 ? 1 : t < 20 ? 2 : -1;  // 1-token doc, padding tail
    Tensor doc = ints(docv), out = Tensor::empty({T, H, d}, DType::F32);
    const float scale = 1.0f / std::sqrt(float(d));
    ops::attention(q, k, v, doc, scale, out);

    std::vector<double> want(static_cast<size_t>(T * H * d), 0.0);
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h) {
        if (docv[t] < 0) continue;
        const int kv = h / group;
        std::vector<double> s(T, -INFINITY);
        double mx = -INFINITY;
        for (int i = 0; i <= t; ++i) {
          if (docv[i] != docv[t]) continue;
          double dot = 0;
          for (int j = 0; j < d; ++j) dot += double(q.data<float>()[(t * H + h) * d + j]) * k.data<float>()[(i * K + kv) * d + j];
          s[i] = dot * scale;
          mx = std::max(mx, s[i]);
        }
        double z = 0;
        for (int i = 0; i <= t; ++i) z += std::isinf(s[i]) ? 0 : std::exp(s[i] - mx);
        for (int i = 0; i <= t; ++i) {
          if (std::isinf(s[i])) continue;
          const double p = std::exp(s[i] - mx) / z;
          for (int j = 0; j < d; ++j) want[(t * H + h) * d + j] += p * v.data<float>()[(i * K + kv) * d + j];
        }
      }
    EXPECT_LT(rel_err(out, want), 1e-6) << "group " << group;
    // Token 9 is a one-token document: its output is exactly its own value row.
    for (int j = 0; j < d; ++j) EXPECT_FLOAT_EQ(out.data<float>()[(9 * H) * d + j], v.data<float>()[(9 * K) * d + j]);
    // Padding rows are zero.
    for (int j = 0; j < H * d; ++j) EXPECT_EQ(out.data<float>()[22 * H * d + j], 0.0f);
  }
}

TEST(Ops, ShapeMismatchesAreErrors) {
  std::mt19937 rng(7);
  Tensor q = randn({4, 3, 8}, rng), k = randn({4, 2, 8}, rng), out = Tensor::empty({4, 3, 8}, DType::F32);
  EXPECT_THROW(ops::attention(q, k, k, ints({0, 0, 0, 0}), 1.0f, out), Error);  // 3 heads, 2 kv heads
  Tensor x = randn({4, 8}, rng), w = randn({7}, rng);
  EXPECT_THROW(ops::rmsnorm(x, w, 1e-6f, x), Error);
}
