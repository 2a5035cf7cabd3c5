// The opt-in capacity skip exponent E (kernels/retention.h) checked the same way on every
// device: against float64 sums over every term, S and the gradient may move by no more than the
// sum of the terms (or gradient terms) that are each below e^-E — whichever tiles an
// implementation skipped (the CPU and CUDA tile shapes differ) — and at E = 8 they do move (the
// skip is real), while the default E = 60 stays at rounding. Inputs: window-like gates (logβ in
// [−0.08, −0.065]) with a few long-lived keys (−1e-4) that keep some far tiles; the local hinge
// at M = 0, so every ℓ is positive and no hinge flips between the exact and skipped sums.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "kernels/ops.h"
#include "kernels/retention.h"
#include "tests/retention/reference.h"

namespace retain::test {

// run(lb, doc, positions, scale, E, S, dlog_beta, loss): the device under test's capacity_sums,
// capacity_loss_backward (local, M = 0) and capacity_loss into host tensors / a result.
using CapacityRun = std::function<void(const Tensor& lb, const Tensor& doc, const Tensor& pos, double scale, double E,
                                       Tensor& S, Tensor& dlog_beta, ops::CapacityLoss& loss)>;

inline void check_capacity_skip_exponent(const CapacityRun& run) {
  std::mt19937 rng(25);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  // Long enough, with rare enough long-lived keys, that both tile geometries have key tiles with
  // none far from some query tile: the CPU's 64-key blocks over all heads, the CUDA kernels'
  // 128-key tiles per head, which at T = 640 and 1 % long-lived keys had no skippable tile (the
  // CUDA emulator showed it).
  const int64_t L = 2, K = 2, T = 1024;
  std::vector<int32_t> doc(T);
  for (int64_t t = 0; t < T; ++t) doc[t] = t < 700 ? 0 : 1;
  std::vector<double> lb(static_cast<size_t>(L * T * K));
  // Window keys just past the E = 8 threshold at the shortest skippable distance (129, two
  // 128-tiles apart): their skipped terms (~e^-8.4) stand well above the rounding allowance.
  for (double& x : lb) x = static_cast<double>(static_cast<float>(u(rng) < 0.005 ? -1e-4 : -0.065 - 0.015 * u(rng)));
  const Tensor pos_t = ops::document_positions(i32(doc));
  const std::vector<int32_t> pos(pos_t.data<int32_t>(), pos_t.data<int32_t>() + T);
  const double scale = 0.37;
  const std::vector<double> S_ref = capacity_sums(lb, doc, L, K);
  const ops::CapacityLoss loss_ref = capacity_loss(lb, doc, pos, L, K, 0.0, ops::CapacityMode::local);
  for (double E : {8.0, 60.0}) {
    SCOPED_TRACE(::testing::Message() << "E=" << E);
    // Float64 gradient of Σℓ·scale, ℓ = S/max(p, 1) (M = 0), and per entry the part of each sum
    // made of terms below e^-E.
    std::vector<double> grad(lb.size(), 0.0), small_S(lb.size(), 0.0), small_grad(lb.size(), 0.0);
    for (int64_t l = 0; l < L; ++l)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < t; ++i) {
          if (!allowed(doc, t, i)) continue;
          for (int64_t k = 0; k < K; ++k) {
            const double x = static_cast<double>(t - i), b = lb[(l * T + i) * K + k], e = std::exp(x * b);
            const double g = scale * x * e / std::max(static_cast<double>(pos[t]), 1.0);
            grad[(l * T + i) * K + k] += g;
            if (x * b < -E) small_S[(l * T + t) * K + k] += e, small_grad[(l * T + i) * K + k] += g;
          }
        }
    Tensor S, g;
    ops::CapacityLoss loss;
    run(f32(lb, {L, T, K}), i32(doc), pos_t, scale, E, S, g, loss);
    const std::vector<double> got_S = to_f64(S), got_g = to_f64(g);
    double moved_S = 0, moved_g = 0;  // the largest change beyond rounding
    for (size_t x = 0; x < lb.size(); ++x) {
      const double round_S = 1e-6 * S_ref[x], round_g = 1e-5 * std::abs(grad[x]) + 1e-12;
      EXPECT_LE(std::abs(got_S[x] - S_ref[x]), small_S[x] + round_S) << "S entry " << x;
      EXPECT_LE(std::abs(got_g[x] - grad[x]), small_grad[x] + round_g) << "gradient entry " << x;
      moved_S = std::max(moved_S, std::abs(got_S[x] - S_ref[x]) - round_S);
      moved_g = std::max(moved_g, std::abs(got_g[x] - grad[x]) - round_g);
    }
    if (E == 8.0) {
      EXPECT_GT(moved_S, 0) << "nothing skipped at E = 8";
      EXPECT_GT(moved_g, 0) << "nothing skipped at E = 8";
    } else {
      EXPECT_LE(moved_S, 0);
      EXPECT_LE(moved_g, 0);
    }
    EXPECT_EQ(loss.positive, loss_ref.positive);
    double bound = 1e-6 * loss_ref.sum;
    for (int64_t x = 0; x < L * T * K; ++x) bound += small_S[x] / std::max(static_cast<double>(pos[(x / K) % T]), 1.0);
    EXPECT_LE(std::abs(loss.sum - loss_ref.sum), bound);
  }
}

}  // namespace retain::test
