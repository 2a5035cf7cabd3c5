// KVPOP targets, boundary selection and pairwise loss (kernels/kvpop.h, c. and d.): the
// transposed target pass against a dense float64 T×T computation (tests/kvpop/reference.h) fed
// by the existing ops::gated_attention's LSE; the Fenwick selection against brute force on
// random cases (ties included); the loss and its gradient against float64 formulas and finite
// differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kernels/kvpop.h"
#include "kernels/retention.h"
#include "tests/kvpop/helpers.h"

using namespace retain;
using namespace retain::kvpop_test;


TEST(KvpopTarget, MatchesDenseFloat64) {
  for (auto [T, H, K, hd, w, max_doc, seed] :
       {std::tuple{150, 4, 2, 16, 1, 60, 1u}, std::tuple{150, 4, 2, 16, 7, 60, 2u}, std::tuple{200, 2, 1, 8, 40, 200, 5u},
        std::tuple{130, 3, 3, 8, 64, 130, 6u}}) {
    SCOPED_TRACE(::testing::Message() << "T " << T << " w " << w);
    std::mt19937 rng(seed);
    std::vector<int32_t> doc = packed_docs(T, rng, max_doc);
    if (w >= 40) {  // long windows: two documents longer than w around a padding run
      for (int64_t t = 0; t < T; ++t) doc[t] = t < T / 2 + 10 ? 0 : t < T / 2 + 14 ? -1 : 1;
    }
    const Vec q = randn(T * H * hd, rng, 0.7), k = randn(T * K * hd, rng, 0.7), v = randn(T * K * hd, rng);
    const float scale = 1.0f / std::sqrt(float(hd));
    const Tensor qt = f32(q, {T, H, hd}), kt = f32(k, {T, K, hd});
    Tensor out = Tensor::empty({T, H, hd}, DType::F32), lse = Tensor::empty({T, H}, DType::F32);
    ops::gated_attention(qt, kt, f32(v, {T, K, hd}), Tensor::zeros({T, K}, DType::F32), i32(doc), scale, out, lse);
    const Tensor got = kvpop::future_attention_target(qt, kt, lse, i32(doc), w, scale);
    ASSERT_EQ(got.shape(), (Shape{K, T}));
    double worst = 0;
    int finite = 0;
    for (int64_t kv = 0; kv < K; ++kv) {
      const Vec want = ref_target(q, k, doc, H, K, hd, kv, w, scale);
      for (int64_t t = 0; t < T; ++t) {
        const float g = got.data<float>()[kv * T + t];
        if (std::isinf(want[t])) {
          EXPECT_EQ(g, -INFINITY) << kv << " " << t;
        } else {
          ++finite;
          worst = std::max(worst, std::abs(g - want[t]));
        }
      }
    }
    std::printf("target vs dense float64: max |Δ log m| %.3g over %d targets\n", worst, finite);
    EXPECT_GT(finite, 20);
    EXPECT_LT(worst, 2e-5);
  }
}

