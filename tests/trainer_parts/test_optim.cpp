// AdamW, the LR schedule and clipping (trainer/optim.h) against torch.optim.AdamW,
// torch.optim.lr_scheduler.LambdaLR and torch.nn.utils.clip_grad_norm_ (fixtures written by
// tests/fixtures/trainer_parts/make_fixtures.py), run the way the trainer runs them: the flat
// vector split into world = 1..4 shards with zero padding, the norm summed over shards, one
// AdamW per shard. Plus the closed forms of the schedule and the clip factor, shard ranges,
// and exact resume from a restored state.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <numbers>
#include <string>
#include <vector>

#include "data/formats/safetensors.h"
#include "trainer/optim.h"

using namespace retain;
using namespace retain::trainer;

namespace {

std::vector<std::string> fixture_files() {
  namespace fs = std::filesystem;
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(fs::path(RETAIN_FIXTURES_DIR) / "trainer_parts"))
    if (e.path().extension() == ".safetensors") out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

double scalar(const formats::SafetensorsFile& f, const std::string& name) { return f.tensor(name).data<double>()[0]; }

// |got − want| within 1e-6 relative, values far below `floor` compared at `floor`: an AdamW
// moment that is small because float32 gradients cancelled in it carries their rounding, not
// its own.
void expect_close(double got, double want, double floor, const std::string& what) {
  EXPECT_LE(std::fabs(got - want), 1e-6 * std::max(std::fabs(want), floor))
      << what << ": " << got << " vs " << want;
}

}  // namespace

TEST(AdamW, MatchesTorchShardedOverOneToFourRanks) {
  const std::vector<std::string> files = fixture_files();
  ASSERT_EQ(files.size(), 2u) << "expected the fixtures of make_fixtures.py";
  for (const std::string& path : files) {
    const formats::SafetensorsFile f = formats::SafetensorsFile::open(path);
    const AdamWConfig cfg{scalar(f, "cfg/lr"), scalar(f, "cfg/beta1"), scalar(f, "cfg/beta2"), scalar(f, "cfg/eps"),
                          scalar(f, "cfg/weight_decay")};
    const Schedule sched{scalar(f, "cfg/lr"), scalar(f, "cfg/min_lr"),
                         static_cast<int64_t>(scalar(f, "cfg/warmup_steps")),
                         static_cast<int64_t>(scalar(f, "cfg/total_steps"))};
    const double max_norm = scalar(f, "cfg/max_norm");
    const Tensor params0 = f.tensor("params0"), grads = f.tensor("grads"), lr = f.tensor("lr"),
                 norm = f.tensor("norm"), after = f.tensor("params"), m_want = f.tensor("m"), v_want = f.tensor("v");
    const int64_t n = params0.numel(), steps = grads.dim(0);
    double scale = 0;
    for (int64_t i = 0; i < n; ++i) scale = std::max(scale, double(std::fabs(params0.data<float>()[i])));

    for (int world = 1; world <= 4; ++world) {
      SCOPED_TRACE(path + " world " + std::to_string(world));
      const int64_t padded = shard_range(n, 0, world).padded, slice = padded / world;
      std::vector<float> param(static_cast<size_t>(padded), 0.0f), grad(static_cast<size_t>(padded), 0.0f);
      std::copy(params0.data<float>(), params0.data<float>() + n, param.begin());
      std::vector<AdamW> opt;
      for (int r = 0; r < world; ++r) opt.emplace_back(slice, cfg);

      for (int64_t k = 0; k < steps; ++k) {
        std::copy(grads.data<float>() + k * n, grads.data<float>() + (k + 1) * n, grad.begin());
        // Each rank's ‖g‖² over its shard, summed (the all_reduce).
        double sq = 0;
        for (int r = 0; r < world; ++r) {
          const ShardRange s = shard_range(n, r, world);
          double local = 0;
          for (int64_t i = s.begin; i < s.end; ++i) local += double(grad[static_cast<size_t>(i)]) * grad[static_cast<size_t>(i)];
          sq += local;
        }
        const double gnorm = std::sqrt(sq);
        EXPECT_NEAR(gnorm, norm.data<double>()[k], 1e-12 * norm.data<double>()[k]) << "step " << k;
        const double factor = clip_factor(gnorm, max_norm);
        for (float& g : grad) g = static_cast<float>(g * factor);
        EXPECT_NEAR(sched.at(k), lr.data<double>()[k], 1e-15) << "step " << k;
        for (int r = 0; r < world; ++r) {
          const ShardRange s = shard_range(n, r, world);
          opt[static_cast<size_t>(r)].step(param.data() + s.begin, grad.data() + s.begin, sched.at(k));
        }
        for (int64_t i = 0; i < n; ++i)
          expect_close(param[static_cast<size_t>(i)], after.data<double>()[k * n + i], 1e-3 * scale,
                       "step " + std::to_string(k) + " param " + std::to_string(i));
        for (int64_t i = n; i < padded; ++i) ASSERT_EQ(param[static_cast<size_t>(i)], 0.0f) << "padding moved";
      }
      double mscale = 0, vscale = 0;
      for (int64_t i = 0; i < n; ++i) {
        mscale = std::max(mscale, std::fabs(m_want.data<double>()[i]));
        vscale = std::max(vscale, std::fabs(v_want.data<double>()[i]));
      }
      for (int64_t i = 0; i < n; ++i) {
        const int r = static_cast<int>(i / slice);
        const size_t j = static_cast<size_t>(i - r * slice);
        EXPECT_EQ(opt[static_cast<size_t>(r)].t(), steps);
        expect_close(opt[static_cast<size_t>(r)].m()[j], m_want.data<double>()[i], 0.1 * mscale, "m " + std::to_string(i));
        expect_close(opt[static_cast<size_t>(r)].v()[j], v_want.data<double>()[i], 0.1 * vscale, "v " + std::to_string(i));
      }
    }
  }
}

