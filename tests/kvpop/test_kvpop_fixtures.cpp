// The KVPOP ops against committed fixtures (tests/fixtures/kvpop/make_fixtures.py): the
// mLSTM against NX-AI's mlstm-kernels (its recurrence and its readout step), and the whole
// DESIGN §5 loss of a layer — gated_attention's LSE → targets → selection → projections →
// mLSTM → margin-weighted pairwise loss, and back — against float64 torch autograd.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/kvpop.h"
#include "kernels/retention.h"
#include "data/formats/safetensors.h"
#include "tests/kvpop/helpers.h"

using namespace retain;
using namespace retain::kvpop_test;

namespace {

std::string fixture(const char* name) { return std::string(RETAIN_FIXTURES_DIR) + "/kvpop/" + name; }

Vec f64(const formats::SafetensorsFile& f, const std::string& name) {
  const Tensor t = f.tensor(name).to_dtype(DType::F64);
  return Vec(t.data<double>(), t.data<double>() + t.numel());
}

int64_t i64(const formats::SafetensorsFile& f, const char* name) { return f.tensor(name).clone().data<int64_t>()[0]; }

}  // namespace

TEST(KvpopFixtures, MlstmMatchesMlstmKernels) {
  const formats::SafetensorsFile f = formats::SafetensorsFile::open(fixture("mlstm.safetensors"));
  const kvpop::Projected P{f.tensor("q").clone(), f.tensor("k").clone(), f.tensor("v").clone(),
                           f.tensor("igate").clone(), f.tensor("log_f").clone()};
  const Tensor doc = f.tensor("doc").clone(), w_o = f.tensor("w_o").clone(), b_o = f.tensor("b_o").clone();
  const int64_t T = doc.dim(0);
  for (int64_t w : {1, 9, 70}) {
    SCOPED_TRACE(w);
    const Vec want = f64(f, "score_w" + std::to_string(w));
    const Vec got = to_vec(kvpop::mlstm_scores(P, doc, w, w_o, b_o));
    int scored = 0;
    for (int64_t u = 0; u < T; ++u) scored += kvpop::has_score(doc.data<int32_t>(), T, w, u);
    const double err = rel_err(got, want);
    std::printf("mlstm vs mlstm-kernels, w %ld: rel err %.3g over %d scores\n", static_cast<long>(w), err, scored);
    EXPECT_GT(scored, 50);
    EXPECT_LT(err, 1e-6);
  }
}