TEST(KvpopTarget, SpansInAnyOrderEqualTheWhole) {
  // Context parallelism's split (kvpop::future_attention_sums): keys and queries cut at random
  // edges, the (query span, key span) pairs summed in a random order, then finished.
  std::mt19937 rng(21);
  for (int trial = 0; trial < 6; ++trial) {
    const int64_t T = std::uniform_int_distribution<int64_t>(40, 260)(rng), H = 4, K = 2, hd = 8;
    const int64_t w = std::uniform_int_distribution<int64_t>(1, 30)(rng);
    SCOPED_TRACE(::testing::Message() << "T " << T << " w " << w);
    const Tensor doc = i32(packed_docs(T, rng, 120));
    const Tensor q = f32(randn(T * H * hd, rng, 0.7), {T, H, hd}), k = f32(randn(T * K * hd, rng, 0.7), {T, K, hd});
    Tensor out = Tensor::empty({T, H, hd}, DType::F32), lse = Tensor::empty({T, H}, DType::F32);
    ops::gated_attention(q, k, f32(randn(T * K * hd, rng), {T, K, hd}), Tensor::zeros({T, K}, DType::F32), doc, 0.3f,
                         out, lse);
    const Tensor whole = kvpop::future_attention_target(q, k, lse, doc, w, 0.3f);

    std::vector<int64_t> edges{0, T};
    for (int c = 0; c < 4; ++c) edges.push_back(std::uniform_int_distribution<int64_t>(1, T - 1)(rng));
    std::sort(edges.begin(), edges.end());
    edges.erase(std::unique(edges.begin(), edges.end()), edges.end());
    const size_t spans = edges.size() - 1;
    std::vector<std::pair<Tensor, Tensor>> acc;
    for (size_t i = 0; i < spans; ++i) acc.push_back(kvpop::future_attention_start(edges[i + 1] - edges[i], H));
    std::vector<std::pair<size_t, size_t>> pairs;
    for (size_t a = 0; a < spans; ++a)
      for (size_t b = 0; b < spans; ++b) pairs.emplace_back(a, b);
    std::shuffle(pairs.begin(), pairs.end(), rng);
    for (auto [qi, ki] : pairs) {
      const int64_t q0 = edges[qi], q1 = edges[qi + 1], k0 = edges[ki], k1 = edges[ki + 1];
      kvpop::future_attention_sums(q.rows(q0, q1), lse.rows(q0, q1), doc.rows(q0, q1), q0, k.rows(k0, k1),
                                   doc.rows(k0, k1), k0, w, 0.3f, acc[ki].first, acc[ki].second);
    }
    double worst = 0;
    for (size_t i = 0; i < spans; ++i) {
      const Tensor part = kvpop::future_attention_finish(acc[i].first, acc[i].second, K);
      const int64_t n = edges[i + 1] - edges[i];
      for (int64_t kv = 0; kv < K; ++kv)
        for (int64_t t = 0; t < n; ++t) {
          const float g = part.data<float>()[kv * n + t], want = whole.data<float>()[kv * T + edges[i] + t];
          if (std::isinf(want)) {
            EXPECT_EQ(g, want) << kv << " " << edges[i] + t;
          } else {
            worst = std::max(worst, double(std::abs(g - want)) / std::max(1.0f, std::abs(want)));
          }
        }
    }
    EXPECT_LT(worst, 1e-6);
  }
  // Shapes: the sums must match the keys; spans start at a token ≥ 0.
  const Tensor q = Tensor::zeros({4, 2, 8}, DType::F32), k = Tensor::zeros({4, 1, 8}, DType::F32),
               lse = Tensor::zeros({4, 2}, DType::F32), doc = i32(std::vector<int32_t>(4, 0));
  auto [mx, sum] = kvpop::future_attention_start(4, 2);
  Tensor small = Tensor::zeros({3, 2}, DType::F64);
  EXPECT_THROW(kvpop::future_attention_sums(q, lse, doc, 0, k, doc, 0, 1, 1.0f, small, sum), Error);
  EXPECT_THROW(kvpop::future_attention_sums(q, lse, doc, -1, k, doc, 0, 1, 1.0f, mx, sum), Error);
  EXPECT_THROW(kvpop::future_attention_finish(mx, sum, 3), Error);
}

TEST(KvpopSelect, MatchesBruteForce) {
  std::mt19937 rng(11);
  int decisions = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t T = std::uniform_int_distribution<int64_t>(1, 300)(rng);
    const int64_t w = std::uniform_int_distribution<int64_t>(1, 20)(rng);
    const int64_t sinks = std::uniform_int_distribution<int64_t>(0, 5)(rng);
    const int64_t k = std::uniform_int_distribution<int64_t>(1, 12)(rng);
    const std::vector<int32_t> doc = packed_docs(T, rng, 150);
    Vec lm = randn(T, rng, 3.0);
    if (trial % 2 == 1)  // many ties
      for (double& x : lm) x = std::round(x);
    const std::vector<kvpop::Decision> got = kvpop::select_decisions(f32(lm, {T}), i32(doc), w, sinks, k);
    const std::vector<kvpop::Decision> want = brute_decisions(lm, doc, w, sinks, k);
    ASSERT_EQ(got.size(), want.size()) << "trial " << trial;
    for (size_t x = 0; x < got.size(); ++x) {
      EXPECT_EQ(got[x].q, want[x].q);
      EXPECT_EQ(got[x].t_new, want[x].t_new);
      EXPECT_EQ(got[x].b, want[x].b);
      EXPECT_EQ(got[x].y, want[x].y);
      EXPECT_EQ(got[x].margin, want[x].margin);
    }
    decisions += static_cast<int>(got.size());
  }
  EXPECT_GT(decisions, 1000);
}

