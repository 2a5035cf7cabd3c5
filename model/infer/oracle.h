// The oracle-m policy's rank keys (retain-eval --policy oracle-m): the cache of the kvpop policy
// (sinks, protected window, top-k eligible keys by ŝ_i(q) = score_i + (q − i)·log γ, DESIGN §5,
// §8) with score_i replaced by the KVPOP training target log m_i of the whole, teacher-forced
// sequence — the future attention mass the trainer supervises the scorers with, computed by the
// trainer's own code (kvpop::teacher_pass → future_attention_target). Window, sinks and the decay
// log γ per (layer, KV head) are those of a kvpop scorer file, so the oracle is the ceiling a
// scorer with those settings could reach: it would rank every key by its true target.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/tensor.h"
#include "model/kvpop/scorers.h"
#include "model/weights.h"

namespace retain::infer {

struct OracleScores {
  std::vector<Tensor> log_m;                   // per layer F32 [K, T]: the target of the whole sequence
  std::vector<std::vector<double>> log_gamma;  // [L][K]: the scorers' decay log γ(θ) in their range
  int64_t window = 0, sinks = 0;
  int64_t decay_every = 1;                     // n: the scorers' decay steps ⌊(q − u)/n⌋
  int64_t length() const { return log_m.empty() ? 0 : log_m.front().dim(1); }
  // The rank key of token u in (l, h), as the kvpop policy stores it (kvpop_state.h):
  // log m_u − ⌊u/n⌋·log γ, as kvpop_state.cpp's (the policy corrects for q mod n as it does for
  // kvpop: PolicyOptions::decay_every, log_gamma). A
  // token with no target (no query d ≥ u + w in the sequence: only the last w tokens) ranks
  // lowest. Fails for a position beyond the sequence.
  float rank_key(int64_t l, int64_t h, int64_t u) const;
};

// The dense teacher forward of `ids` (one document, as retain-train's teacher pass with the
// scorers' window, sinks and top-k) and its targets.
OracleScores oracle_scores(WeightProvider& weights, std::span<const int32_t> ids, const kvpop::Scorers& scorers);

}  // namespace retain::infer
