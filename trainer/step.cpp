#include "trainer/step.h"

#include <chrono>
#include <cmath>
#include <optional>

#include "kernels/base/error.h"
#include "kernels/base/nvtx.h"
#include "kernels/cuda/memory.h"
#include "kernels/deferred_checks.h"
#include "kernels/ops.h"
#include "model/qwen3.h"
#include "model/student.h"
#include "kernels/loss.h"
#include "trainer/context_parallel.h"

#include <deque>
#include <memory>

namespace retain::trainer {

std::vector<MicroBatch> make_micro_batches(const data::PackedBatch& batch, int64_t micro_batch) {
  const int64_t B = batch.input_ids.dim(0), S = batch.input_ids.dim(1);
  RETAIN_CHECK(micro_batch > 0 && B % micro_batch == 0, "make_micro_batches: {} sequences, micro-batch {}", B,
               micro_batch);
  std::vector<MicroBatch> out;
  const int32_t* ids = batch.input_ids.data<int32_t>();
  const int32_t* docs = batch.doc_ids.data<int32_t>();
  const uint8_t* mask = batch.target_mask.data<uint8_t>();
  for (int64_t b0 = 0; b0 < B; b0 += micro_batch) {
    const int64_t T = micro_batch * S;
    MicroBatch mb{Tensor::empty({T}, DType::I32), Tensor::empty({T}, DType::I32), Tensor::empty({T}, DType::U8)};
    int32_t* o_ids = mb.ids.data<int32_t>();
    int32_t* o_doc = mb.doc.data<int32_t>();
    uint8_t* o_mask = mb.target_mask.data<uint8_t>();
    int32_t next_doc = -1;
    for (int64_t j = 0; j < micro_batch; ++j) {
      const int64_t row = (b0 + j) * S;
      int32_t prev = -1;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t t = j * S + s;
        const int32_t d = docs[row + s];
        o_ids[t] = ids[row + s];
        o_mask[t] = mask[row + s];
        if (d < 0) {
          o_doc[t] = -1;
          continue;
        }
        // A new id at every change of document and at every sequence start.
        if (s == 0 || d != prev) ++next_doc;
        prev = d;
        o_doc[t] = next_doc;
      }
    }
    out.push_back(std::move(mb));
  }
  return out;
}

namespace {

int64_t count_nonzero(const Tensor& mask) {
  int64_t n = 0;
  const uint8_t* m = mask.data<uint8_t>();
  for (int64_t t = 0; t < mask.numel(); ++t) n += m[t] != 0;
  return n;
}

int64_t count_tokens(const Tensor& doc) {
  int64_t n = 0;
  const int32_t* d = doc.data<int32_t>();
  for (int64_t t = 0; t < doc.numel(); ++t) n += d[t] >= 0;
  return n;
}

}  // namespace

std::vector<MicroBatchShape> micro_batch_shapes(const std::vector<MicroBatch>& micro_batches) {
  std::vector<MicroBatchShape> out;
  for (const MicroBatch& mb : micro_batches) {
    MicroBatchShape shape;
    const int32_t* doc = mb.doc.data<int32_t>();
    for (int64_t t = 0; t < mb.doc.numel(); ++t) {
      if (doc[t] < 0) continue;
      if (t == 0 || doc[t - 1] != doc[t]) shape.doc_lengths.push_back(0);
      ++shape.doc_lengths.back();
    }
    shape.loss_positions = count_nonzero(ops::loss_positions(mb.doc, mb.target_mask));
    out.push_back(std::move(shape));
  }
  return out;
}

namespace {

// One phase of the step: an NVTX range, and with a target its wall time added there (the device
// drained at both edges, so the time is the phase's own work).
class Phase {
 public:
  Phase(const char* name, double* seconds, Device dev) : range_(name), seconds_(seconds), dev_(dev) {
    if (seconds_) drain(), start_ = std::chrono::steady_clock::now();
  }
  ~Phase() {
    if (!seconds_) return;
    drain();
    *seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  Phase(const Phase&) = delete;
  Phase& operator=(const Phase&) = delete;

 private:
  void drain() {
    if (dev_ == Device::CUDA) cuda::synchronize();
  }
  NvtxRange range_;
  double* seconds_;
  Device dev_;
  std::chrono::steady_clock::time_point start_;
};

// Adds the micro-batch's Σ exp(logβ) and Σ S(t) per layer (over tokens and KV heads), given the
// capacity sums S (formed where logβ is); the sums over them on the host (a logged step only).
void accumulate_stats(const Tensor& log_beta_any, const Tensor& S_any, const Tensor& doc_host,
                      std::vector<double>& beta_sum, std::vector<double>& cache_sum) {
  const int64_t L = log_beta_any.dim(0), T = log_beta_any.dim(1), K = log_beta_any.dim(2);
  const Tensor log_beta = log_beta_any.on(Device::CPU), S = S_any.on(Device::CPU);
  const float* lb = log_beta.data<float>();
  const float* s = S.data<float>();
  const int32_t* d = doc_host.data<int32_t>();
  for (int64_t l = 0; l < L; ++l)
    for (int64_t t = 0; t < T; ++t) {
      if (d[t] < 0) continue;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t x = (l * T + t) * K + k;
        beta_sum[static_cast<size_t>(l)] += std::exp(static_cast<double>(lb[x]));
        cache_sum[static_cast<size_t>(l)] += s[x];
      }
    }
}

// The target of every loss position (ids[t + 1]), −1 elsewhere: kl_ntp_chunked_targets' input,
// for a rank whose rows are chunks of the micro-batch.
Tensor loss_targets(const Tensor& ids, const Tensor& loss_mask) {
  const int64_t T = ids.numel();
  Tensor out = Tensor::empty({T}, DType::I32);
  const int32_t* id = ids.data<int32_t>();
  const uint8_t* m = loss_mask.data<uint8_t>();
  int32_t* o = out.data<int32_t>();
  for (int64_t t = 0; t < T; ++t) o[t] = m[t] && t + 1 < T ? id[t + 1] : -1;
  return out;
}

int64_t count_targets(const Tensor& targets) {
  int64_t n = 0;
  for (int64_t t = 0; t < targets.numel(); ++t) n += targets.data<int32_t>()[t] >= 0;
  return n;
}

}  // namespace

