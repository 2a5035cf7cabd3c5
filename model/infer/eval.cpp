#include "model/infer/eval.h"

#include <algorithm>
#include <cmath>
#include <exception>

#include <nlohmann/json.hpp>

#include "data/packed_dataset.h"
#include "kernels/ops.h"
#include "model/qwen3.h"

namespace retain::infer {

namespace {

// log-softmax of one row, in float64.
void log_softmax(const float* x, int64_t V, std::vector<double>& out) {
  out.resize(static_cast<size_t>(V));
  double mx = -INFINITY;
  for (int64_t i = 0; i < V; ++i) mx = std::max(mx, static_cast<double>(x[i]));
  double z = 0;
  for (int64_t i = 0; i < V; ++i) z += std::exp(static_cast<double>(x[i]) - mx);
  const double lz = mx + std::log(z);
  for (int64_t i = 0; i < V; ++i) out[i] = static_cast<double>(x[i]) - lz;
}

int64_t argmax(const std::vector<double>& v) { return std::max_element(v.begin(), v.end()) - v.begin(); }

// oracle-m's targets for the whole teacher-forced sequence `ids` (none for other policies).
std::optional<OracleScores> oracle_for(WeightProvider& weights, const EvalRun& r, const kvpop::Scorers* scorers,
                                       std::span<const int32_t> ids) {
  if (r.policy != PolicyKind::oracle_m) return std::nullopt;
  if (!scorers)
    fail("--policy oracle-m takes the window, sinks and decay of KVPOP scorers: give --gates FILE (a kvpop scorer file)");
  return oracle_scores(weights, ids, *scorers);
}

PolicyOptions policy_options(const EvalRun& r, const EvalOptions& opt) {
  PolicyOptions p;
  p.kind = r.policy, p.budget = r.budget, p.buffer = opt.buffer, p.lookahead = opt.lookahead;
  return p;
}

// Accumulates what every run reports.
struct Totals {
  double nll = 0, kl = 0, top1 = 0, correct = 0, cache = 0, feed_s = 0, evict_s = 0;
  int64_t tokens = 0, samples = 0, forwards = 0, fed = 0;
  void add_decoder(const Decoder& d, double cache_sum, int64_t forwards_) {
    feed_s += d.feed_seconds(), evict_s += d.evict_seconds(), fed += d.seen();
    cache += cache_sum, forwards += forwards_;
  }
  void add(const Totals& o) {
    nll += o.nll, kl += o.kl, top1 += o.top1, correct += o.correct, cache += o.cache, feed_s += o.feed_s;
    evict_s += o.evict_s, tokens += o.tokens, samples += o.samples, forwards += o.forwards, fed += o.fed;
  }
  EvalResult result(const EvalRun& run) const {
    EvalResult r;
    r.run = run, r.tokens = tokens, r.samples = samples;
    const double n = static_cast<double>(std::max<int64_t>(tokens, 1));
    r.nll = nll / n, r.kl = kl / n, r.top1 = top1 / n;
    r.accuracy = correct / static_cast<double>(std::max<int64_t>(samples, 1));
    r.mean_cache = cache / static_cast<double>(std::max<int64_t>(forwards, 1));
    r.tokens_per_s = static_cast<double>(fed) / std::max(feed_s, 1e-12);
    r.evict_fraction = evict_s / std::max(feed_s, 1e-12);
    return r;
  }
};

double mean_entries(const KVCache& c) {
  return static_cast<double>(c.total()) / static_cast<double>(c.layers() * c.kv_heads());
}

}  // namespace

std::vector<EvalResult> evaluate_data(WeightProvider& weights, const gates::RetentionGates* gates,
                                      const data::PackedDataset& ds, const std::vector<EvalRun>& runs,
                                      const EvalOptions& opt, const kvpop::Scorers* scorers) {
  for (const EvalRun& r : runs) make_policy(policy_options(r, opt));  // every error before any work
  const int64_t n = opt.max_sequences > 0 ? std::min(opt.max_sequences, ds.num_sequences()) : ds.num_sequences();
  const int64_t V = weights.config().vocab_size;
  // The documents: contiguous runs of one doc id (padding skipped), with their target masks.
  struct Doc {
    std::vector<int32_t> ids;
    std::vector<uint8_t> target;
  };
  std::vector<Doc> docs;
  for (int64_t i = 0; i < n; ++i) {
    const data::PackedSequence s = ds.read(i);
    for (size_t t = 0; t < s.input_ids.size();) {
      size_t e = t;
      while (e < s.input_ids.size() && s.doc_ids[e] == s.doc_ids[t]) ++e;
      if (s.doc_ids[t] >= 0 && e - t >= 2)
        docs.push_back({std::vector<int32_t>(s.input_ids.begin() + t, s.input_ids.begin() + e),
                        std::vector<uint8_t>(s.target_mask.begin() + t, s.target_mask.begin() + e)});
      t = e;
    }
  }
  if (docs.empty()) fail("{}: no document of 2 or more tokens in the first {} sequences", ds.path().string(), n);

  std::vector<Totals> totals(runs.size());
  const int64_t units = static_cast<int64_t>(docs.size() * runs.size());
  int64_t done = 0;
  std::vector<double> lp, lq;
  for (const Doc& doc : docs) {
    const int64_t T = static_cast<int64_t>(doc.ids.size());
    // The full-cache model: the plain forward (model/qwen3.cpp), its final hidden state kept and
    // multiplied by lm_head a chunk at a time below, never a [T, V] buffer per document.
    const Tensor ids_t = Tensor::from_vector(doc.ids, {T});
    const Tensor hidden = qwen3_hidden(weights, ids_t, Tensor::zeros({T}, DType::I32));
    for (size_t r = 0; r < runs.size(); ++r) {
      const kvpop::Scorers* sc = runs[r].scorers ? runs[r].scorers : scorers;
      const std::optional<OracleScores> oracle = oracle_for(weights, runs[r], sc, doc.ids);
      Decoder dec(weights, runs[r].gates ? runs[r].gates : gates, policy_options(runs[r], opt), sc,
                  oracle ? &*oracle : nullptr);
      Totals& tot = totals[r];
      double cache_sum = 0;
      int64_t forwards = 0;
      for (int64_t at = 0; at < T; at += opt.prefill_chunk) {
        const int64_t m = std::min(opt.prefill_chunk, T - at);
        const Tensor q = dec.feed(std::span(doc.ids).subspan(static_cast<size_t>(at), static_cast<size_t>(m)), true);
        cache_sum += mean_entries(dec.cache()), ++forwards;
        Tensor p = Tensor::empty({m, V}, DType::F32);
        ops::linear(hidden.rows(at, at + m), weights.lm_head(), p);
        for (int64_t j = 0; j < m; ++j) {
          const int64_t t = at + j;
          if (t + 1 >= T || !doc.target[static_cast<size_t>(t + 1)]) continue;  // DESIGN §4 loss positions
          log_softmax(q.data<float>() + j * V, V, lq);
          log_softmax(p.data<float>() + j * V, V, lp);
          double kl = 0;
          for (int64_t v = 0; v < V; ++v) kl += std::exp(lp[v]) * (lp[v] - lq[v]);
          tot.kl += kl;
          tot.nll -= lq[static_cast<size_t>(doc.ids[static_cast<size_t>(t + 1)])];
          tot.top1 += argmax(lq) == argmax(lp);
          ++tot.tokens;
        }
      }
      tot.add_decoder(dec, cache_sum, forwards);
      ++tot.samples;
      if (opt.progress) opt.progress(++done, units);
    }
  }
  std::vector<EvalResult> out;
  for (size_t r = 0; r < runs.size(); ++r) out.push_back(totals[r].result(runs[r]));
  return out;
}

std::vector<EvalResult> evaluate_recall(WeightProvider& weights, const gates::RetentionGates* gates,
                                        const RecallSpec& spec, const std::vector<EvalRun>& runs,
                                        const EvalOptions& opt, const kvpop::Scorers* scorers) {
  for (const EvalRun& r : runs) make_policy(policy_options(r, opt));
  const std::vector<RecallSample> task = make_recall_task(spec);
  const int64_t V = weights.config().vocab_size;
  // One unit = one sample under one run, each with its own decoder: units run on OpenMP's
  // threads (the weights are read-only), and their totals are summed in a fixed order after, so
  // the numbers do not depend on the thread count.
  const int64_t R = static_cast<int64_t>(runs.size());
  const int64_t units = static_cast<int64_t>(task.size()) * R;
  std::vector<Totals> parts(static_cast<size_t>(units));
  int64_t done = 0;
  std::exception_ptr error;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t u = 0; u < units; ++u) {
    if (error) continue;  // a racy read is fine: it only skips work after a failure
    try {
      const RecallSample& s = task[static_cast<size_t>(u / R)];
      const EvalRun& run = runs[static_cast<size_t>(u % R)];
      const kvpop::Scorers* sc = run.scorers ? run.scorers : scorers;
      // oracle-m: the targets of the whole sequence the decoder is teacher-forced through.
      std::vector<int32_t> whole = s.prompt;
      whole.insert(whole.end(), s.answer.begin(), s.answer.end());
      const std::optional<OracleScores> oracle = oracle_for(weights, run, sc, whole);
      Decoder dec(weights, run.gates ? run.gates : gates, policy_options(run, opt), sc, oracle ? &*oracle : nullptr);
      Totals& tot = parts[static_cast<size_t>(u)];
      std::vector<double> lq;
      double cache_sum = 0;
      int64_t forwards = 0;
      Tensor logits;
      for (size_t at = 0; at < s.prompt.size(); at += static_cast<size_t>(opt.prefill_chunk)) {
        const size_t m = std::min(static_cast<size_t>(opt.prefill_chunk), s.prompt.size() - at);
        logits = dec.feed(std::span(s.prompt).subspan(at, m));
        cache_sum += mean_entries(dec.cache()), ++forwards;
      }
      // Teacher-forced answer: exact match under greedy decoding is "every argmax is right"
      // (while they are, greedy feeds exactly these tokens).
      bool exact = true;
      for (size_t j = 0; j < s.answer.size(); ++j) {
        log_softmax(logits.data<float>(), V, lq);
        tot.nll -= lq[static_cast<size_t>(s.answer[j])];
        exact = exact && argmax(lq) == s.answer[j];
        ++tot.tokens;
        if (j + 1 < s.answer.size()) {
          logits = dec.feed(std::span(s.answer).subspan(j, 1));
          cache_sum += mean_entries(dec.cache()), ++forwards;
        }
      }
      tot.correct += exact;
      tot.add_decoder(dec, cache_sum, forwards);
      ++tot.samples;
#pragma omp critical(retain_eval_progress)
      if (opt.progress) opt.progress(++done, units);
    } catch (...) {
#pragma omp critical(retain_eval_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  std::vector<Totals> totals(runs.size());
  for (int64_t u = 0; u < units; ++u) totals[static_cast<size_t>(u % R)].add(parts[static_cast<size_t>(u)]);
  std::vector<EvalResult> out;
  for (size_t r = 0; r < runs.size(); ++r) out.push_back(totals[r].result(runs[r]));
  return out;
}

nlohmann::json result_json(const EvalResult& r, bool recall) {
  nlohmann::json j;
  j["policy"] = policy_name(r.run.policy);
  j["budget"] = r.run.policy == PolicyKind::full ? nlohmann::json(nullptr) : nlohmann::json(r.run.budget);
  j["nll"] = r.nll;
  j["perplexity"] = std::exp(r.nll);
  if (recall) {
    j["accuracy"] = r.accuracy;
  } else {
    j["kl"] = r.kl;
    j["top1_agreement"] = r.top1;
  }
  j["tokens"] = r.tokens;
  j["samples"] = r.samples;
  j["mean_cache_per_head"] = r.mean_cache;
  j["tokens_per_s"] = r.tokens_per_s;
  j["eviction_share"] = r.evict_fraction;
  return j;
}

}  // namespace retain::infer
