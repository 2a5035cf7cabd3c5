// KVPOP projections and the chunkwise mLSTM (kernels/kvpop.h, a. and b.) against the float64
// sequential recurrence of tests/kvpop/reference.h, and their backward against float64 central
// finite differences of that reference (so the analytic gradient of the chunkwise scheme is
// checked against a derivative of a different implementation).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <initializer_list>

#include <omp.h>
#include <random>
#include <vector>

#include "kernels/kvpop.h"
#include "tests/kvpop/helpers.h"

using namespace retain;
using namespace retain::kvpop_test;

namespace {

struct Case {
  int64_t T, r, w, max_doc;
  unsigned seed;
};

// J(params) = Σ_u c_u·score_u with the reference, for finite differences.
double ref_objective(const Vec& x, const std::vector<int32_t>& doc, int64_t w, const RefParams& p, const Vec& c) {
  const int64_t T = static_cast<int64_t>(doc.size());
  const Vec s = ref_scores(ref_project(x, T, p), doc, w, p.w_o, p.b_o);
  double J = 0;
  for (int64_t t = 0; t < T; ++t) J += c[t] * s[t];
  return J;
}

}  // namespace

TEST(KvpopProject, MatchesFloat64) {
  std::mt19937 rng(1);
  const int64_t T = 37, r = 8;
  const RefParams p = random_params(r, rng);
  const Vec x = randn(T * 4 * r, rng);
  const RefProjected want = ref_project(x, T, p);
  const kvpop::Projected got = kvpop::project(f32(x, {T, 4 * r}), to_head(p));
  EXPECT_LT(rel_err(to_vec(got.q), want.q), 1e-6);
  EXPECT_LT(rel_err(to_vec(got.k), want.k), 1e-6);
  EXPECT_LT(rel_err(to_vec(got.v), want.v), 1e-6);
  EXPECT_LT(rel_err(to_vec(got.igate), want.igate), 1e-6);
  EXPECT_LT(rel_err(to_vec(got.log_f), want.log_f), 1e-6);
  // Each Hedgehog half is a softmax: sums to 1.
  for (int64_t t = 0; t < T; ++t) {
    double a = 0, b = 0;
    for (int64_t j = 0; j < r; ++j) {
      a += got.q.data<float>()[t * 2 * r + j];
      b += got.q.data<float>()[t * 2 * r + r + j];
    }
    EXPECT_NEAR(a, 1.0, 1e-6);
    EXPECT_NEAR(b, 1.0, 1e-6);
  }
}

TEST(KvpopProject, BackwardMatchesFiniteDifferences) {
  std::mt19937 rng(2);
  const int64_t T = 23, r = 4, d = 2 * r, n = 4 * r;
  RefParams p = random_params(r, rng);
  const Vec x = randn(T * n, rng);
  const Vec cq = randn(T * d, rng), ck = randn(T * d, rng), cv = randn(T * r, rng), ci = randn(T, rng),
            cf = randn(T, rng);
  auto J = [&]() {
    const RefProjected P = ref_project(x, T, p);
    double s = 0;
    for (int64_t i = 0; i < T * d; ++i) s += cq[i] * P.q[i] + ck[i] * P.k[i];
    for (int64_t i = 0; i < T * r; ++i) s += cv[i] * P.v[i];
    for (int64_t t = 0; t < T; ++t) s += ci[t] * P.igate[t] + cf[t] * P.log_f[t];
    return s;
  };
  kvpop::HeadParams g;
  kvpop::project_backward(f32(x, {T, n}), to_head(p),
                          {f32(cq, {T, d}), f32(ck, {T, d}), f32(cv, {T, r}), f32(ci, {T}), f32(cf, {T})}, g);
  Vec got;
  for (const Tensor* t : {&g.W_q, &g.W_k, &g.W_v, &g.w_i, &g.w_f, &g.b_i, &g.b_f})
    for (double v : to_vec(*t)) got.push_back(v);
  Vec want;
  std::vector<double*> params = p.all();
  params.resize(got.size());  // W_q … b_f: the projection's own parameters
  for (double* v : params) {
    const double keep = *v, h = 1e-6;
    *v = keep + h;
    const double jp = J();
    *v = keep - h;
    const double jm = J();
    *v = keep;
    want.push_back((jp - jm) / (2 * h));
  }
  EXPECT_LT(rel_err(got, want), 1e-5);
  // An undefined field is a zero gradient: only W_v then.
  kvpop::HeadParams g2;
  kvpop::project_backward(f32(x, {T, n}), to_head(p), {Tensor(), Tensor(), f32(cv, {T, r}), Tensor(), Tensor()}, g2);
  EXPECT_EQ(to_vec(g2.W_v), to_vec(g.W_v));
  for (double v : to_vec(g2.W_q)) EXPECT_EQ(v, 0.0);
  EXPECT_EQ(g2.b_f.data<float>()[0], 0.0f);
}