StepLosses compute_gradients(WeightProvider& weights, gates::RetentionGates& gates,
                             const std::vector<MicroBatch>& micro_batches, const LossConfig& cfg,
                             dist::Comm& comm, RetentionStats* stats, PhaseTimes* times, dist::Comm* context_group) {
  const int64_t L = gates.dims().layers, K = gates.dims().kv_heads;
  // The model runs where the weights are; the batch's token and document ids follow them, and
  // the loss masks stay on the host (kl_ntp_chunked lists the loss positions there).
  const Device dev = weights.device();
  const bool on_device = dev != Device::CPU;
  const bool split = context_group != nullptr && context_group->size() > 1;
  if (on_device) gates.sync_to_device();  // the values of the last optimizer step
  std::vector<Tensor> ids, docs;
  std::vector<Tensor> positions, loss_masks;
  // Context parallelism: each micro-batch's layout and this rank's part of it (the parts refer
  // to the layouts: a deque never moves them), and its rows' targets.
  std::deque<ContextLayout> layouts;
  std::vector<std::unique_ptr<ContextPart>> parts;
  std::vector<Tensor> targets, local_docs;  // (the rows' targets and documents stay on the host too)
  auto part = [&](size_t m) -> const SequencePart* { return split ? parts[m].get() : nullptr; };
  // counts: [loss positions, tokens, capacity positives (accumulation only)], reduced in float64
  // (exact for counts below 2^53).
  double counts[3] = {0, 0, 0};
  for (const MicroBatch& mb : micro_batches) {
    if (!split) {
      ids.push_back(mb.ids.on(dev));
      docs.push_back(mb.doc.on(dev));
      positions.push_back(ops::document_positions(mb.doc).on(dev));
      loss_masks.push_back(ops::loss_positions(mb.doc, mb.target_mask));
      counts[0] += static_cast<double>(count_nonzero(loss_masks.back()));
      counts[1] += static_cast<double>(count_tokens(mb.doc));
      continue;
    }
    const int r = context_group->rank();
    const ContextLayout& layout = layouts.emplace_back(mb.ids.numel(), context_group->size());
    ids.push_back(layout.local(mb.ids, r).on(dev));
    local_docs.push_back(layout.local(mb.doc, r));
    docs.push_back(local_docs.back().on(dev));
    positions.push_back(layout.local(ops::document_positions(mb.doc), r).on(dev));
    targets.push_back(layout.local(loss_targets(mb.ids, ops::loss_positions(mb.doc, mb.target_mask)), r));
    parts.push_back(std::make_unique<ContextPart>(*context_group, layout, positions.back()));
    counts[0] += static_cast<double>(count_targets(targets.back()));
    counts[1] += static_cast<double>(count_tokens(local_docs.back()));
  }
  auto capacity_loss = [&](size_t m, const Tensor& log_beta) {
    if (split)
      return ring_capacity_loss(*context_group, layouts[m], log_beta, docs[m], positions[m], cfg.memory, cfg.mode,
                                cfg.capacity_skip);
    return ops::capacity_loss(log_beta, docs[m], positions[m], cfg.memory, cfg.mode, cfg.capacity_skip);
  };
  const bool accumulate = micro_batches.size() > 1;
  if (accumulate) {
    for (size_t m = 0; m < micro_batches.size(); ++m) {
      const Phase phase("count pass", times ? &times->count_pass : nullptr, dev);
      const StudentPass pass = student_forward(weights, gates, ids[m], docs[m], part(m));
      counts[2] += static_cast<double>(capacity_loss(m, pass.log_beta).positive);
    }
  }
  comm.all_reduce(counts, 3);
  StepLosses out;
  out.positions = static_cast<int64_t>(counts[0]);
  out.tokens = static_cast<int64_t>(counts[1]);
  out.cap_positive = static_cast<int64_t>(counts[2]);

  const double n_pos = static_cast<double>(out.positions);
  const double kl_scale = out.positions ? cfg.kl_weight / n_pos : 0.0;
  const double ntp_scale = out.positions ? cfg.ntp_weight / n_pos : 0.0;
  std::vector<double> beta_sum(static_cast<size_t>(L), 0.0), cache_sum(static_cast<size_t>(L), 0.0);
  double sums[3] = {0, 0, 0};  // kl, ntp, cap (this rank)

  for (size_t m = 0; m < micro_batches.size(); ++m) {
    const MicroBatch& mb = micro_batches[m];
    Tensor teacher_hidden;
    {
      const Phase phase("teacher", times ? &times->teacher : nullptr, dev);
      teacher_hidden = qwen3_hidden(weights, ids[m], docs[m], {}, nullptr, part(m));
    }
    StudentPass pass;
    {
      const Phase phase("student", times ? &times->student : nullptr, dev);
      pass = student_forward(weights, gates, ids[m], docs[m], part(m));
    }
    std::optional<Phase> phase;
    phase.emplace("capacity", times ? &times->capacity : nullptr, dev);
    const ops::CapacityLoss cap = capacity_loss(m, pass.log_beta);
    sums[2] += cap.sum;
    if (!accumulate) {
      double positive = static_cast<double>(cap.positive);
      comm.all_reduce(&positive, 1);
      out.cap_positive = static_cast<int64_t>(positive);
    }

    phase.emplace("loss", times ? &times->loss : nullptr, dev);
    Tensor d_hidden = Tensor::empty(pass.hidden.shape(), DType::F32, dev);
    const ops::QualitySums q =
        split ? ops::kl_ntp_chunked_targets(teacher_hidden, pass.hidden, weights.lm_head(), targets[m], cfg.loss_chunk,
                                            kl_scale, ntp_scale, &d_hidden, cfg.kl)
              : ops::kl_ntp_chunked(teacher_hidden, pass.hidden, weights.lm_head(), mb.ids, loss_masks[m],
                                    cfg.loss_chunk, kl_scale, ntp_scale, &d_hidden, cfg.kl);
    sums[0] += q.kl;
    sums[1] += q.ntp;

    teacher_hidden = Tensor(), pass.hidden = Tensor();  // their memory is the backward's
    phase.emplace("capacity", times ? &times->capacity : nullptr, dev);
    Tensor d_log_beta;  // none unless the capacity loss has a gradient
    if (cfg.cap_weight != 0 && out.cap_positive > 0) {
      d_log_beta = Tensor::empty(pass.log_beta.shape(), DType::F32, dev);
      const double scale = cfg.cap_weight / static_cast<double>(out.cap_positive);
      if (split)
        ring_capacity_loss_backward(*context_group, layouts[m], pass.log_beta, docs[m], positions[m], cfg.memory,
                                    cfg.mode, scale, d_log_beta, cfg.capacity_skip);
      else
        ops::capacity_loss_backward(pass.log_beta, docs[m], positions[m], cfg.memory, cfg.mode, scale, d_log_beta,
                                    cfg.capacity_skip);
    }
    phase.emplace("backward", times ? &times->backward : nullptr, dev);
    student_backward(weights, gates, pass, d_hidden, d_log_beta);
    phase.reset();
    if (stats) {
      Tensor S = split ? ring_capacity_sums(*context_group, layouts[m], pass.log_beta, docs[m])
                       : Tensor::empty(pass.log_beta.shape(), DType::F32, dev);
      if (!split) ops::capacity_sums(pass.log_beta, docs[m], S);
      accumulate_stats(pass.log_beta, S, split ? local_docs[m] : mb.doc, beta_sum, cache_sum);
    }
  }
  if (on_device) {
    gates.add_device_grads_to_host();  // the optimizer and the reductions work on the host
    ops::raise_deferred_checks();      // the step's device value checks (logβ ≤ 0, positions ≥ 0), read once
  }

  comm.all_reduce(sums, 3);
  out.kl_sum = sums[0];
  out.ntp_sum = sums[1];
  out.cap_sum = sums[2];
  if (stats) {
    comm.all_reduce(beta_sum.data(), beta_sum.size());
    comm.all_reduce(cache_sum.data(), cache_sum.size());
    const double n = static_cast<double>(out.tokens * K);
    stats->mean_beta.assign(static_cast<size_t>(L), 0.0);
    stats->effective_cache.assign(static_cast<size_t>(L), 0.0);
    for (size_t l = 0; l < static_cast<size_t>(L); ++l) {
      stats->mean_beta[l] = n > 0 ? beta_sum[l] / n : 0.0;
      stats->effective_cache[l] = n > 0 ? cache_sum[l] / n : 0.0;
    }
  }
  return out;
}

}  // namespace retain::trainer
