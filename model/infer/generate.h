// Text generation with a bounded cache: prefill, then one token per forward (DESIGN §7
// retain-generate). The result carries what --json writes.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "model/infer/decoder.h"

namespace retain::infer {

struct GenerateOptions {
  int64_t max_new = 32;
  int64_t prefill_chunk = 0;        // 0: the whole prompt in one forward (as the reference)
  double temperature = 0;           // ≤ 0: greedy
  uint64_t seed = 0;                // sampling seed
  std::optional<int32_t> stop_id;   // stop after generating it (EOS)
  bool keep_logits = false;         // record the logits each token was chosen from
  // Called after every forward with the tokens processed so far and the most there can be
  // (prompt + max_new): progress reporting.
  std::function<void(int64_t done, int64_t total)> progress;
};

struct GenerateResult {
  std::vector<int32_t> generated;
  double prefill_s = 0, decode_s = 0;  // wall time of the prefill and of the decode forwards
  double decode_evict_s = 0;           // of decode_s: eviction (selection + compaction)
  int64_t decode_tokens = 0;           // forwards after the prefill
  std::vector<float> logits;           // [generated, V] when keep_logits
};

// Generates after `prompt`. The cache afterwards is the one after the last forward: the one
// that produced the last generated token (the last token is not fed back).
GenerateResult generate(Decoder& dec, std::span<const int32_t> prompt, const GenerateOptions& opt);

}  // namespace retain::infer
