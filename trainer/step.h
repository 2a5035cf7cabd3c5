// One training step's forward and backward on this rank (DESIGN §4): teacher pass (frozen
// model, plain attention, only its final hidden state kept), student pass (gated attention,
// activation checkpoints), KL + NTP in token chunks, the capacity loss, and the backward
// through every frozen layer into the gate gradients. Normalizers are global: every rank
// scales its part by the counts of the whole global batch, so the sum of the ranks'
// gradients is the gradient of the global loss. The optimizer is not run here.
#pragma once
#include <cstdint>
#include <vector>

#include "data/packed_dataset.h"
#include "kernels/retention.h"
#include "kernels/tensor.h"
#include "model/gates/gates.h"
#include "model/weights.h"
#include "kernels/dist/comm.h"
#include "kernels/loss.h"
#include "trainer/flops.h"

namespace retain::trainer {

struct LossConfig {
  double memory = 128;  // M
  ops::CapacityMode mode = ops::CapacityMode::local;
  double kl_weight = 0.5, ntp_weight = 0.5, cap_weight = 1.0;
  ops::KlDirection kl = ops::KlDirection::forward;
  int64_t loss_chunk = 1024;
  double capacity_skip = ops::kExactSkipExponent;  // E: capacity tiles below e^-E are skipped
};

// Sequences run through the model together: concatenated, with documents renumbered so that
// none spans two sequences (a document continued from the previous sequence restarts at
// position 0, DESIGN §4). Attention and every sum only pair tokens of one document, so a
// micro-batch of m sequences computes exactly what m separate passes would.
struct MicroBatch {
  Tensor ids;          // I32 [m·S]
  Tensor doc;          // I32 [m·S], renumbered 0, 1, ... ; −1 padding
  Tensor target_mask;  // U8 [m·S]
};
// Splits this rank's batch [B, S] into B / micro_batch micro-batches (B % micro_batch == 0).
std::vector<MicroBatch> make_micro_batches(const data::PackedBatch& batch, int64_t micro_batch);

// What the FLOP count (trainer/flops.h) needs of each micro-batch: its documents' lengths and
// its loss positions.
std::vector<MicroBatchShape> micro_batch_shapes(const std::vector<MicroBatch>& micro_batches);

// Global sums and counts of one step (identical on every rank after the step).
struct StepLosses {
  double kl_sum = 0, ntp_sum = 0, cap_sum = 0;
  int64_t positions = 0;     // loss positions (KL/NTP denominator)
  int64_t cap_positive = 0;  // #{ℓ > 0} (capacity denominator)
  int64_t tokens = 0;        // non-padding tokens
  double kl() const { return positions ? kl_sum / static_cast<double>(positions) : 0.0; }
  double ntp() const { return positions ? ntp_sum / static_cast<double>(positions) : 0.0; }
  double cap() const { return cap_positive ? cap_sum / static_cast<double>(cap_positive) : 0.0; }
  double total(const LossConfig& c) const { return c.kl_weight * kl() + c.ntp_weight * ntp() + c.cap_weight * cap(); }
};

// Per layer, over the non-padding tokens and KV heads of the global batch: mean β = mean
// exp(logβ), and the effective cache size = mean S(t) (the expected number of tokens of the
// token's document the layer still retains at t, DESIGN §4's capacity sum).
struct RetentionStats {
  std::vector<double> mean_beta, effective_cache;
};

// Wall seconds of each phase of compute_gradients on this rank, summed over its micro-batches
// (asked for by benchmarks: measuring synchronizes the device at every phase edge).
struct PhaseTimes {
  double count_pass = 0, teacher = 0, student = 0, capacity = 0, loss = 0, backward = 0;
  double total() const { return count_pass + teacher + student + capacity + loss + backward; }
};

// Runs every micro-batch of this rank and ADDS this rank's part of ∂Total/∂θ into the gates'
// gradients (the caller zeroes them and reduces over ranks). Computes on weights.device():
// on CUDA the gates' values are copied to their device mirror first and the gradients added
// back into the host's at the end, so parameters, optimizer and reductions stay on the host.
// Every phase is an NVTX range (kernels/base/nvtx.h); with `times`, each is also timed. Collective: every rank calls it
// with the same number of micro-batches. With `stats`, also fills the retention statistics
// (one more capacity-sum pass per micro-batch).
//
// The capacity denominator #{ℓ > 0} is a global count that depends on the student's forward.
// With one micro-batch per rank it is reduced between forward and backward; with gradient
// accumulation (several micro-batches) a first forward-only pass counts it, so that every
// micro-batch's backward already uses the global normalizer (exact, at the cost of one more
// student forward per micro-batch).
//
// Context parallelism (issue 39): with `context_group` (N ranks, N > 1, among the ranks of
// `comm`), every rank of the group was given the same micro-batches, and each runs its share of
// every micro-batch's tokens (trainer/context_parallel.h's layout: a front and a back chunk of
// the micro-batch's m·S tokens) through the teacher, the student, the losses and the backward;
// attention and the capacity sums pass the other chunks around the group. The rank's gradients
// are then its part of the group's, and the reduction over `comm` sums them as it sums the
// data-parallel ranks'. On either device (CUDA: trainer/context_parallel.h's rings on device
// buffers; unverified on a GPU).
StepLosses compute_gradients(WeightProvider& weights, gates::RetentionGates& gates,
                             const std::vector<MicroBatch>& micro_batches, const LossConfig& cfg,
                             dist::Comm& comm, RetentionStats* stats = nullptr, PhaseTimes* times = nullptr,
                             dist::Comm* context_group = nullptr);

}  // namespace retain::trainer
