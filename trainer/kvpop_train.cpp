#include "trainer/kvpop_train.h"

#include <cmath>

#include "kernels/deferred_checks.h"

namespace retain::trainer {

KvpopLosses compute_kvpop_gradients(WeightProvider& weights, kvpop::Scorers& scorers,
                                    const std::vector<MicroBatch>& micro_batches, const kvpop::StepSettings& settings,
                                    bool margin_weight, dist::Comm& comm) {
  // Teacher passes first: the normalizers need every decision of the global batch.
  std::vector<kvpop::TeacherPass> passes;
  double sums[3] = {0, 0, 0};  // decisions, margin sum, tokens
  // Effective targets rank with the scorers' current log γ (before this step's update).
  std::vector<std::vector<double>> target_log_gamma;
  if (settings.effective_cutoff)
    for (const auto& layer : scorers.head_values()) {
      target_log_gamma.emplace_back();
      for (const kvpop::HeadParams& h : layer)
        target_log_gamma.back().push_back(kvpop::log_gamma(h.theta.data<float>()[0], settings.decay));
    }
  for (const MicroBatch& mb : micro_batches) {
    passes.push_back(kvpop::teacher_pass(weights, mb.ids, mb.doc, settings,
                                         settings.effective_cutoff ? &target_log_gamma : nullptr));
    sums[0] += static_cast<double>(passes.back().num_decisions);
    sums[1] += passes.back().margin_sum;
    for (int64_t t = 0; t < mb.doc.numel(); ++t) sums[2] += mb.doc.data<int32_t>()[t] >= 0 ? 1.0 : 0.0;
  }
  comm.all_reduce(sums, 3);
  KvpopLosses out;
  out.decisions = static_cast<int64_t>(sums[0]);
  out.margin_sum = sums[1];
  out.tokens = static_cast<int64_t>(sums[2]);
  double local[2] = {0, 0};  // loss, agreed
  if (out.decisions > 0) {
    // a = margin · (decisions / margin_sum): the margin over its global mean. A batch whose
    // margins are all 0 has nothing to rank; it falls back to a = 1 rather than dividing by 0.
    const double margin_scale = margin_weight && out.margin_sum > 0 ? sums[0] / out.margin_sum : 0.0;
    const double grad_scale = 1.0 / sums[0];
    const std::vector<std::vector<kvpop::HeadParams>> values = scorers.head_values();
    std::vector<std::vector<kvpop::HeadParams>> grads = scorers.head_grads();
    for (const kvpop::TeacherPass& pass : passes) {
      int64_t agreed = 0;
      local[0] += kvpop::scorer_step(pass, values, settings, margin_scale, grad_scale, grads, &agreed);
      local[1] += static_cast<double>(agreed);
    }
  }
  // The device value checks of the teacher passes (kernels/deferred_checks.h), read once.
  if (weights.device() != Device::CPU) ops::raise_deferred_checks();
  comm.all_reduce(local, 2);
  out.loss = local[0];
  out.agreed = static_cast<int64_t>(local[1]);
  return out;
}

double mean_gamma(const kvpop::Scorers& scorers, const kvpop::Decay& decay) {
  double sum = 0;
  int64_t n = 0;
  for (const auto& layer : scorers.head_values())
    for (const kvpop::HeadParams& h : layer) {
      sum += std::exp(kvpop::log_gamma(h.theta.data<float>()[0], decay));
      ++n;
    }
  return n ? sum / static_cast<double>(n) : 0.0;
}

}  // namespace retain::trainer
