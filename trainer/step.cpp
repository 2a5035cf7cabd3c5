#include "trainer/step.h"

#include <cmath>

#include "kernels/base/error.h"
#include "kernels/ops.h"
#include "model/qwen3.h"
#include "model/student.h"
#include "trainer/loss.h"

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

// Adds the micro-batch's Σ exp(logβ) and Σ S(t) per layer (over tokens and KV heads).
void accumulate_stats(const Tensor& log_beta, const Tensor& doc, std::vector<double>& beta_sum,
                      std::vector<double>& cache_sum) {
  const int64_t L = log_beta.dim(0), T = log_beta.dim(1), K = log_beta.dim(2);
  Tensor S = Tensor::empty(log_beta.shape(), DType::F32);
  ops::capacity_sums(log_beta, doc, S);
  const float* lb = log_beta.data<float>();
  const float* s = S.data<float>();
  const int32_t* d = doc.data<int32_t>();
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

}  // namespace

StepLosses compute_gradients(WeightProvider& weights, gates::RetentionGates& gates,
                             const std::vector<MicroBatch>& micro_batches, const LossConfig& cfg,
                             dist::Comm& comm, RetentionStats* stats) {
  const int64_t L = gates.dims().layers, K = gates.dims().kv_heads;
  std::vector<Tensor> positions, loss_masks;
  // counts: [loss positions, tokens, capacity positives (accumulation only)], reduced in float64
  // (exact for counts below 2^53).
  double counts[3] = {0, 0, 0};
  for (const MicroBatch& mb : micro_batches) {
    positions.push_back(ops::document_positions(mb.doc));
    loss_masks.push_back(loss_positions(mb.doc, mb.target_mask));
    counts[0] += static_cast<double>(count_nonzero(loss_masks.back()));
    counts[1] += static_cast<double>(count_tokens(mb.doc));
  }
  const bool accumulate = micro_batches.size() > 1;
  if (accumulate) {
    for (size_t m = 0; m < micro_batches.size(); ++m) {
      const StudentPass pass = student_forward(weights, gates, micro_batches[m].ids, micro_batches[m].doc);
      counts[2] += static_cast<double>(
          ops::capacity_loss(pass.log_beta, micro_batches[m].doc, positions[m], cfg.memory, cfg.mode).positive);
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
    const Tensor teacher_hidden = qwen3_hidden(weights, mb.ids, mb.doc);
    const StudentPass pass = student_forward(weights, gates, mb.ids, mb.doc);

    const ops::CapacityLoss cap = ops::capacity_loss(pass.log_beta, mb.doc, positions[m], cfg.memory, cfg.mode);
    sums[2] += cap.sum;
    if (!accumulate) {
      double positive = static_cast<double>(cap.positive);
      comm.all_reduce(&positive, 1);
      out.cap_positive = static_cast<int64_t>(positive);
    }

    Tensor d_hidden = Tensor::empty(pass.hidden.shape(), DType::F32);
    const QualitySums q = kl_ntp_chunked(teacher_hidden, pass.hidden, weights.lm_head(), mb.ids, loss_masks[m],
                                         cfg.loss_chunk, kl_scale, ntp_scale, &d_hidden);
    sums[0] += q.kl;
    sums[1] += q.ntp;

    Tensor d_log_beta;  // none unless the capacity loss has a gradient
    if (cfg.cap_weight != 0 && out.cap_positive > 0) {
      d_log_beta = Tensor::empty(pass.log_beta.shape(), DType::F32);
      ops::capacity_loss_backward(pass.log_beta, mb.doc, positions[m], cfg.memory, cfg.mode,
                                  cfg.cap_weight / static_cast<double>(out.cap_positive), d_log_beta);
    }
    student_backward(weights, gates, pass, d_hidden, d_log_beta);
    if (stats) accumulate_stats(pass.log_beta, mb.doc, beta_sum, cache_sum);
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
