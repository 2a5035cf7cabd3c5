// The running KVPOP scorers of one document at inference (DESIGN §5, §8): per (layer, KV head)
// the stabilized mLSTM state C [d, r], n [d], m, advanced token by token with x_t = [k_t; v_t]
// (the cached key after k_norm and RoPE, and the value), and the queries q̃ of the last w
// tokens. When token t is fed, token u = t − w + 1 leaves the protected window and gets its
// score from the state at t: score_u = w_o·silu(C_tᵀq̂_u / (max(|n_tᵀq̂_u|, e^{−m_t}) + 1e-6)) + b_o.
// The same recurrence as kvpop::mlstm_scores (checked against it in tests/infer/test_kvpop_policy.cpp),
// run incrementally in float64 state.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/tensor.h"
#include "model/kvpop/scorers.h"

namespace retain::infer {

class KvpopState {
 public:
  // The scorers must record their geometry (window, sinks, topk) and outlive the state.
  explicit KvpopState(const kvpop::Scorers& scorers);
  int64_t window() const { return geometry_.window; }
  int64_t sinks() const { return geometry_.sinks; }
  int64_t topk() const { return geometry_.topk; }
  int64_t decay_every() const { return every_; }

  // Feeds layer l's next tokens k, v F32 [T, K, d] (positions seen .. seen + T − 1 of the one
  // document). Returns, per KV head, the (position u, rank key) of every token that left the
  // window, where the rank key score_u − ⌊u/n⌋·log γ (n = the scorers' decay every; n = 1:
  // score_u − u·log γ) orders tokens as ŝ_u(q) = score_u + ⌊(q − u)/n⌋·log γ does for any common
  // query q once the keys with u mod n > q mod n get −log γ added (kvpop_drops does).
  std::vector<std::vector<std::pair<int32_t, float>>> feed(int64_t l, const Tensor& k, const Tensor& v);
  // Every score assigned so far for (l, h), by position (tests).
  const std::vector<double>& scores(int64_t l, int64_t h) const { return heads_[idx(l, h)].scores; }
  double log_gamma(int64_t l, int64_t h) const { return heads_[idx(l, h)].log_gamma; }

 private:
  struct Head {
    kvpop::HeadParams p;
    std::vector<double> C, n;  // [d·r] row-major (C[a·r + b] = Σ k̃_a ṽ_b), [d]
    double m = 0;
    double log_gamma = 0;
    std::vector<std::vector<float>> recent_q;  // q̃ of the last w tokens, oldest first
    std::vector<double> scores;
    int64_t fed = 0;
  };
  size_t idx(int64_t l, int64_t h) const { return static_cast<size_t>(l * kv_heads_ + h); }
  kvpop::PolicyGeometry geometry_;
  int64_t kv_heads_ = 0, d_ = 0, r_ = 0, every_ = 1;
  std::vector<Head> heads_;
};

}  // namespace retain::infer
