// One KVPOP training step's gradients on this rank (DESIGN §5, layer-local and forward-only):
// a dense teacher forward per micro-batch (model/kvpop_step.h teacher_pass) keeps every layer's
// k, v and decisions; the decision count and the margin sum are then all-reduced over ranks and
// micro-batches, so every rank's scorer backward already uses the global normalizers
// (L_kvpop = mean ℓ over the global batch, a = |Δ log m| / its global mean). The sum of the
// ranks' gradients is the gradient of the global loss. The optimizer is not run here.
//
// Context parallelism (context_group of N > 1 ranks reading the same sequences): the teacher's
// attention and future-attention target run as rings over the group (trainer/context_parallel.h),
// then each (layer, KV head)'s inputs x and targets log m switch from this rank's tokens to the
// whole sequence on one rank of the group (gather_to_owners; head l·K + κ to group rank
// (l·K + κ) mod N), which selects its decisions and runs its scorer forward and backward as one
// rank would: the scorers' recurrent mLSTM and the decisions' ranking over a document's keys
// need the whole sequence in order. A head's gradient then comes from one rank of the group.
#pragma once
#include <cstdint>
#include <vector>

#include "model/kvpop/scorers.h"
#include "model/kvpop_step.h"
#include "model/weights.h"
#include "kernels/dist/comm.h"
#include "trainer/step.h"

namespace retain::trainer {

// Global sums of one step (identical on every rank after the step).
struct KvpopLosses {
  double loss = 0;            // L_kvpop (0 when the batch has no decision)
  int64_t decisions = 0;      // over all layers, KV heads and sequences
  double margin_sum = 0;      // Σ |Δ log m|
  int64_t agreed = 0;         // decisions the scorer got right before this step's update
  int64_t tokens = 0;         // non-padding tokens
  double agreement() const { return decisions ? static_cast<double>(agreed) / static_cast<double>(decisions) : 0.0; }
};

// ADDS this rank's part of ∂L_kvpop/∂θ into the scorers' gradients (the caller zeroes them and
// reduces over ranks). Collective. margin_weight false: a = 1 (--no-margin-weight).
KvpopLosses compute_kvpop_gradients(WeightProvider& weights, kvpop::Scorers& scorers,
                                    const std::vector<MicroBatch>& micro_batches, const kvpop::StepSettings& settings,
                                    bool margin_weight, dist::Comm& comm, dist::Comm* context_group = nullptr);

// Mean decay γ = exp(log γ(θ)) over every layer and KV head (the log line's γ).
double mean_gamma(const kvpop::Scorers& scorers, const kvpop::Decay& decay = {});

}  // namespace retain::trainer
