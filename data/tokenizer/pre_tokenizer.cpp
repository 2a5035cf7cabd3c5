#include "data/tokenizer/pre_tokenizer.h"

#include <algorithm>

namespace retain::data {

const std::vector<std::string_view>& PreTokenizer::split(std::string_view text, PreTokenizerScratch& s) const {
  s.pieces.clear();
  s.owned.clear();
  if (!text.empty()) s.pieces.push_back(text);
  for (const SplitStep& step : steps_) {
    s.next.clear();
    for (std::string_view piece : s.pieces) apply(step, piece, s);
    std::swap(s.pieces, s.next);
  }
  return s.pieces;
}

// One step on one piece, appending to s.next. Follows NormalizedString::split of HF
// tokenizers: the matches and the gaps between them cover the piece; the behavior decides
// which are kept and what is glued together; empty results are dropped.
void PreTokenizer::apply(const SplitStep& step, std::string_view piece, PreTokenizerScratch& s) const {
  if (step.add_prefix_space && piece.front() != ' ') {
    std::string& with_space = s.owned.emplace_back(piece.size() + 1, ' ');
    piece.copy(with_space.data() + 1, piece.size());
    piece = with_space;
  }
  if (!step.pattern) {
    s.next.push_back(piece);
    return;
  }
  s.matches.clear();
  step.pattern->find_all(piece, s.matches);
  auto& spans = s.spans;  // ((begin, end), is_match) covering the piece
  spans.clear();
  size_t prev = 0;
  for (const auto& [b, e] : s.matches) {
    if (prev != b) spans.push_back({{prev, b}, false});
    spans.push_back({{b, e}, true});
    prev = e;
  }
  if (prev != piece.size()) spans.push_back({{prev, piece.size()}, false});
  if (step.invert)
    for (auto& sp : spans) sp.second = !sp.second;

  const auto emit = [&](size_t b, size_t e) {
    if (e > b) s.next.push_back(piece.substr(b, e - b));
  };
  // Merging works on (begin, end) spans of this piece, kept in `out` until the end.
  std::vector<std::pair<size_t, size_t>> out;
  out.reserve(spans.size());
  bool previous_match = false;
  switch (step.behavior) {
    case SplitBehavior::Isolated:
      for (const auto& sp : spans) out.push_back(sp.first);
      break;
    case SplitBehavior::Removed:
      for (const auto& sp : spans)
        if (!sp.second) out.push_back(sp.first);
      break;
    case SplitBehavior::MergedWithPrevious:
      for (const auto& [off, m] : spans) {
        if (m && !previous_match && !out.empty()) out.back().second = off.second;
        else out.push_back(off);
        previous_match = m;
      }
      break;
    case SplitBehavior::MergedWithNext:
      for (size_t k = spans.size(); k-- > 0;) {
        const auto& [off, m] = spans[k];
        if (m && !previous_match && !out.empty()) out.back().first = off.first;
        else out.push_back(off);
        previous_match = m;
      }
      std::reverse(out.begin(), out.end());
      break;
    case SplitBehavior::Contiguous:
      for (const auto& [off, m] : spans) {
        if (m == previous_match && !out.empty()) out.back().second = off.second;
        else out.push_back(off);
        previous_match = m;
      }
      break;
  }
  for (const auto& [b, e] : out) emit(b, e);
}

}  // namespace retain::data
