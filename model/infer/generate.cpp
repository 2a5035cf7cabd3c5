#include "model/infer/generate.h"

#include <algorithm>
#include <chrono>

namespace retain::infer {

GenerateResult generate(Decoder& dec, std::span<const int32_t> prompt, const GenerateOptions& opt) {
  using clock = std::chrono::steady_clock;
  GenerateResult r;
  std::mt19937_64 rng(opt.seed);
  auto t0 = clock::now();
  const int64_t P = static_cast<int64_t>(prompt.size()), total = P + opt.max_new;
  // The prompt in chunks (as Decoder::prefill), reporting after each.
  const size_t step = opt.prefill_chunk > 0 ? static_cast<size_t>(opt.prefill_chunk) : prompt.size();
  Tensor logits;
  for (size_t at = 0; at < prompt.size(); at += step) {
    logits = dec.feed(prompt.subspan(at, std::min(step, prompt.size() - at)), false);
    if (opt.progress) opt.progress(static_cast<int64_t>(std::min(at + step, prompt.size())), total);
  }
  r.prefill_s = std::chrono::duration<double>(clock::now() - t0).count();
  const int64_t V = logits.dim(1);
  const double evict0 = dec.evict_seconds();
  t0 = clock::now();
  while (static_cast<int64_t>(r.generated.size()) < opt.max_new) {
    if (opt.keep_logits) r.logits.insert(r.logits.end(), logits.data<float>(), logits.data<float>() + V);
    const int32_t next = pick_token(logits.data<float>(), V, opt.temperature, rng);
    r.generated.push_back(next);
    if ((opt.stop_id && next == *opt.stop_id) || static_cast<int64_t>(r.generated.size()) == opt.max_new) break;
    logits = dec.feed(std::span(&r.generated.back(), 1));
    ++r.decode_tokens;
    if (opt.progress) opt.progress(P + static_cast<int64_t>(r.generated.size()), total);
  }
  r.decode_s = std::chrono::duration<double>(clock::now() - t0).count();
  r.decode_evict_s = dec.evict_seconds() - evict0;
  return r;
}

}  // namespace retain::infer
