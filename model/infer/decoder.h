// Bounded-KV decoding (DESIGN §8): the Qwen3 graph of model/qwen3.cpp, fed a few tokens at a
// time (a prefill chunk or one generated token), attending over a KVCache that an eviction
// policy trims after every forward. One document per decoder: positions start at 0.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "kernels/tensor.h"
#include "model/gates/gates.h"
#include "model/infer/kv_cache.h"
#include "model/infer/kvpop_state.h"
#include "model/infer/oracle.h"
#include "model/infer/policy.h"
#include "model/rope_params.h"
#include "model/weights.h"

namespace retain::infer {

// Every layer converted to F32 once and kept: decoding asks for each layer at every token,
// and LocalWeightProvider would convert a BF16 layer again on each request.
// Every weight in F32 from construction on; reads change nothing, so threads may share one.
class ResidentWeightProvider : public WeightProvider {
 public:
  explicit ResidentWeightProvider(std::shared_ptr<const Qwen3Checkpoint> ckpt);
  const Qwen3Config& config() const override { return ckpt_->config(); }
  const LayerWeights& layer(int64_t l) override { return layers_[static_cast<size_t>(l)]; }
  const Tensor& embedding() override { return local_.embedding(); }
  const Tensor& final_norm() override { return local_.final_norm(); }
  const Tensor& lm_head() override { return local_.lm_head(); }

 private:
  std::shared_ptr<const Qwen3Checkpoint> ckpt_;
  LocalWeightProvider local_;
  std::vector<LayerWeights> layers_;
};

class Decoder {
 public:
  // `gates` (may be null unless the policy ranks by logβ) must fit the model; they are only
  // used to choose evictions, never as an attention bias. Both must outlive the decoder.
  // `scorers` (kvpop only; window and sinks of the policy come from them, and the budget's
  // rest is the top-k) run alongside: each entry's rank key is written when it leaves the window.
  // `oracle` (oracle-m only, required there; must outlive the decoder) gives those rank keys from
  // the targets of the whole sequence instead, with its window, sinks and decay (oracle.h).
  Decoder(WeightProvider& weights, const gates::RetentionGates* gates, const PolicyOptions& policy,
          const kvpop::Scorers* scorers = nullptr, const OracleScores* oracle = nullptr);

  // Feeds `ids` (the next tokens of the document) in one forward, then evicts. Returns the
  // logits F32 [T, V] of every fed token, or [1, V] of the last one when !all_logits.
  Tensor feed(std::span<const int32_t> ids, bool all_logits = false);
  // Prefills `ids` in chunks of `chunk` tokens (0: all at once), evicting after each; returns
  // the last token's logits [1, V].
  Tensor prefill(std::span<const int32_t> ids, int64_t chunk = 0);

  const KVCache& cache() const { return cache_; }
  // Called after every forward, before eviction, with the cache as the policy sees it (tests
  // compare the policy's choice with a brute force from this state).
  void set_before_evict(std::function<void(const KVCache&, int64_t seen)> hook) { before_evict_ = std::move(hook); }
  int64_t seen() const { return seen_; }
  // The running kvpop scorers (nullptr for other policies).
  const KvpopState* kvpop_state() const { return kvpop_.get(); }
  // Seconds spent in eviction (the policy's selection and the cache compaction), and in feed() overall.
  double evict_seconds() const { return evict_s_; }
  double feed_seconds() const { return feed_s_; }
  // The logβ of every fed token, per layer [seen, K] row-major (empty without gates).
  const std::vector<std::vector<float>>& log_beta_history() const { return lb_hist_; }

 private:
  WeightProvider& w_;
  const gates::RetentionGates* gates_;
  RopeParams rope_;
  std::unique_ptr<EvictionPolicy> policy_;
  std::unique_ptr<KvpopState> kvpop_;
  const OracleScores* oracle_ = nullptr;
  KVCache cache_;
  int64_t seen_ = 0;
  double evict_s_ = 0, feed_s_ = 0;
  std::vector<std::vector<float>> lb_hist_;
  std::function<void(const KVCache&, int64_t)> before_evict_;
};

// Greedy (temperature ≤ 0) or seeded sampling at `temperature` from one row of logits.
int32_t pick_token(const float* logits, int64_t V, double temperature, std::mt19937_64& rng);

}  // namespace retain::infer