TEST(KvpopSelect, RejectsMissingTargets) {
  const std::vector<int32_t> doc(10, 0);
  Vec lm(10, 0.0);
  lm[3] = -INFINITY;  // token 3 has queries d ≥ 3 + 2 in its document, so it has a target
  EXPECT_THROW(kvpop::select_decisions(f32(lm, {10}), i32(doc), 2, 0, 1), Error);
  lm[3] = 0;
  lm[9] = -INFINITY;  // the last w tokens have none: allowed
  EXPECT_NO_THROW(kvpop::select_decisions(f32(lm, {10}), i32(doc), 2, 0, 1));
}

TEST(KvpopLoss, ValueAndGradientMatchFloat64) {
  std::mt19937 rng(12);
  const int64_t T = 120, w = 4;
  const std::vector<int32_t> doc = packed_docs(T, rng, 70);
  const std::vector<kvpop::Decision> ds = kvpop::select_decisions(f32(randn(T, rng, 2.0), {T}), i32(doc), w, 2, 3);
  ASSERT_GT(ds.size(), 20u);
  Vec score = randn(T, rng);
  for (double theta0 : {0.0, -1.3, 2.1}) {
    for (double margin_scale : {0.0, 0.7}) {
      double theta = theta0;
      const double tau = margin_scale > 0 ? 1.0 : 0.5;
      const Tensor st = f32(score, {T}), th = f32(theta);
      const double want = ref_pair_loss(score, double(th.data<float>()[0]), ds, margin_scale, tau);
      EXPECT_NEAR(kvpop::pair_loss(st, th, ds, margin_scale, tau), want, 1e-9 * std::abs(want));
      Tensor dscore, dtheta;
      kvpop::pair_loss_backward(st, th, ds, margin_scale, tau, 0.5, dscore, dtheta);
      Vec fd(T + 1);
      const double h = 1e-6;
      for (int64_t t = 0; t <= T; ++t) {
        double& v = t < T ? score[t] : theta;
        const double keep = v;
        v = keep + h;
        const double jp = ref_pair_loss(score, theta, ds, margin_scale, tau);
        v = keep - h;
        const double jm = ref_pair_loss(score, theta, ds, margin_scale, tau);
        v = keep;
        fd[t] = 0.5 * (jp - jm) / (2 * h);
      }
      Vec got = to_vec(dscore);
      got.push_back(dtheta.data<float>()[0]);
      EXPECT_LT(rel_err(got, fd), 1e-6);
      // θ's gradient is small (log γ moves by 1e-3 at most): check it on its own scale too.
      EXPECT_NEAR(got[T], fd[T], 1e-6 * std::abs(fd[T]) + 1e-12);
    }
  }
}

// --target-cutoff effective (the KVPOP paper's rule): the residue passes against brute force
// from the definition, for every = 1 (one static order) and every > 1 (the order changes with
// q mod every), with a strong decay so that it reorders the keys, and ties.
TEST(KvpopSelect, EffectiveTargetsMatchBruteForce) {
  std::mt19937 rng(21);
  int decisions = 0, reordered = 0;
  for (int trial = 0; trial < 80; ++trial) {
    const int64_t T = std::uniform_int_distribution<int64_t>(1, 260)(rng);
    const int64_t w = std::uniform_int_distribution<int64_t>(1, 12)(rng);
    const int64_t sinks = std::uniform_int_distribution<int64_t>(0, 4)(rng);
    const int64_t k = std::uniform_int_distribution<int64_t>(1, 10)(rng);
    const int64_t every = std::vector<int64_t>{1, 2, 3, 5, 16}[static_cast<size_t>(trial % 5)];
    const double lg = trial % 3 == 0 ? 0.0 : -std::uniform_real_distribution<double>(0.01, 0.5)(rng);
    const std::vector<int32_t> doc = packed_docs(T, rng, 150);
    Vec lm = randn(T, rng, 2.0);
    if (trial % 4 == 1)
      for (double& x : lm) x = std::round(x);
    // float targets, as the kernel sees them
    for (double& x : lm) x = static_cast<float>(x);
    const std::vector<kvpop::Decision> got =
        kvpop::select_decisions(f32(lm, {T}), i32(doc), w, sinks, k, kvpop::TargetRule{true, lg, every});
    const std::vector<kvpop::Decision> want = brute_effective_decisions(lm, doc, w, sinks, k, lg, every);
    const std::vector<kvpop::Decision> raw = brute_decisions(lm, doc, w, sinks, k);
    ASSERT_EQ(got.size(), want.size()) << "trial " << trial;
    for (size_t x = 0; x < got.size(); ++x) {
      EXPECT_EQ(got[x].q, want[x].q);
      EXPECT_EQ(got[x].t_new, want[x].t_new);
      EXPECT_EQ(got[x].b, want[x].b) << "trial " << trial << " q " << want[x].q;
      EXPECT_EQ(got[x].y, want[x].y);
      EXPECT_NEAR(got[x].margin, want[x].margin, 1e-6 * (1 + want[x].margin));
      if (raw[x].b != want[x].b || raw[x].y != want[x].y) ++reordered;
    }
    decisions += static_cast<int>(got.size());
  }
  std::printf("effective targets: %d decisions, %d differ from the raw rule\n", decisions, reordered);
  EXPECT_GT(decisions, 1000);
  EXPECT_GT(reordered, 100);  // the option changes decisions: the test can tell the rules apart
  EXPECT_THROW(kvpop::select_decisions(f32(Vec(10, 0.0), {10}), i32(std::vector<int32_t>(10, 0)), 2, 0, 1,
                                       kvpop::TargetRule{true, 0.1, 1}),
               Error);  // log γ > 0
}

