// Quality of bounded-KV decoding (DESIGN §7 retain-eval): for each policy and budget, the
// model is fed a text token by token (or in chunks) through the Decoder, evicting as
// generation would (oracle-m: with the targets of the whole document or sample, prompt and
// answer, from a dense teacher pass first; oracle.h), and its predictions are scored —
//   data:   NLL of the target tokens, KL(full-cache model ‖ bounded model) and top-1 agreement
//           with the full-cache model, over the loss positions of DESIGN §4;
//   recall: exact-match accuracy and NLL of the answers of the synthetic recall task.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "model/infer/decoder.h"
#include "model/infer/oracle.h"
#include "model/infer/recall_task.h"

namespace retain::data {
class PackedDataset;
}

namespace retain::infer {

struct EvalRun {
  PolicyKind policy;
  int64_t budget = 0;  // 0 for full
  // This run's own gates or scorers (retain-eval --gates POLICY=FILE); null: the call's.
  const gates::RetentionGates* gates = nullptr;
  const kvpop::Scorers* scorers = nullptr;
};

struct EvalResult {
  EvalRun run;
  int64_t tokens = 0;        // scored predictions
  double nll = 0;            // mean −log q(target)
  double kl = 0;             // data: mean KL(p_full ‖ q)
  double top1 = 0;           // data: fraction with argmax q = argmax p_full
  double accuracy = 0;       // recall: exact-match fraction
  int64_t samples = 0;       // documents (data) or samples (recall)
  double mean_cache = 0;     // mean over forwards of the entries per (layer, KV head)
  double tokens_per_s = 0;   // decoder tokens fed per second
  double evict_fraction = 0; // eviction time / forward time
};

struct EvalOptions {
  int64_t prefill_chunk = 1;  // tokens per forward (1: every token as in generation)
  int64_t buffer = 1;
  int64_t lookahead = 1;      // trimkv, dbtrimkv: (q + lookahead − i)·logβ_i (PolicyOptions::lookahead)
  int64_t max_sequences = 16; // data: the first N sequences of the file (0: all)
  // Called after each unit of work (one run over one document or sample): done, total.
  std::function<void(int64_t, int64_t)> progress;
};

std::vector<EvalResult> evaluate_data(WeightProvider& weights, const gates::RetentionGates* gates,
                                      const data::PackedDataset& ds, const std::vector<EvalRun>& runs,
                                      const EvalOptions& opt, const kvpop::Scorers* scorers = nullptr);
std::vector<EvalResult> evaluate_recall(WeightProvider& weights, const gates::RetentionGates* gates,
                                        const RecallSpec& spec, const std::vector<EvalRun>& runs, const EvalOptions& opt,
                                        const kvpop::Scorers* scorers = nullptr);

// One results[] entry of metrics.json (DESIGN §7): policy, budget (null for full), nll,
// perplexity, tokens, samples, and kl + top1_agreement (data) or accuracy (recall), plus the
// mean cache size, tokens/s and the eviction share.
nlohmann::json result_json(const EvalResult& r, bool recall);

}  // namespace retain::infer
