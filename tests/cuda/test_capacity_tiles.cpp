// The CUDA capacity kernels' tile schedule and per-lane arithmetic (kernels/cuda/capacity_tiles.h)
// run on the CPU, in every build: a block-by-block, warp-by-warp, lane-by-lane emulation of
// sums_kernel / grads_kernel (kernels/cuda/capacity.cu) — the same helpers, the same tile
// visiting order, skips, shared-memory contents and padding values — against the CPU reference
// ops (kernels/cpu/capacity.cpp) on fresh random inputs. What the emulation cannot check is
// the CUDA plumbing itself (loads by thread index, barriers, shuffles); the GPU test
// tests/cuda/test_capacity_cuda.cpp does.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/block_spans.h"
#include "kernels/cuda/capacity_tiles.h"
#include "kernels/ops.h"
#include "kernels/retention.h"
#include "kernels/tensor.h"
#include "tests/retention/random_inputs.h"
#include "tests/retention/reference.h"

using namespace retain;
using namespace retain::test;
namespace cap = retain::cuda::capacity;

namespace {

struct Problem {
  int64_t L, T, K;
  std::vector<float> lb;
  std::vector<int32_t> doc, pos;
};

Problem make_problem(int64_t L, int64_t T, int64_t K, std::mt19937& rng, int64_t max_doc) {
  Problem p{L, T, K, random_log_betas(L, T, K, rng), packed_docs(T, rng, max_doc), {}};
  const Tensor pos = ops::document_positions(i32(p.doc));
  p.pos.assign(pos.data<int32_t>(), pos.data<int32_t>() + T);
  return p;
}

// tile_info_kernel on the host.
struct TileInfo {
  int64_t nb;
  std::vector<float> tile_max;  // [L, nb, K]
  std::vector<cap::TileDocs> docs;
  std::vector<retain::cuda::spans::BlockSpan> spans;  // block_spans.cu's table from docs