TEST(AdamW, RestoredStateContinuesBitIdentically) {
  const AdamWConfig cfg{1e-2, 0.9, 0.99, 1e-8, 0.05};
  const int64_t n = 19;
  auto grad_at = [](int64_t k, int64_t i) { return static_cast<float>(std::sin(0.7 * double(k * 31 + i)) * (1 + k)); };
  std::vector<float> a(static_cast<size_t>(n)), g(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) a[static_cast<size_t>(i)] = static_cast<float>(0.1 * double(i) - 0.8);
  std::vector<float> b = a;
  AdamW straight(n, cfg), first(n, cfg);
  for (int64_t k = 0; k < 10; ++k) {
    for (int64_t i = 0; i < n; ++i) g[static_cast<size_t>(i)] = grad_at(k, i);
    straight.step(a.data(), g.data(), 1e-2 / double(k + 1));
    if (k < 4) first.step(b.data(), g.data(), 1e-2 / double(k + 1));
  }
  AdamW resumed(n, cfg);
  resumed.set_state(first.t(), first.m(), first.v());
  for (int64_t k = 4; k < 10; ++k) {
    for (int64_t i = 0; i < n; ++i) g[static_cast<size_t>(i)] = grad_at(k, i);
    resumed.step(b.data(), g.data(), 1e-2 / double(k + 1));
  }
  EXPECT_EQ(resumed.t(), 10);
  EXPECT_EQ(a, b);
  EXPECT_EQ(straight.m(), resumed.m());
  EXPECT_EQ(straight.v(), resumed.v());
}

TEST(AdamW, BadStateIsAnError) {
  AdamW opt(5, AdamWConfig{});
  EXPECT_THROW(opt.set_state(3, std::vector<float>(4), std::vector<float>(5)), Error);
  EXPECT_THROW(opt.set_state(3, std::vector<float>(5), std::vector<float>(6)), Error);
  EXPECT_THROW(opt.set_state(-1, std::vector<float>(5), std::vector<float>(5)), Error);
  EXPECT_EQ(opt.t(), 0);
  opt.set_state(3, std::vector<float>(5, 1.0f), std::vector<float>(5, 2.0f));
  EXPECT_EQ(opt.t(), 3);
  EXPECT_EQ(opt.v()[4], 2.0f);
}

TEST(Schedule, ClosedForms) {
  const Schedule s{1e-3, 1e-5, 4, 14};
  EXPECT_DOUBLE_EQ(s.at(0), 0.25e-3);
  EXPECT_DOUBLE_EQ(s.at(3), 1e-3);    // warmup ends at the peak
  EXPECT_DOUBLE_EQ(s.at(4), 1e-3);    // cosine starts at the peak
  EXPECT_DOUBLE_EQ(s.at(9), (1e-3 + 1e-5) / 2);  // half way through the decay
  EXPECT_DOUBLE_EQ(s.at(14), 1e-5);
  EXPECT_DOUBLE_EQ(s.at(1000), 1e-5);  // clamped past the end
  for (int64_t k = 4; k < 14; ++k) EXPECT_GT(s.at(k), s.at(k + 1)) << k;
  const Schedule none{2e-4, 0, 0, 1};  // no warmup, one step
  EXPECT_DOUBLE_EQ(none.at(0), 2e-4);
  EXPECT_DOUBLE_EQ(none.at(1), 0.0);
  const Schedule short_run{1.0, 0.5, 5, 3};  // total ≤ warmup: peak, then min_lr
  EXPECT_DOUBLE_EQ(short_run.at(4), 1.0);
  EXPECT_DOUBLE_EQ(short_run.at(5), 1.0);
  EXPECT_DOUBLE_EQ(short_run.at(6), 0.5);
}

TEST(ClipFactor, AsTorchClipGradNorm) {
  EXPECT_EQ(clip_factor(123.0, 0.0), 1.0);  // disabled
  EXPECT_EQ(clip_factor(123.0, -1.0), 1.0);
  EXPECT_EQ(clip_factor(0.5, 1.0), 1.0);
  EXPECT_EQ(clip_factor(0.0, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(clip_factor(10.0, 1.0), 1.0 / (10.0 + 1e-6));
  EXPECT_DOUBLE_EQ(clip_factor(1.0, 1.0), 1.0 / (1.0 + 1e-6));  // torch's eps: just below 1
  EXPECT_TRUE(std::isnan(clip_factor(std::nan(""), 1.0)));
  EXPECT_EQ(clip_factor(INFINITY, 1.0), 0.0);
}

TEST(ShardRange, CoversThePaddedVectorDisjointly) {
  for (int64_t n : {0, 1, 2, 5, 7, 37, 101, 1000003}) {
    for (int world = 1; world <= 5; ++world) {
      SCOPED_TRACE("n " + std::to_string(n) + " world " + std::to_string(world));
      const int64_t padded = shard_range(n, 0, world).padded;
      EXPECT_EQ(padded % world, 0);
      EXPECT_GE(padded, n);
      EXPECT_LT(padded - n, world);
      int64_t next = 0;
      for (int r = 0; r < world; ++r) {
        const ShardRange s = shard_range(n, r, world);
        EXPECT_EQ(s.padded, padded);
        EXPECT_EQ(s.begin, next);
        EXPECT_EQ(s.end - s.begin, padded / world);
        next = s.end;
      }
      EXPECT_EQ(next, padded);
    }
  }
}
