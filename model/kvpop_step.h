// The layer-local KVPOP scorer step of DESIGN §5 for one packed sequence, built from
// kernels/kvpop.h: one dense teacher forward of the frozen model keeps every layer's k, v
// (after k_norm and RoPE) and derives the targets and boundary decisions; the scorer step then
// runs every (layer, KV head) scorer forward and backward on them. Only the scorers get
// gradients. The trainer's loop: teacher pass per sequence → sum decisions and margins over
// the global batch (all sequences, ranks) → scorer step per sequence with
// margin_scale = decisions / margin_sum (0 for --no-margin-weight) and grad_scale = 1 / decisions.
#pragma once
#include <cstdint>
#include <vector>

#include "kernels/kvpop.h"
#include "kernels/tensor.h"
#include "model/sequence_part.h"
#include "model/weights.h"

namespace retain::kvpop {

struct StepSettings {
  int64_t window = 64;  // w (--window)
  int64_t sinks = 4;    // s
  int64_t topk = 0;     // k of the top-k eligible keys (B − s − w); must be ≥ 1
  double tau = 1.0;
  Decay decay{};                  // the effective score's decay (--decay-every, --decay-min/max)
  bool effective_cutoff = false;  // --target-cutoff effective: decisions from log m + the decay
};

// What the teacher pass keeps for one sequence: per layer l and KV head κ, the scorer input
// x[l][κ] F32 [T, 2·head_dim] = [k_t; v_t] and its decisions.
struct TeacherPass {
  Tensor doc;  // I32 [T], on the host
  // Where the teacher ran (the weights' device); the scorer step runs its mLSTM there, on
  // doc_on_device (= doc on the CPU). x and the decisions are on the host either way.
  Device device = Device::CPU;
  Tensor doc_on_device;
  std::vector<std::vector<Tensor>> x;
  std::vector<std::vector<std::vector<Decision>>> decisions;
  // Per layer, the targets the decisions were made from: log m F32 [K, T] on the host
  // (future_attention_target; −inf where a token has no target). retain-eval's oracle-m ranks by them.
  std::vector<Tensor> log_m;
  int64_t num_decisions = 0;  // over all layers and heads of this sequence
  double margin_sum = 0;      // Σ |Δ log m| over them
};

// One dense teacher forward (plain attention) of ids/doc I32 [T] (on any device; the pass runs
// on the weights' device): per layer, lse from ops::gated_attention with log β ≡ 0, log m =
// future_attention_target, the decisions.
// With s.effective_cutoff, target_log_gamma[l][κ] is the log γ the targets decay with (the
// scorers' current one; required then).
// With `part` (context parallelism), ids and doc are this rank's part of a longer sequence: the
// attention and the target reach the other parts through it, and the pass holds this rank's
// tokens' x and log m but no decisions (they rank each document's keys over the whole sequence:
// the caller gathers a head's rows, then add_decisions).
TeacherPass teacher_pass(WeightProvider& weights, const Tensor& ids, const Tensor& doc, const StepSettings& s,
                         const std::vector<std::vector<double>>* target_log_gamma = nullptr,
                         const SequencePart* part = nullptr);

// The decisions of every head whose x is set (a head with an empty x is another rank's under
// context parallelism), from pass.log_m and pass.doc: adds to pass.decisions, num_decisions and
// margin_sum. teacher_pass without a part calls it.
void add_decisions(TeacherPass& pass, const StepSettings& s, const std::vector<std::vector<double>>* target_log_gamma);

// Scorer forward and backward on one sequence (the heads whose x is set; the others are
// skipped): returns grad_scale·Σℓ (with grad_scale = 1 / global decisions this sequence's share
// of L_kvpop) and ADDS grad_scale·∂(Σℓ)/∂params into grads (same [L][K] layout as params). A
// field that is empty is allocated; one that already has the head's shape (e.g. a view
// rows(κ, κ + 1).reshape(...) of a stacked [K, …] gradient tensor) is added into in place.
// With `agreed`, adds the number of decisions the scorer already gets right: sign(ŝ_new(q) − ŝ_b(q))
// equals y (a tie counts as wrong).
double scorer_step(const TeacherPass& pass, const std::vector<std::vector<HeadParams>>& params, const StepSettings& s,
                   double margin_scale, double grad_scale, std::vector<std::vector<HeadParams>>& grads,
                   int64_t* agreed = nullptr);

}  // namespace retain::kvpop