  explicit TileInfo(const Problem& p) : nb(cap::tile_count(p.T)) {
    tile_max.assign(static_cast<size_t>(p.L * nb * p.K), -INFINITY);
    docs.assign(static_cast<size_t>(nb), {std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min(), 0});
    for (int64_t i = 0; i < nb * cap::kTile; ++i) {
      cap::TileDocs& d = docs[static_cast<size_t>(i / cap::kTile)];
      if (i >= p.T || p.doc[i] < 0) {
        d.padded = 1;
        continue;
      }
      d.lo = std::min(d.lo, p.doc[i]);
      d.hi = std::max(d.hi, p.doc[i]);
      for (int64_t l = 0; l < p.L; ++l)
        for (int64_t k = 0; k < p.K; ++k) {
          float& m = tile_max[(l * nb + i / cap::kTile) * p.K + k];
          m = std::max(m, p.lb[(l * p.T + i) * p.K + k]);
        }
    }
    spans = retain::cuda::spans::host_block_spans(&docs[0].lo, &docs[0].hi, 3, static_cast<int32_t>(nb));
  }
};

// sums_kernel's accumulators (float64) for every (l, t, κ), with how many tiles were skipped
// as negligible (so the tests know the skip ran).
struct Sums {
  std::vector<double> acc;
  int64_t negligible_skips = 0;
};

Sums emulate_sums(const Problem& p, const TileInfo& info) {
  const int64_t T = p.T, K = p.K, nb = info.nb;
  Sums out{std::vector<double>(static_cast<size_t>(p.L * T * K), 0.0)};
  float s_lb[cap::kTile], s_beta[cap::kTile];
  int32_t s_doc[cap::kTile];
  for (int64_t l = 0; l < p.L; ++l)
    for (int64_t qb = 0; qb < nb; ++qb)
      for (int64_t kappa = 0; kappa < K; ++kappa)  // a warp
        for (int lane = 0; lane < cap::kLanes; ++lane) {
          const int64_t t0 = qb * cap::kTile + lane * cap::kRun;
          int32_t rdoc[cap::kRun];
          for (int r = 0; r < cap::kRun; ++r) rdoc[r] = t0 + r < T ? cap::row_doc(p.doc[t0 + r]) : cap::kPadRow;
          double acc[cap::kRun] = {0, 0, 0, 0};
          for (int64_t kb = info.spans[static_cast<size_t>(qb)].key_begin; kb <= qb; ++kb) {
            if (!cap::tiles_may_meet(info.docs[qb], info.docs[kb])) continue;
            if (cap::tile_negligible(qb, kb, info.tile_max[(l * nb + kb) * K + kappa])) {
              out.negligible_skips += lane == 0;
              continue;
            }
            const int64_t i0 = kb * cap::kTile;
            for (int j = 0; j < cap::kTile; ++j) {  // the shared-memory key tile
              const int64_t i = i0 + j;
              const float v = i < T ? p.lb[(l * T + i) * K + kappa] : -INFINITY;
              s_lb[j] = cap::staged_lb2(v);
              s_beta[j] = std::exp(v);
              s_doc[j] = i < T ? cap::key_doc(p.doc[i]) : cap::kPadKey;
            }
            if (kb == qb)
              cap::lane_sums_diagonal(s_lb, s_doc, i0, cap::kTile, t0, rdoc, acc);
            else
              cap::lane_sums_off_diagonal(s_lb, s_beta, s_doc, i0, cap::kTile, t0, rdoc,
                                          cap::tile_one_document(info.docs[qb], info.docs[kb]), acc);
          }
          cap::lane_self_terms(rdoc, acc);
          for (int r = 0; r < cap::kRun; ++r)
            if (t0 + r < T) out.acc[(l * T + t0 + r) * K + kappa] = rdoc[r] >= 0 ? acc[r] : 0.0;
        }
  return out;
}

// grads_kernel for slopes g (per (l, t, κ)): dlb = scale·Σ_t g·(t − i)·exp((t − i)·logβ_i).
std::vector<double> emulate_grads(const Problem& p, const TileInfo& info, const std::vector<float>& g, double scale,
                                  int64_t* negligible_breaks) {
  const int64_t T = p.T, K = p.K, nb = info.nb;
  std::vector<double> dlb(static_cast<size_t>(p.L * T * K), 0.0);
  float s_g[cap::kTile];
  int32_t s_doc[cap::kTile];
  for (int64_t l = 0; l < p.L; ++l)
    for (int64_t kb = 0; kb < nb; ++kb)
      for (int64_t kappa = 0; kappa < K; ++kappa)
        for (int lane = 0; lane < cap::kLanes; ++lane) {
          const int64_t i0 = kb * cap::kTile + lane * cap::kRun;
          float lbk[cap::kRun], bk[cap::kRun];
          int32_t kdoc[cap::kRun];
          for (int j = 0; j < cap::kRun; ++j) {
            const int64_t i = i0 + j;
            const float v = i < T ? p.lb[(l * T + i) * K + kappa] : -INFINITY;
            lbk[j] = cap::staged_lb2(v);
            bk[j] = std::exp(v);
            kdoc[j] = i < T ? cap::key_doc(p.doc[i]) : cap::kPadKey;
          }
          double acc[cap::kRun] = {0, 0, 0, 0};
          const float key_max = info.tile_max[(l * nb + kb) * K + kappa];
          for (int64_t qb = kb; qb < info.spans[static_cast<size_t>(kb)].query_end; ++qb) {
            if (cap::tile_negligible(qb, kb, key_max)) {
              *negligible_breaks += lane == 0;
              break;
            }
            if (!cap::tiles_may_meet(info.docs[qb], info.docs[kb])) continue;
            const int64_t t0 = qb * cap::kTile;
            bool any = false;
            for (int j = 0; j < cap::kTile; ++j) {  // the shared-memory query tile
              const int64_t t = t0 + j;
              s_g[j] = t < T ? g[(l * T + t) * K + kappa] : 0.0f;
              s_doc[j] = t < T ? cap::row_doc(p.doc[t]) : cap::kPadRow;
              any = any || s_g[j] != 0;
            }
            if (!any) continue;
            if (qb == kb)
              cap::lane_grads_diagonal(s_g, s_doc, t0, cap::kTile, i0, lbk, kdoc, acc);
            else
              cap::lane_grads_off_diagonal(s_g, s_doc, t0, cap::kTile, i0, lbk, bk, kdoc,
                                           cap::tile_one_document(info.docs[qb], info.docs[kb]), acc);
          }
          for (int j = 0; j < cap::kRun; ++j)
            if (i0 + j < T) dlb[(l * T + i0 + j) * K + kappa] = kdoc[j] >= 0 ? scale * acc[j] : 0.0;
        }
  return dlb;
}

// Local slopes from the emulated sums, as sums_kernel computes them.
std::vector<float> local_slopes(const Problem& p, const std::vector<double>& S, double M, double* sum, int64_t* count) {
  std::vector<float> g(S.size(), 0.0f);
  *sum = 0;
  *count = 0;
  for (int64_t l = 0; l < p.L; ++l)
    for (int64_t t = 0; t < p.T; ++t) {
      if (p.doc[t] < 0) continue;
      for (int64_t k = 0; k < p.K; ++k) {
        const size_t x = static_cast<size_t>((l * p.T + t) * p.K + k);
        const double den = cap::local_denominator(p.pos[t], M);
        const double ell = cap::hinge(S[x] - M, den);
        if (ell > 0) {
          *sum += ell;
          ++*count;
        }
        g[x] = static_cast<float>(cap::hinge_slope(S[x] - M, den));
      }
    }
  return g;
}

std::vector<double> reference_sums(const Problem& p) {
  Tensor S = Tensor::empty({p.L, p.T, p.K}, DType::F32);
  ops::capacity_sums(Tensor::from_vector(p.lb, {p.L, p.T, p.K}), i32(p.doc), S);
  return to_f64(S);
}

// The smallest relative distance of a float64 S from M: hinge decisions closer than the float32
// reference can resolve are not a fair test of the count.
double min_margin(const std::vector<double>& S, const std::vector<int32_t>& doc, int64_t T, int64_t K, double M) {
  double m = INFINITY;
  for (size_t x = 0; x < S.size(); ++x)
    if (doc[(x / static_cast<size_t>(K)) % static_cast<size_t>(T)] >= 0) m = std::min(m, std::abs(S[x] - M) / S[x]);
  return m;
}

struct Shape3 {
  int64_t L, T, K, max_doc;
};
void PrintTo(const Shape3& c, std::ostream* os) { *os << fmt::format("L={} T={} K={} max_doc={}", c.L, c.T, c.K, c.max_doc); }

class CapacityTiles : public ::testing::TestWithParam<Shape3> {};

TEST_P(CapacityTiles, EmulatedKernelsMatchTheCpuReference) {
  const Shape3 s = GetParam();
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const Problem p = make_problem(s.L, s.T, s.K, rng, s.max_doc);
  const TileInfo info(p);
  const Sums sums = emulate_sums(p, info);
  const std::vector<double> want = reference_sums(p);
  const double s_err = rel_err(sums.acc, want);
  EXPECT_LE(s_err, 1e-6);
  double worst = 0;
  for (size_t x = 0; x < want.size(); ++x) worst = std::max(worst, std::abs(sums.acc[x] - want[x]) / std::max(want[x], 1.0));
  EXPECT_LE(worst, 2e-6);
  std::cout << fmt::format("S: relative error {:.2e} (norm), {:.2e} (worst element)\n", s_err, worst);

  // The local hinge and its gradient, with M inside the range of S so that both sides occur.
  std::uniform_real_distribution<double> u(0.0, 1.0);
  double M = 0;
  for (int attempt = 0; attempt < 20; ++attempt) {
    M = std::floor(u(rng) * 12.0) + 0.5 + 0.01 * u(rng);
    if (min_margin(want, p.doc, p.T, p.K, M) > 1e-5) break;
  }
  ASSERT_GT(min_margin(want, p.doc, p.T, p.K, M), 1e-5) << "no decidable M drawn";
  double sum = 0;
  int64_t count = 0;
  const std::vector<float> g = local_slopes(p, sums.acc, M, &sum, &count);
  const Tensor lb = Tensor::from_vector(p.lb, {p.L, p.T, p.K});
  const ops::CapacityLoss ref = ops::capacity_loss(lb, i32(p.doc), i32(p.pos), M, ops::CapacityMode::local);
  EXPECT_EQ(count, ref.positive);
  EXPECT_NEAR(sum, ref.sum, 1e-6 * std::max(1.0, std::abs(ref.sum)));

  const double scale = 0.37;
  int64_t breaks = 0;
  const std::vector<double> dlb = emulate_grads(p, info, g, scale, &breaks);
  Tensor dref = Tensor::empty({p.L, p.T, p.K}, DType::F32);
  ops::capacity_loss_backward(lb, i32(p.doc), i32(p.pos), M, ops::CapacityMode::local, scale, dref);
  const double d_err = rel_err(dlb, to_f64(dref));
  EXPECT_LE(d_err, 1e-5) << "count " << count;
  std::cout << fmt::format("dlog_beta (local): relative error {:.2e}\n", d_err);

  // The global hinge: totals over (l, κ) as totals_kernel forms them, one slope per row
  // (grads_kernel reads it for every head; here it is replicated).
  const double N = static_cast<double>(p.L * p.K);
  std::vector<double> total(static_cast<size_t>(p.T), 0.0);
  for (int64_t l = 0; l < p.L; ++l)
    for (int64_t t = 0; t < p.T; ++t)
      for (int64_t k = 0; k < p.K; ++k) total[t] += sums.acc[(l * p.T + t) * p.K + k];
  double Mg = 0;
  for (int attempt = 0; attempt < 20; ++attempt) {
    Mg = std::floor(u(rng) * 12.0) + 0.5 + 0.01 * u(rng);
    if (min_margin(total, p.doc, p.T, 1, Mg * N) > 1e-5) break;
  }
  ASSERT_GT(min_margin(total, p.doc, p.T, 1, Mg * N), 1e-5) << "no decidable global M drawn";
  std::vector<float> gg(static_cast<size_t>(p.L * p.T * p.K), 0.0f);
  double gsum = 0;
  int64_t gcount = 0;
  for (int64_t t = 0; t < p.T; ++t) {
    if (p.doc[t] < 0) continue;
    const double den = cap::global_denominator(p.pos[t], Mg, N);
    const double ell = cap::hinge(total[t] - Mg * N, den);
    if (ell > 0) {
      gsum += ell;
      ++gcount;
    }
    for (int64_t l = 0; l < p.L; ++l)
      for (int64_t k = 0; k < p.K; ++k)
        gg[(l * p.T + t) * p.K + k] = static_cast<float>(cap::hinge_slope(total[t] - Mg * N, den));
  }
  const ops::CapacityLoss gref = ops::capacity_loss(lb, i32(p.doc), i32(p.pos), Mg, ops::CapacityMode::global);
  EXPECT_EQ(gcount, gref.positive);
  EXPECT_NEAR(gsum, gref.sum, 1e-6 * std::max(1.0, std::abs(gref.sum)));
  const std::vector<double> gdlb = emulate_grads(p, info, gg, scale, &breaks);
  ops::capacity_loss_backward(lb, i32(p.doc), i32(p.pos), Mg, ops::CapacityMode::global, scale, dref);
  EXPECT_LE(rel_err(gdlb, to_f64(dref)), 1e-5) << "global count " << gcount;

  // A document spanning 4 tiles holds a pair of tiles 3 apart (closest distance 2·kTile + 1):
  // head (0, 0) is steep (logβ ≤ −0.3), so that tile's terms are all below e^−60 and skipped.
  // The random documents decide whether such a document exists (the seed changes per run).
  int64_t longest = 0;
  for (int64_t t = 0, run = 0; t < p.T; ++t) {
    run = (p.doc[t] >= 0 && t > 0 && p.doc[t] == p.doc[t - 1]) ? run + 1 : (p.doc[t] >= 0 ? 1 : 0);
    longest = std::max(longest, run);
  }
  if (longest >= 3 * cap::kTile + 2) {
    EXPECT_GT(sums.negligible_skips, 0) << "steep heads should skip far tiles";
    EXPECT_GT(breaks, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CapacityTiles,
                         ::testing::Values(Shape3{1, 1, 1, 5}, Shape3{1, 5, 1, 3}, Shape3{2, 127, 3, 40},
                                           Shape3{1, 128, 2, 1000}, Shape3{1, 129, 8, 50}, Shape3{3, 300, 4, 90},
                                           Shape3{2, 777, 3, 400}, Shape3{1, 1000, 2, 100000}),
                         [](const ::testing::TestParamInfo<Shape3>& info) {
                           const Shape3& c = info.param;
                           return fmt::format("L{}_T{}_K{}", c.L, c.T, c.K);
                         });

TEST(CapacityTiles, PaddingNeverMatches) {
  for (int32_t a : {-5, -1, 0, 7})
    for (int32_t b : {-3, -1, 0, 7}) {
      const bool same_doc = a >= 0 && a == b;
      EXPECT_EQ(cap::row_doc(a) == cap::key_doc(b), same_doc) << a << " " << b;
    }
}

TEST(CapacityTiles, NegligibleTilesHoldOnlyTinyTerms) {
  // A skipped tile's closest pair has exponent < −60; the tile before the first skipped one is
  // visited. Monotone in qb.
  for (float key_max : {-1e-6f, -0.01f, -0.5f, -3.0f, -30.0f}) {
    bool skipped = false;
    for (int64_t qb = 1; qb < 20000; ++qb) {
      const bool neg = cap::tile_negligible(qb, 0, key_max);
      if (skipped) {
        EXPECT_TRUE(neg) << "not monotone at qb " << qb;
      } else if (neg && qb > 1) {  // the first skipped tile: the one before it was needed
        EXPECT_GE(static_cast<double>((qb - 1) * cap::kTile - (cap::kTile - 1)) * key_max, -cap::kNegligibleExponent);
      }
      if (neg) {
        const double closest = static_cast<double>(qb * cap::kTile - (cap::kTile - 1));
        EXPECT_LT(closest * key_max, -cap::kNegligibleExponent);
        EXPECT_LT(std::exp(static_cast<double>(static_cast<float>(closest) * key_max)), 1e-26);
      }
      skipped = neg;
    }
  }
  EXPECT_FALSE(cap::tile_negligible(5, 5, -INFINITY));  // the diagonal is always visited
  EXPECT_TRUE(cap::tile_negligible(5, 4, -INFINITY));   // a tile of −inf (or padding) keys
  EXPECT_FALSE(cap::tile_negligible(9, 0, 0.0f));
}

TEST(CapacityTiles, DocumentRangesDecideWhichTilesMeet) {
  const cap::TileDocs a{0, 3, 0}, b{3, 5, 1}, c{4, 9, 0}, empty{std::numeric_limits<int32_t>::max(),
                                                           std::numeric_limits<int32_t>::min(), 1};
  EXPECT_TRUE(cap::tiles_may_meet(a, b));
  EXPECT_FALSE(cap::tiles_may_meet(a, c));
  EXPECT_FALSE(cap::tiles_may_meet(a, empty));
  EXPECT_TRUE(cap::tile_one_document({2, 2, 0}, {2, 2, 0}));
  EXPECT_FALSE(cap::tile_one_document({2, 2, 1}, {2, 2, 0}));
  EXPECT_FALSE(cap::tile_one_document({2, 2, 0}, {2, 3, 0}));
  EXPECT_EQ(cap::tile_count(1), 1);
  EXPECT_EQ(cap::tile_count(128), 1);
  EXPECT_EQ(cap::tile_count(129), 2);
}

}  // namespace
