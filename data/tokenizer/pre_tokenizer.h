// The pre-tokenizer of a byte-level tokenizer.json: a sequence of Split steps (a regex or a
// literal, with HF's five delimiter behaviors and `invert`) ending in ByteLevel (optional
// prefix space, optional GPT-2 split). The byte-level mapping itself happens in the BPE.
#pragma once
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "data/tokenizer/regex.h"

namespace retain::data {

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

struct SplitStep {
  std::unique_ptr<Regex> pattern;
  SplitBehavior behavior = SplitBehavior::Isolated;
  bool invert = false;
  bool add_prefix_space = false;  // ByteLevel's: a ' ' before each piece not starting with one
};

// Scratch buffers, reused across calls on one thread.
struct PreTokenizerScratch {
  std::vector<std::string_view> pieces, next;
  std::vector<std::pair<size_t, size_t>> matches;
  std::vector<std::pair<std::pair<size_t, size_t>, bool>> spans;
  std::deque<std::string> owned;  // pieces that gained a prefix space
};

class PreTokenizer {
 public:
  void add_step(SplitStep step) { steps_.push_back(std::move(step)); }
  // The words of `text` (views into `text` or into scratch.owned), in order, none empty.
  const std::vector<std::string_view>& split(std::string_view text, PreTokenizerScratch& scratch) const;

 private:
  void apply(const SplitStep& step, std::string_view piece, PreTokenizerScratch& s) const;
  std::vector<SplitStep> steps_;
};

}  // namespace retain::data