TEST(KvpopFixtures, LayerLossMatchesAutograd) {
  const formats::SafetensorsFile f = formats::SafetensorsFile::open(fixture("layer.safetensors"));
  const Tensor q = f.tensor("q").clone(), k = f.tensor("k").clone(), v = f.tensor("v").clone();
  const Tensor doc = f.tensor("doc").clone();
  const int64_t T = q.dim(0), H = q.dim(1), hd = q.dim(2), K = k.dim(1), r = hd / 2, n = 2 * hd;
  const int64_t w = i64(f, "window"), sinks = i64(f, "sinks"), topk = i64(f, "topk");
  const float scale = 1.0f / std::sqrt(float(hd));

  // Targets from the dense attention's LSE.
  Tensor out = Tensor::empty({T, H, hd}, DType::F32), lse = Tensor::empty({T, H}, DType::F32);
  ops::gated_attention(q, k, v, Tensor::zeros({T, K}, DType::F32), doc, scale, out, lse);
  const Tensor log_m = kvpop::future_attention_target(q, k, lse, doc, w, scale);
  const Vec want_lm = f64(f, "log_m");
  double lm_err = 0;
  for (int64_t x = 0; x < K * T; ++x) {
    if (std::isinf(want_lm[x])) {
      EXPECT_EQ(log_m.data<float>()[x], -INFINITY) << x;
    } else {
      lm_err = std::max(lm_err, std::abs(log_m.data<float>()[x] - want_lm[x]));
    }
  }
  EXPECT_LT(lm_err, 1e-5);

  // Per head: decisions, projections, scores.
  const Tensor want_dec = f.tensor("decisions").clone();
  std::vector<std::vector<kvpop::Decision>> decisions(static_cast<size_t>(K));
  std::vector<kvpop::HeadParams> heads;
  std::vector<Tensor> xs, scores;
  std::vector<kvpop::Projected> projected;
  const Vec want_score = f64(f, "score");
  double margin_sum = 0;
  int64_t count = 0, row = 0;
  for (int64_t kv = 0; kv < K; ++kv) {
    decisions[kv] = kvpop::select_decisions(log_m.rows(kv, kv + 1).reshape({T}), doc, w, sinks, topk);
    for (const kvpop::Decision& dc : decisions[kv]) {
      ASSERT_LT(row, want_dec.dim(0));
      const int64_t* wd = want_dec.data<int64_t>() + row++ * 4;
      ASSERT_EQ(wd[0], kv);
      ASSERT_EQ(dc.q, wd[1]);
      ASSERT_EQ(dc.t_new, wd[2]);
      ASSERT_EQ(dc.b, wd[3]);
      margin_sum += dc.margin;
      ++count;
    }
    auto slice = [&](const char* name, const Shape& shape) { return f.tensor(name).clone().rows(kv, kv + 1).reshape(shape).clone(); };
    heads.push_back({slice("q_proj", {r, n}), slice("k_proj", {r, n}), slice("v_proj", {r, n}), slice("igate_w", {n}),
                     slice("fgate_w", {n}), slice("igate_b", {1}), slice("fgate_b", {1}), slice("out_w", {r}),
                     slice("out_b", {1}), slice("decay", {1})});
    Tensor x = Tensor::empty({T, n}, DType::F32);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < hd; ++c) {
        x.data<float>()[t * n + c] = k.data<float>()[(t * K + kv) * hd + c];
        x.data<float>()[t * n + hd + c] = v.data<float>()[(t * K + kv) * hd + c];
      }
    xs.push_back(x);
    projected.push_back(kvpop::project(x, heads.back()));
    scores.push_back(kvpop::mlstm_scores(projected.back(), doc, w, heads.back().w_o, heads.back().b_o));
    const Vec want(want_score.begin() + kv * T, want_score.begin() + (kv + 1) * T);
    EXPECT_LT(rel_err(to_vec(scores.back()), want), 1e-6);
  }
  ASSERT_EQ(row, want_dec.dim(0));

  // L = mean ℓ over all decisions, a = margin / mean margin (and a = 1).
  const double margin_scale = double(count) / margin_sum;
  double loss = 0, loss_plain = 0;
  for (int64_t kv = 0; kv < K; ++kv) {
    loss += kvpop::pair_loss(scores[kv], heads[kv].theta, decisions[kv], margin_scale, 1.0) / double(count);
    loss_plain += kvpop::pair_loss(scores[kv], heads[kv].theta, decisions[kv], 0.0, 1.0) / double(count);
  }
  const double want_loss = f64(f, "loss")[0], want_plain = f64(f, "loss_plain")[0];
  std::printf("layer loss %.9f vs autograd %.9f (plain %.9f vs %.9f), max |Δ log m| %.3g\n", loss, want_loss,
              loss_plain, want_plain, lm_err);
  EXPECT_NEAR(loss, want_loss, 1e-6 * want_loss);
  EXPECT_NEAR(loss_plain, want_plain, 1e-6 * want_plain);

  // Backward: loss → scores, θ → mLSTM → projections, per head; compared stacked.
  const std::vector<std::pair<std::string, int>> names = {{"q_proj", 0}, {"k_proj", 1}, {"v_proj", 2}, {"igate_w", 3},
                                                          {"fgate_w", 4}, {"igate_b", 5}, {"fgate_b", 6},
                                                          {"out_w", 7}, {"out_b", 8}, {"decay", 9}};
  std::vector<Vec> got(names.size());
  for (int64_t kv = 0; kv < K; ++kv) {
    Tensor dscore, dtheta, dw_o, db_o;
    kvpop::pair_loss_backward(scores[kv], heads[kv].theta, decisions[kv], margin_scale, 1.0, 1.0 / double(count),
                              dscore, dtheta);
    const kvpop::Projected dP =
        kvpop::mlstm_scores_backward(projected[kv], doc, w, heads[kv].w_o, heads[kv].b_o, dscore, dw_o, db_o);
    kvpop::HeadParams g;
    kvpop::project_backward(xs[kv], heads[kv], dP, g);
    const Tensor* parts[] = {&g.W_q, &g.W_k, &g.W_v, &g.w_i, &g.w_f, &g.b_i, &g.b_f, &dw_o, &db_o, &dtheta};
    for (size_t p = 0; p < names.size(); ++p)
      for (double x : to_vec(*parts[p])) got[p].push_back(x);
  }
  for (size_t p = 0; p < names.size(); ++p) {
    const Vec want = f64(f, "d_" + names[p].first);
    if (names[p].first == "out_b") {
      // The loss sees only score differences, so ∂L/∂b_o is 0 (autograd: rounding noise); ours
      // is a float32 sum of ± equal terms. Checked absolutely.
      for (size_t x = 0; x < want.size(); ++x) EXPECT_NEAR(got[p][x], want[x], 1e-7);
      std::printf("  d_out_b: %.3g, %.3g vs %.3g, %.3g\n", got[p][0], got[p][1], want[0], want[1]);
      continue;
    }
    const double err = rel_err(got[p], want);
    std::printf("  d_%s: rel err %.3g\n", names[p].first.c_str(), err);
    EXPECT_LT(err, 1e-4) << names[p].first;
  }
}
