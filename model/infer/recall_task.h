// A synthetic long-context recall task over a model's token ids (no tokenizer needed), for
// evaluating bounded caches and, later, for pretraining small models that can recall.
//
// A sample is `context` filler tokens with `pairs` key–value records inserted at random,
// non-overlapping places, then a query for one of the keys:
//
//   … filler … PAIR k₁…k_K ARROW v₁…v_W … filler … PAIR k'… ARROW v'… … filler … QUERY k₁…k_K ARROW  → v₁…v_W
//
// Token ids (V = the vocabulary size, hi = min(V, content_limit)):
//   PAIR = 1, ARROW = 2, QUERY = 3 (fixed markers);
//   keys and values: uniform from [16, 16 + R), R = (hi − 16) / 2;
//   filler: uniform from [16 + R, hi)  (disjoint from keys/values, so only records hold them).
// Keys are distinct within a sample; the queried record is uniform over the records, so its
// depth (tokens between it and the query) is uniform too. Everything comes from one
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
  int64_t key_len = 2, value_len = 2;
  int64_t content_limit = 32768; // ids above stay unused (large vocabularies end in special tokens)
  uint64_t seed = 0;
};

inline constexpr int32_t kRecallPair = 1, kRecallArrow = 2, kRecallQuery = 3, kRecallFirstContent = 16;

struct RecallSample {
  std::vector<int32_t> prompt;  // context + QUERY key ARROW
  std::vector<int32_t> answer;  // the value (value_len tokens)
  int64_t depth = 0;            // prompt tokens after the queried record's last value token
};

// Fails (one line) when the spec cannot be met: vocab too small, records that do not fit the
// context, fewer distinct keys than pairs.
std::vector<RecallSample> make_recall_task(const RecallSpec& spec);
// The spec as one line: "recall: 32 samples, context 512, 8 pairs, key 2, value 2, seed 0".
std::string describe(const RecallSpec& spec);

}  // namespace retain::infer