class KvpopMlstm : public ::testing::TestWithParam<Case> {};

// Windows 1 (read at once), short, and longer than a 64-token chunk; documents shorter and longer
// than a chunk, with padding; one single long document.
INSTANTIATE_TEST_SUITE_P(Cases, KvpopMlstm,
                         ::testing::Values(Case{200, 4, 1, 90, 3}, Case{200, 4, 5, 90, 4}, Case{260, 4, 40, 150, 5},
                                           Case{300, 4, 70, 400, 6}, Case{150, 8, 3, 30, 7}));

TEST_P(KvpopMlstm, ScoresMatchSequentialRecurrence) {
  const Case c = GetParam();
  std::mt19937 rng(c.seed);
  const RefParams p = random_params(c.r, rng);
  const std::vector<int32_t> doc = packed_docs(c.T, rng, c.max_doc);
  const Vec x = randn(c.T * 4 * c.r, rng);
  const kvpop::HeadParams hp = to_head(p);
  const kvpop::Projected P = kvpop::project(f32(x, {c.T, 4 * c.r}), hp);
  // The reference reads the op's own float32 projections, so this isolates the recurrence.
  const RefProjected RP{to_vec(P.q), to_vec(P.k), to_vec(P.v), to_vec(P.igate), to_vec(P.log_f)};
  std::vector<char> scored;
  const Vec want = ref_scores(RP, doc, c.w, p.w_o, p.b_o, &scored);
  const Tensor got = kvpop::mlstm_scores(P, i32(doc), c.w, hp.w_o, hp.b_o);
  int n_scored = 0;
  for (int64_t u = 0; u < c.T; ++u) {
    ASSERT_EQ(bool(scored[u]), kvpop::has_score(doc.data(), c.T, c.w, u)) << u;
    n_scored += scored[u];
    if (!scored[u]) {
      EXPECT_EQ(got.data<float>()[u], 0.0f);
    }
  }
  EXPECT_GT(n_scored, 0);
  const double err = rel_err(to_vec(got), want);
  std::printf("mlstm scores vs recurrence: rel err %.3g (%d scored)\n", err, n_scored);
  EXPECT_LT(err, 2e-6);
}

TEST_P(KvpopMlstm, BackwardMatchesFiniteDifferences) {
  const Case c = GetParam();
  std::mt19937 rng(c.seed + 100);
  RefParams p = random_params(c.r, rng);
  const std::vector<int32_t> doc = packed_docs(c.T, rng, c.max_doc);
  const int64_t n = 4 * c.r;
  const Vec x = randn(c.T * n, rng), coef = randn(c.T, rng);
  const kvpop::HeadParams hp = to_head(p);
  const Tensor xt = f32(x, {c.T, n});
  const kvpop::Projected P = kvpop::project(xt, hp);
  Tensor dw_o, db_o;
  const kvpop::Projected dP = kvpop::mlstm_scores_backward(P, i32(doc), c.w, hp.w_o, hp.b_o, f32(coef, {c.T}), dw_o, db_o);
  kvpop::HeadParams g;
  kvpop::project_backward(xt, hp, dP, g);
  Vec got;
  for (const Tensor* t : {&g.W_q, &g.W_k, &g.W_v, &g.w_i, &g.w_f, &g.b_i, &g.b_f, &dw_o, &db_o})
    for (double v : to_vec(*t)) got.push_back(v);
  Vec want;
  std::vector<double*> params = p.all();
  params.pop_back();  // θ does not enter the scores
  ASSERT_EQ(params.size(), got.size());
  for (double* v : params) {
    const double keep = *v, h = 1e-6;
    *v = keep + h;
    const double jp = ref_objective(x, doc, c.w, p, coef);
    *v = keep - h;
    const double jm = ref_objective(x, doc, c.w, p, coef);
    *v = keep;
    want.push_back((jp - jm) / (2 * h));
  }
  const double err = rel_err(got, want);
  std::printf("mlstm backward vs finite differences: rel err %.3g\n", err);
  EXPECT_LT(err, 1e-4);
}

