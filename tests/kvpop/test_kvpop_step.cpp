// The layer-local scorer step (model/kvpop_step.h) on a tiny random Qwen3: the teacher pass's
// decisions against the dense float64 target and brute-force selection (reference.h) on the
// teacher layers' own q, k; the step's loss and gradient against the float64 reference loss
// (sequential recurrence, reference projections) and its directional finite differences.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <unistd.h>
#include <vector>

#include "kernels/ops.h"
#include "model/kvpop_step.h"
#include "model/qwen3.h"
#include "model/rope_params.h"
#include "model/tiny.h"
#include "model/weights.h"
#include "tests/kvpop/helpers.h"

using namespace retain;
using namespace retain::kvpop_test;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kLayers = 2, kKv = 2, kHeads = 4, kHeadDim = 16, kR = kHeadDim / 2;

// Σ over layers and heads of the reference loss, times grad_scale.
double ref_step_loss(const kvpop::TeacherPass& pass, std::vector<std::vector<RefParams>>& P, const std::vector<int32_t>& doc,
                     const kvpop::StepSettings& s, double margin_scale, double grad_scale) {
  const int64_t T = static_cast<int64_t>(doc.size());
  double loss = 0;
  for (size_t l = 0; l < P.size(); ++l)
    for (size_t kv = 0; kv < P[l].size(); ++kv) {
      const Vec x = to_vec(pass.x[l][kv]);
      const Vec score = ref_scores(ref_project(x, T, P[l][kv]), doc, s.window, P[l][kv].w_o, P[l][kv].b_o);
      loss += grad_scale * ref_pair_loss(score, P[l][kv].theta, pass.decisions[l][kv], margin_scale, s.tau);
    }
  return loss;
}

}  // namespace