// --decay-every and --decay-min/--decay-max: the loss and its gradient (scores and θ) against the
// float64 definition and central differences.
TEST(KvpopLoss, DecayEveryAndRangeMatchFloat64) {
  std::mt19937 rng(13);
  const int64_t T = 140, w = 5;
  const std::vector<int32_t> doc = packed_docs(T, rng, 80);
  const std::vector<kvpop::Decision> ds = kvpop::select_decisions(f32(randn(T, rng, 2.0), {T}), i32(doc), w, 2, 3);
  ASSERT_GT(ds.size(), 20u);
  Vec score = randn(T, rng);
  for (auto [every, gmin, gmax] : {std::tuple{int64_t{3}, 0.999, 0.999999}, std::tuple{int64_t{1}, 0.9, 0.99},
                                   std::tuple{int64_t{4}, 0.8, 0.995}, std::tuple{int64_t{7}, 0.95, 0.95}}) {
    SCOPED_TRACE(::testing::Message() << "every " << every << " range " << gmin << " " << gmax);
    const kvpop::Decay decay{every, gmin, gmax};
    for (double theta0 : {0.0, -1.1, 1.7}) {
      double theta = theta0;
      const double margin_scale = 0.6, tau = 1.0;
      const Tensor st = f32(score, {T}), th = f32(theta);
      theta = th.data<float>()[0];
      const double want = ref_pair_loss(score, theta, ds, margin_scale, tau, every, gmin, gmax);
      EXPECT_NEAR(kvpop::pair_loss(st, th, ds, margin_scale, tau, decay), want, 1e-9 * std::abs(want));
      if (every > 1 || gmin != 0.999) {  // the option changes the loss
        EXPECT_GT(std::abs(want - ref_pair_loss(score, theta, ds, margin_scale, tau)), 1e-6 * std::abs(want));
      }
      Tensor dscore, dtheta;
      kvpop::pair_loss_backward(st, th, ds, margin_scale, tau, 0.5, dscore, dtheta, decay);
      Vec fd(T + 1);
      for (int64_t t = 0; t <= T; ++t) {
        // θ's gradient is small next to the loss: a wider step keeps rounding (|loss|·ε/h) below 1e-6 of it.
        const double h = t < T ? 1e-6 : 1e-4;
        double& v = t < T ? score[t] : theta;
        const double keep = v;
        v = keep + h;
        const double jp = ref_pair_loss(score, theta, ds, margin_scale, tau, every, gmin, gmax);
        v = keep - h;
        const double jm = ref_pair_loss(score, theta, ds, margin_scale, tau, every, gmin, gmax);
        v = keep;
        fd[t] = 0.5 * (jp - jm) / (2 * h);
      }
      Vec got = to_vec(dscore);
      got.push_back(dtheta.data<float>()[0]);
      EXPECT_LT(rel_err(got, fd), 1e-6);
      EXPECT_NEAR(got[T], fd[T], 1e-6 * std::abs(fd[T]) + 1e-12);
    }
  }
  // Bad decays are one error naming the rule.
  Tensor dscore, dtheta;
  EXPECT_THROW(kvpop::pair_loss(f32(score, {T}), f32(0.0), ds, 0, 1, kvpop::Decay{0, 0.999, 0.999999}), Error);
  EXPECT_THROW(kvpop::pair_loss(f32(score, {T}), f32(0.0), ds, 0, 1, kvpop::Decay{1, 0.99, 0.9}), Error);
  EXPECT_THROW(kvpop::pair_loss(f32(score, {T}), f32(0.0), ds, 0, 1, kvpop::Decay{1, 0.0, 0.9}), Error);
}