TEST(KvpopMlstm, RejectsNonContiguousDocumentsAndBadShapes) {
  std::mt19937 rng(9);
  const RefParams p = random_params(4, rng);
  const kvpop::HeadParams hp = to_head(p);
  const kvpop::Projected P = kvpop::project(f32(randn(6 * 16, rng), {6, 16}), hp);
  EXPECT_THROW(kvpop::mlstm_scores(P, i32({0, 0, 1, 1, 0, 0}), 2, hp.w_o, hp.b_o), Error);
  EXPECT_THROW(kvpop::mlstm_scores(P, i32({0, 0, 1}), 2, hp.w_o, hp.b_o), Error);
  EXPECT_THROW(kvpop::mlstm_scores(P, i32({0, 0, 1, 1, 2, 2}), 0, hp.w_o, hp.b_o), Error);
  EXPECT_THROW(kvpop::mlstm_scores(P, i32({0, 0, 1, 1, 2, 2}), 2, hp.b_o, hp.b_o), Error);
  EXPECT_NO_THROW(kvpop::mlstm_scores(P, i32({0, 0, -1, 1, 1, 1}), 2, hp.w_o, hp.b_o));
}

// Every op splits work so that no sum depends on the thread count: bit-identical results.
TEST(KvpopMlstm, ThreadCountDoesNotChangeResults) {
  std::mt19937 rng(21);
  const int64_t T = 300, r = 4, n = 16, w = 9;
  const RefParams p = random_params(r, rng);
  const kvpop::HeadParams hp = to_head(p);
  const std::vector<int32_t> doc = packed_docs(T, rng, 120);
  const Tensor x = f32(randn(T * n, rng), {T, n}), ds = f32(randn(T, rng), {T});
  auto run = [&](int threads) {
    omp_set_num_threads(threads);
    const kvpop::Projected P = kvpop::project(x, hp);
    Vec all = to_vec(kvpop::mlstm_scores(P, i32(doc), w, hp.w_o, hp.b_o));
    Tensor dw_o, db_o;
    const kvpop::Projected dP = kvpop::mlstm_scores_backward(P, i32(doc), w, hp.w_o, hp.b_o, ds, dw_o, db_o);
    kvpop::HeadParams g;
    kvpop::project_backward(x, hp, dP, g);
    for (const Tensor* t : std::initializer_list<const Tensor*>{&P.q, &dP.q, &dP.k, &dP.v, &dP.igate, &dP.log_f, &g.W_q, &g.W_k, &g.W_v, &g.w_i, &g.w_f, &dw_o})
      for (double v : to_vec(*t)) all.push_back(v);
    const Tensor q = f32(randn(T * 2 * 8, rng), {T, 2, 8}), k = f32(randn(T * 8, rng), {T, 1, 8});
    const Tensor lse = f32(Vec(T * 2, 3.0), {T, 2});
    for (double v : to_vec(kvpop::future_attention_target(q, k, lse, i32(doc), w, 0.35f))) all.push_back(v);
    return all;
  };
  const int keep = omp_get_max_threads();
  const std::mt19937 start = rng;
  const Vec one = run(1);
  rng = start;
  const Vec three = run(3);
  omp_set_num_threads(keep);
  ASSERT_EQ(one.size(), three.size());
  for (size_t i = 0; i < one.size(); ++i) {
    ASSERT_EQ(one[i], three[i]) << i;  // −inf targets compare equal too
  }
}