TEST(KvpopStep, MatchesReferencesOnTinyModel) {
  const fs::path dir = fs::temp_directory_path() / ("retain_kvpop_step_" + std::to_string(::getpid()));
  TinyModelOptions opt;
  opt.layers = kLayers, opt.hidden = 32, opt.heads = kHeads, opt.kv_heads = kKv, opt.head_dim = kHeadDim;
  opt.intermediate = 48, opt.vocab = 259, opt.seed = 5;
  make_tiny_model(dir.string(), opt);
  auto ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(dir.string()));
  LocalWeightProvider weights(ckpt);
  const Qwen3Config& c = weights.config();

  std::vector<int32_t> doc;
  for (auto [id, len] : std::vector<std::pair<int32_t, int>>{{3, 45}, {4, 30}, {-1, 5}})
    doc.insert(doc.end(), static_cast<size_t>(len), id);
  const int64_t T = static_cast<int64_t>(doc.size());
  std::mt19937 rng(7);
  std::vector<int32_t> ids(doc.size());
  for (int32_t& t : ids) t = std::uniform_int_distribution<int32_t>(0, 258)(rng);
  const kvpop::StepSettings s{6, 2, 3, 1.0};
  const kvpop::TeacherPass pass = kvpop::teacher_pass(weights, i32(ids), i32(doc), s);
  ASSERT_EQ(pass.x.size(), size_t(kLayers));

  // Decisions: the teacher layers' q, k (run again here) → dense float64 targets → brute force.
  {
    Tensor x = Tensor::empty({T, c.hidden_size}, DType::F32);
    ops::embedding(weights.embedding(), i32(ids), x);
    const Tensor positions = ops::document_positions(i32(doc));
    const RopeParams rope = compute_rope_params(c);
    int64_t count = 0;
    for (int64_t l = 0; l < kLayers; ++l) {
      DecoderLayerSaved saved;
      qwen3_decoder_layer(c, weights.layer(l), rope, positions, i32(doc), nullptr, l, x, nullptr, &saved);
      const Vec q = to_vec(saved.q), k = to_vec(saved.k), v = to_vec(saved.v);
      for (int64_t kv = 0; kv < kKv; ++kv) {
        const Vec lm = ref_target(q, k, doc, kHeads, kKv, kHeadDim, kv, s.window, 1.0 / std::sqrt(double(kHeadDim)));
        const auto want = brute_decisions(lm, doc, s.window, s.sinks, s.topk);
        const auto& got = pass.decisions[l][kv];
        ASSERT_EQ(got.size(), want.size());
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_EQ(got[i].q, want[i].q);
          EXPECT_EQ(got[i].b, want[i].b);
          EXPECT_EQ(got[i].y, want[i].y);
          EXPECT_NEAR(got[i].margin, want[i].margin, 1e-5);
        }
        count += static_cast<int64_t>(got.size());
        // x = [k; v] of this head.
        const Vec xs = to_vec(pass.x[l][kv]);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t e = 0; e < kHeadDim; ++e) {
            ASSERT_EQ(xs[t * 2 * kHeadDim + e], k[(t * kKv + kv) * kHeadDim + e]);
            ASSERT_EQ(xs[t * 2 * kHeadDim + kHeadDim + e], v[(t * kKv + kv) * kHeadDim + e]);
          }
      }
    }
    EXPECT_EQ(pass.num_decisions, count);
    EXPECT_GT(count, 100);
  }

  // Loss and gradient of the whole step vs the float64 reference.
  std::vector<std::vector<RefParams>> ref(kLayers);
  std::vector<std::vector<kvpop::HeadParams>> params(kLayers);
  for (int64_t l = 0; l < kLayers; ++l)
    for (int64_t kv = 0; kv < kKv; ++kv) {
      ref[l].push_back(random_params(kR, rng));
      params[l].push_back(to_head(ref[l].back()));
    }
  const double margin_scale = double(pass.num_decisions) / pass.margin_sum, grad_scale = 1.0 / double(pass.num_decisions);
  std::vector<std::vector<kvpop::HeadParams>> grads;
  const double loss = kvpop::scorer_step(pass, params, s, margin_scale, grad_scale, grads);
  const double want = ref_step_loss(pass, ref, doc, s, margin_scale, grad_scale);
  EXPECT_NEAR(loss, want, 1e-6 * want);
  // Adding twice doubles the accumulated gradient (the trainer sums sequences).
  std::vector<std::vector<kvpop::HeadParams>> twice = grads;
  for (auto& layer : twice)  // deep copies: a Tensor copy shares its memory
    for (auto& h : layer)
      for (Tensor* t : {&h.W_q, &h.W_k, &h.W_v, &h.w_i, &h.w_f, &h.b_i, &h.b_f, &h.w_o, &h.b_o, &h.theta}) *t = t->clone();
  kvpop::scorer_step(pass, params, s, margin_scale, grad_scale, twice);
  EXPECT_FLOAT_EQ(twice[1][1].W_q.data<float>()[3], 2 * grads[1][1].W_q.data<float>()[3]);
  EXPECT_FLOAT_EQ(twice[0][1].theta.data<float>()[0], 2 * grads[0][1].theta.data<float>()[0]);

  // Directional derivative along a random direction over every parameter of every scorer.
  std::vector<double*> all;
  Vec analytic;
  for (int64_t l = 0; l < kLayers; ++l)
    for (int64_t kv = 0; kv < kKv; ++kv) {
      for (double* p : ref[l][kv].all()) all.push_back(p);
      const kvpop::HeadParams& g = grads[l][kv];
      for (const Tensor* t : {&g.W_q, &g.W_k, &g.W_v, &g.w_i, &g.w_f, &g.b_i, &g.b_f, &g.w_o, &g.b_o, &g.theta})
        for (double v : to_vec(*t)) analytic.push_back(v);
    }
  ASSERT_EQ(all.size(), analytic.size());
  const Vec dir_v = randn(static_cast<int64_t>(all.size()), rng);
  const Vec keep = [&] { Vec k; for (double* p : all) k.push_back(*p); return k; }();
  auto shifted = [&](double h) {
    for (size_t i = 0; i < all.size(); ++i) *all[i] = keep[i] + h * dir_v[i];
    return ref_step_loss(pass, ref, doc, s, margin_scale, grad_scale);
  };
  const double h = 1e-6, fd = (shifted(h) - shifted(-h)) / (2 * h);
  shifted(0);
  double dot = 0;
  for (size_t i = 0; i < all.size(); ++i) dot += analytic[i] * dir_v[i];
  std::printf("scorer step: loss %.9f vs ref %.9f; directional derivative %.9g vs FD %.9g (%ld decisions)\n", loss,
              want, dot, fd, static_cast<long>(pass.num_decisions));
  EXPECT_NEAR(dot, fd, 1e-5 * std::abs(fd));
  fs::remove_all(dir);
}
