// The optimizer side of a step: AdamW over this rank's shard of the flat gate parameters,
// the learning-rate schedule, and global-norm gradient clipping. The trainer composes them:
// flatten grads → reduce_scatter → local ‖g‖² → all_reduce → clip_factor → AdamW::step on
// the shard → all_gather → unflatten.
#pragma once
#include <cstdint>
#include <vector>

namespace retain::trainer {

struct AdamWConfig {
  double lr = 2e-4, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 1e-6;
};

// Linear warmup, then cosine decay to min_lr.
struct Schedule {
  double lr = 2e-4, min_lr = 0;
  int64_t warmup_steps = 0, total_steps = 1;
  // LR for optimizer step `step` (0-based): step < warmup: lr·(step+1)/warmup;
  // then min_lr + (lr−min_lr)·0.5·(1+cos(π·(step−warmup)/max(1,total−warmup))), the
  // cosine's progress clamped to 1 (min_lr from step total_steps on).
  double at(int64_t step) const;
};

// The shard of a flat vector of n scalars that rank `rank` of `world` owns: n padded up to a
// multiple of world (the padding is zeros), split into contiguous equal slices
// [begin, end) of size padded / world.
struct ShardRange {
  int64_t begin, end, padded;
};
ShardRange shard_range(int64_t n, int rank, int world);

// AdamW with decoupled weight decay, as torch.optim.AdamW (bias-corrected, amsgrad off):
//   θ ← θ·(1 − lr·wd);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²;
//   θ ← θ − lr/(1−β1ᵗ) · m / (√v/√(1−β2ᵗ) + eps)
// over one shard: fp32 values and states, float64 arithmetic inside the update.
class AdamW {
 public:
  AdamW(int64_t shard_size, const AdamWConfig& cfg);

  // One step: t += 1; param[i] (shard_size values) updated in place with grad[i] at `lr`
  // (the config's lr is the default the trainer schedules from; this one is used).
  void step(float* param, const float* grad, double lr);

  int64_t t() const { return t_; }
  int64_t shard_size() const { return static_cast<int64_t>(m_.size()); }
  const AdamWConfig& config() const { return cfg_; }
  // The states, for checkpoints.
  std::vector<float>& m() { return m_; }
  std::vector<float>& v() { return v_; }
  // Restores a checkpointed state; a t < 0 or states of the wrong size are a retain::Error.
  void set_state(int64_t t, std::vector<float> m, std::vector<float> v);

 private:
  AdamWConfig cfg_;
  int64_t t_ = 0;
  std::vector<float> m_, v_;
};

// Global-norm clipping factor: min(1, max_norm / (norm + 1e-6)) (torch clip_grad_norm_);
// max_norm <= 0 disables clipping (1). As in torch, a NaN norm gives NaN and an infinite one 0:
// the trainer should check the norm is finite before stepping.
double clip_factor(double global_norm, double max_norm);

}  // namespace retain::trainer