// A long document (24 chunks) with gates at the ends of the soft cap — input gates up to ±15,
// forgetting from none (f̃ = 15) to hard (f̃ = −15), so the stabilizer m_t swings by tens and the
// chunk-boundary rescale factors span e^{−30} … 1 — against the sequential recurrence, which
// rescales by one step at a time.
TEST(KvpopMlstm, ExtremeGatesOverManyChunks) {
  std::mt19937 rng(31);
  const int64_t T = 1500, r = 4, d = 8;
  std::vector<int32_t> doc(T, 0);
  for (int64_t t = 900; t < T; ++t) doc[t] = 1;
  std::uniform_real_distribution<float> u(-15.0f, 15.0f);
  std::vector<float> q(T * d), k(T * d), v(T * r), ig(T), lf(T);
  const Vec zq = randn(T * d, rng, 2.0), zk = randn(T * d, rng, 2.0), zv = randn(T * r, rng);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t half = 0; half < 2; ++half) {  // Hedgehog-like features: two softmaxes of r
      double sq = 0, sk = 0;
      for (int64_t j = 0; j < r; ++j) {
        sq += std::exp(zq[t * d + half * r + j]);
        sk += std::exp(zk[t * d + half * r + j]);
      }
      for (int64_t j = 0; j < r; ++j) {
        q[t * d + half * r + j] = static_cast<float>(std::exp(zq[t * d + half * r + j]) / sq);
        k[t * d + half * r + j] = static_cast<float>(std::exp(zk[t * d + half * r + j]) / sk);
      }
    }
    for (int64_t j = 0; j < r; ++j) v[t * r + j] = static_cast<float>(zv[t * r + j]);
    ig[t] = u(rng);
    const double ft = (t / 100) % 2 ? u(rng) : 15.0 - 2.0 * std::abs(u(rng)) / 15.0;  // stretches of long memory
    lf[t] = static_cast<float>(log_sigmoid(ft));
  }
  const kvpop::Projected P{Tensor::from_vector<float>(q, {T, d}), Tensor::from_vector<float>(k, {T, d}),
                           Tensor::from_vector<float>(v, {T, r}), Tensor::from_vector<float>(ig, {T}),
                           Tensor::from_vector<float>(lf, {T})};
  const Vec w_o = randn(r, rng);
  for (int64_t w : {1, 64, 130}) {
    const RefProjected RP{to_vec(P.q), to_vec(P.k), to_vec(P.v), to_vec(P.igate), to_vec(P.log_f)};
    const Vec want = ref_scores(RP, doc, w, w_o, 0.25);
    const Vec got = to_vec(kvpop::mlstm_scores(P, i32(doc), w, f32(w_o, {r}), f32(0.25)));
    const double err = rel_err(got, want);
    std::printf("extreme gates, T %ld, w %ld: rel err %.3g\n", static_cast<long>(T), static_cast<long>(w), err);
    EXPECT_LT(err, 1e-6);

    // Backward: the directional derivative of J = Σ_u c_u·score_u along a random direction in
    // every input (q̃, k̃, ṽ, ĩ, log f) vs central differences of the float64 recurrence.
    const Vec c = randn(T, rng);
    Tensor dw_o, db_o;
    const kvpop::Projected dP = kvpop::mlstm_scores_backward(P, i32(doc), w, f32(w_o, {r}), f32(0.25), f32(c, {T}), dw_o, db_o);
    std::vector<Vec> dirs;
    double analytic = 0;
    for (const Tensor* g : {&dP.q, &dP.k, &dP.v, &dP.igate, &dP.log_f}) {
      dirs.push_back(randn(g->numel(), rng));
      const Vec gv = to_vec(*g);
      for (size_t i = 0; i < gv.size(); ++i) analytic += gv[i] * dirs.back()[i];
    }
    auto J = [&](double h) {
      RefProjected X = RP;
      Vec* parts[] = {&X.q, &X.k, &X.v, &X.igate, &X.log_f};
      for (size_t p = 0; p < 5; ++p)
        for (size_t i = 0; i < parts[p]->size(); ++i) (*parts[p])[i] += h * dirs[p][i];
      const Vec sc = ref_scores(X, doc, w, w_o, 0.25);
      double j = 0;
      for (int64_t t = 0; t < T; ++t) j += c[t] * sc[t];
      return j;
    };
    const double fd = (J(1e-6) - J(-1e-6)) / 2e-6;
    std::printf("  backward: directional derivative %.9g vs finite differences %.9g\n", analytic, fd);
    EXPECT_NEAR(analytic, fd, 1e-5 * std::abs(fd));
  }
}
