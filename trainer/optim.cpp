#include "trainer/optim.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "kernels/base/error.h"

namespace retain::trainer {

double Schedule::at(int64_t step) const {
  RETAIN_CHECK(step >= 0, "schedule step {}", step);
  if (step < warmup_steps) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  const double span = static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps));
  const double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / span);
  return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

ShardRange shard_range(int64_t n, int rank, int world) {
  RETAIN_CHECK(n >= 0 && world >= 1 && rank >= 0 && rank < world, "shard_range(n={}, rank={}, world={})", n, rank,
               world);
  const int64_t slice = (n + world - 1) / world;
  return ShardRange{rank * slice, (rank + 1) * slice, slice * world};
}

AdamW::AdamW(int64_t shard_size, const AdamWConfig& cfg)
    : cfg_(cfg), m_(static_cast<size_t>(shard_size), 0.0f), v_(static_cast<size_t>(shard_size), 0.0f) {
  RETAIN_CHECK(shard_size >= 0, "AdamW shard size {}", shard_size);
}

void AdamW::step(float* param, const float* grad, double lr) {
  ++t_;
  const double b1 = cfg_.beta1, b2 = cfg_.beta2, eps = cfg_.eps;
  const double decay = 1.0 - lr * cfg_.weight_decay;
  const double step_size = lr / (1.0 - std::pow(b1, static_cast<double>(t_)));
  const double bc2_sqrt = std::sqrt(1.0 - std::pow(b2, static_cast<double>(t_)));
  const int64_t n = shard_size();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const double g = grad[i];
    const double m = b1 * m_[static_cast<size_t>(i)] + (1.0 - b1) * g;
    const double v = b2 * v_[static_cast<size_t>(i)] + (1.0 - b2) * g * g;
    m_[static_cast<size_t>(i)] = static_cast<float>(m);
    v_[static_cast<size_t>(i)] = static_cast<float>(v);
    param[i] = static_cast<float>(double(param[i]) * decay - step_size * m / (std::sqrt(v) / bc2_sqrt + eps));
  }
}

void AdamW::set_state(int64_t t, std::vector<float> m, std::vector<float> v) {
  if (t < 0) fail("AdamW state: step count {} is negative", t);
  if (m.size() != m_.size() || v.size() != v_.size())
    fail("AdamW state: first/second moments hold {}/{} values, this shard has {}", m.size(), v.size(), m_.size());
  t_ = t;
  m_ = std::move(m);
  v_ = std::move(v);
}

double clip_factor(double global_norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  // Written so that a NaN norm gives NaN (and an infinite one 0), as torch's clamp does: a
  // poisoned step stays visible instead of silently becoming an unclipped one.
  const double f = max_norm / (global_norm + 1e-6);
  return std::isnan(f) ? f : std::min(1.0, f);
}

}  // namespace retain::trainer
