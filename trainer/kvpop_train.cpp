#include "trainer/kvpop_train.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/deferred_checks.h"
#include "kernels/ops.h"
#include "trainer/context_parallel.h"

namespace retain::trainer {

namespace {

// The teacher pass of one sequence over a context-parallel group: this rank's part through the
// rings, then the whole sequence of the heads this rank owns (gather_to_owners), their decisions.
kvpop::TeacherPass split_teacher_pass(WeightProvider& weights, const MicroBatch& mb, const kvpop::StepSettings& s,
                                      const std::vector<std::vector<double>>* target_log_gamma, dist::Comm& group) {
  const int r = group.rank(), N = group.size();
  const ContextLayout layout(mb.ids.numel(), N);
  const Tensor doc = layout.local(mb.doc, r);
  const ContextPart part(group, layout, layout.local(ops::document_positions(mb.doc), r).on(weights.device()));
  kvpop::TeacherPass local = kvpop::teacher_pass(weights, layout.local(mb.ids, r), doc, s, target_log_gamma, &part);

  // A few layers at a time — enough for about one head per rank, ⌈N/K⌉ layers — so that the
  // exchange's buffers hold about one head's whole sequence per rank, not all of its heads', and
  // carry little padding. Items per head: its x [T_local, 2d] and its log m row as [T_local, 1].
  const int64_t L = static_cast<int64_t>(local.x.size()), K = L ? static_cast<int64_t>(local.x[0].size()) : 0;
  const int64_t T = mb.ids.numel(), Tl = layout.local_tokens(r), per_exchange = K ? (N + K - 1) / K : 1;
  kvpop::TeacherPass pass;
  pass.doc = mb.doc.on(Device::CPU);
  pass.device = local.device;  // the owned heads' mLSTM runs where the teacher did, as one rank's
  pass.doc_on_device = pass.doc.on(local.device);
  pass.x.resize(static_cast<size_t>(L));
  for (int64_t l0 = 0; l0 < L; l0 += per_exchange) {
    const int64_t l1 = std::min(L, l0 + per_exchange);
    std::vector<Tensor> items;
    std::vector<int> owner;
    for (int64_t l = l0; l < l1; ++l) {
      for (int64_t kv = 0; kv < K; ++kv) {
        const int o = static_cast<int>((l * K + kv) % N);
        items.push_back(local.x[l][kv]);
        items.push_back(local.log_m[l].rows(kv, kv + 1).reshape({Tl, 1}));
        owner.insert(owner.end(), {o, o});
      }
      local.x[l].clear();  // (the items hold them until the exchange is done)
    }
    const std::vector<Tensor> whole = gather_to_owners(group, layout, items, owner);
    for (int64_t l = l0; l < l1; ++l) {
      pass.x[l].resize(static_cast<size_t>(K));
      Tensor log_m = Tensor::empty({K, T}, DType::F32);  // the owned heads' rows; −inf elsewhere
      std::fill(log_m.data<float>(), log_m.data<float>() + log_m.numel(), -std::numeric_limits<float>::infinity());
      for (int64_t kv = 0; kv < K; ++kv) {
        const size_t i = static_cast<size_t>(2 * ((l - l0) * K + kv));
        if (owner[i] != r) continue;
        pass.x[l][kv] = whole[i];
        std::memcpy(log_m.data<float>() + kv * T, whole[i + 1].data<float>(), static_cast<size_t>(T) * sizeof(float));
      }
      pass.log_m.push_back(log_m);
    }
  }
  kvpop::add_decisions(pass, s, target_log_gamma);
  return pass;
}

}  // namespace

KvpopLosses compute_kvpop_gradients(WeightProvider& weights, kvpop::Scorers& scorers,
                                    const std::vector<MicroBatch>& micro_batches, const kvpop::StepSettings& settings,
                                    bool margin_weight, dist::Comm& comm, dist::Comm* context_group) {
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
  const auto* tlg = settings.effective_cutoff ? &target_log_gamma : nullptr;
  const bool split = context_group != nullptr && context_group->size() > 1;
  for (const MicroBatch& mb : micro_batches) {
    if (split) {
      passes.push_back(split_teacher_pass(weights, mb, settings, tlg, *context_group));
    } else {
      passes.push_back(kvpop::teacher_pass(weights, mb.ids, mb.doc, settings, tlg));
    }
    sums[0] += static_cast<double>(passes.back().num_decisions);
    sums[1] += passes.back().margin_sum;
    // (the tokens once per group: each context-parallel rank counts a 1/N slice)
    const int64_t T = mb.doc.numel(), r = split ? context_group->rank() : 0, N = split ? context_group->size() : 1;
    for (int64_t t = T * r / N; t < T * (r + 1) / N; ++t) sums[2] += mb.doc.data<int32_t>()[t] >= 0 ? 1.0 : 0.0;
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
