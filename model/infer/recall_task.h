// A synthetic long-context recall task over a model's token ids (no tokenizer needed), for
// evaluating bounded caches and, later, for pretraining small models that can recall.
//
// A sample is `context` filler tokens with `pairs` key–value records inserted at random,
// non-overlapping places, then a query for one of the keys:
//
//   … filler … PAIR k₁…k_K ARROW v₁…v_W … filler … PAIR k'… ARROW v'… … filler … QUERY k₁…k_K ARROW  → v₁…v_W
//
// With `queries` > 1 the prompt first asks queries − 1 other keys, each answered in the prompt
// (QUERY k ARROW v), and the answer is that of the last query: several keys queried at the end,
// as in the pretraining mixture; `answer_starts` says where the earlier answers are.
//
// Token ids (V = the vocabulary size, hi = min(V, content_limit); retain-eval lowers
// content_limit to the model's first special token (bos/eos id ≥ 16), so that no special token is
// ever content — the built-in model's <|endoftext|> is 256, giving hi = 256):
//   PAIR = 1, ARROW = 2, QUERY = 3 (fixed markers);
//   keys and values: uniform from [16, 16 + R), R = (hi − 16) / 2;
//   filler: uniform from [16 + R, hi)  (disjoint from keys/values, so only records hold them).
// Keys are distinct within a sample; the queried record is uniform over the records, so its
// depth (tokens between it and the query) is uniform too; further queries ask other records. Everything comes from one
// std::mt19937_64(seed) drawn in a fixed order (see recall_task.cpp), so a seed names a task.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace retain::infer {

struct RecallSpec {
  int64_t vocab = 0;             // the model's vocabulary size (≥ 64)
  int64_t samples = 32;
  int64_t context = 512;         // filler + records, before the query
  int64_t pairs = 8;
  int64_t queries = 1;           // ≤ pairs; the last one is scored
  int64_t key_len = 2, value_len = 2;
  int64_t content_limit = 32768; // ids above stay unused (large vocabularies end in special tokens)
  uint64_t seed = 0;
};

inline constexpr int32_t kRecallPair = 1, kRecallArrow = 2, kRecallQuery = 3, kRecallFirstContent = 16;

struct RecallSample {
  std::vector<int32_t> prompt;  // context + (QUERY key ARROW value) × (queries − 1) + QUERY key ARROW
  std::vector<int32_t> answer;  // the last query's value (value_len tokens)
  std::vector<int64_t> answer_starts;  // prompt positions of the earlier queries' values
  int64_t depth = 0;            // prompt tokens after the last queried record's last value token
};

// Fails (one line) when the spec cannot be met: vocab too small, records that do not fit the
// context, fewer distinct keys than pairs.
std::vector<RecallSample> make_recall_task(const RecallSpec& spec);
// The spec as one line: "recall: 32 samples, context 512, 8 pairs, key 2, value 2, seed 0"
// (", 4 queries" before the seed when there are several; ", content ids [16, 256)" when the limit
// is below the vocabulary).
std::string describe(const RecallSpec& spec);

}  // namespace retain::infer
