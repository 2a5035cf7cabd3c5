#include "model/infer/recall_task.h"

#include <algorithm>
#include <random>
#include <set>

#include <fmt/format.h>

#include "kernels/base/error.h"

namespace retain::infer {

namespace {

// Uniform in [lo, hi) from the raw generator (no std:: distribution, whose algorithm is
// implementation-defined: the same seed must give the same task everywhere). The modulo bias
// is below 2^-40 for any range used here.
int64_t uniform(std::mt19937_64& rng, int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo)); }

}  // namespace

std::string describe(const RecallSpec& s) {
  std::string d = fmt::format("recall: {} samples, context {}, {} pairs, key {}, value {}", s.samples, s.context,
                              s.pairs, s.key_len, s.value_len);
  if (s.queries != 1) d += fmt::format(", {} queries", s.queries);
  if (s.content_limit < s.vocab) d += fmt::format(", content ids [{}, {})", kRecallFirstContent, s.content_limit);
  return d + fmt::format(", seed {}", s.seed);
}

std::vector<RecallSample> make_recall_task(const RecallSpec& s) {
  const int64_t hi = std::min(s.vocab, s.content_limit);
  if (hi < 64) fail("--task recall: the vocabulary ({} ids usable) is too small; need at least 64", hi);
  if (s.samples < 1 || s.pairs < 1 || s.key_len < 1 || s.value_len < 1 || s.queries < 1)
    fail("--task recall: samples, pairs, queries, key and value lengths must be >= 1");
  if (s.queries > s.pairs) fail("--task recall: {} queries ask more keys than the {} pairs hold", s.queries, s.pairs);
  const int64_t record = 2 + s.key_len + s.value_len;
  if (s.pairs * record > s.context)
    fail("--task recall: {} records of {} tokens do not fit a context of {}", s.pairs, record, s.context);
  const int64_t R = (hi - kRecallFirstContent) / 2;
  double keyspace = 1;
  for (int64_t i = 0; i < s.key_len; ++i) keyspace *= static_cast<double>(R);
  if (keyspace < static_cast<double>(s.pairs)) fail("--task recall: fewer distinct keys than pairs");

  std::mt19937_64 rng(s.seed);
  std::vector<RecallSample> out;
  for (int64_t n = 0; n < s.samples; ++n) {
    // 1. the records: distinct keys, then values.
    std::vector<std::vector<int32_t>> keys, values;
    std::set<std::vector<int32_t>> seen;
    while (static_cast<int64_t>(keys.size()) < s.pairs) {
      std::vector<int32_t> k(static_cast<size_t>(s.key_len));
      for (int32_t& x : k) x = static_cast<int32_t>(uniform(rng, kRecallFirstContent, kRecallFirstContent + R));
      if (seen.insert(k).second) keys.push_back(k);
    }
    for (int64_t p = 0; p < s.pairs; ++p) {
      std::vector<int32_t> v(static_cast<size_t>(s.value_len));
      for (int32_t& x : v) x = static_cast<int32_t>(uniform(rng, kRecallFirstContent, kRecallFirstContent + R));
      values.push_back(v);
    }
    // 2. where they go: choose `pairs` of the filler slots (stars and bars: the records split
    //    the filler into pairs + 1 runs), in record order.
    const int64_t filler = s.context - s.pairs * record;
    std::vector<int64_t> cuts(static_cast<size_t>(s.pairs));
    for (int64_t& c : cuts) c = uniform(rng, 0, filler + 1);
    std::sort(cuts.begin(), cuts.end());
    // 3. the context.
    RecallSample smp;
    std::vector<int64_t> record_end(static_cast<size_t>(s.pairs));
    int64_t written_filler = 0;
    for (int64_t p = 0; p <= s.pairs; ++p) {
      const int64_t until = p < s.pairs ? cuts[p] : filler;
      for (; written_filler < until; ++written_filler)
        smp.prompt.push_back(static_cast<int32_t>(uniform(rng, kRecallFirstContent + R, hi)));
      if (p == s.pairs) break;
      smp.prompt.push_back(kRecallPair);
      smp.prompt.insert(smp.prompt.end(), keys[p].begin(), keys[p].end());
      smp.prompt.push_back(kRecallArrow);
      smp.prompt.insert(smp.prompt.end(), values[p].begin(), values[p].end());
      record_end[p] = static_cast<int64_t>(smp.prompt.size());
    }
    // 4. the queries: distinct records (the first drawn as a one-query task draws it, so
    //    --queries 1 gives the tasks it always gave); all but the last answered in the prompt.
    std::vector<int64_t> asked{uniform(rng, 0, s.pairs)};
    while (static_cast<int64_t>(asked.size()) < s.queries) {
      const int64_t q = uniform(rng, 0, s.pairs);
      if (std::find(asked.begin(), asked.end(), q) == asked.end()) asked.push_back(q);
    }
    std::reverse(asked.begin(), asked.end());  // the first drawn is asked last and scored
    for (size_t i = 0; i < asked.size(); ++i) {
      const int64_t q = asked[i];
      smp.prompt.push_back(kRecallQuery);
      smp.prompt.insert(smp.prompt.end(), keys[q].begin(), keys[q].end());
      smp.prompt.push_back(kRecallArrow);
      if (i + 1 < asked.size()) {
        smp.answer_starts.push_back(static_cast<int64_t>(smp.prompt.size()));
        smp.prompt.insert(smp.prompt.end(), values[q].begin(), values[q].end());
      }
    }
    smp.answer = values[asked.back()];
    smp.depth = static_cast<int64_t>(smp.prompt.size()) - record_end[asked.back()];
    out.push_back(std::move(smp));
  }
  return out;
}

}  // namespace retain::infer
