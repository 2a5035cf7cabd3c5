#include "data/tokenizer/added_tokens.h"

#include <algorithm>
#include <cstring>

#include "data/tokenizer/utf8.h"

namespace retain::data {

namespace {

// Rust regex's \s: the Unicode White_Space property.
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

size_t previous_char_start(std::string_view s, size_t end) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

// Start of the run of white space that ends s[0, end).
size_t white_space_run_start(std::string_view s, size_t end) {
  while (end > 0) {
    size_t start = previous_char_start(s, end), i = start;
    if (!is_white_space(utf8::next_code_point(s, i))) break;
    end = start;
  }
  return end;
}

// End of the run of white space starting at s[begin].
size_t white_space_run_end(std::string_view s, size_t begin) {
  while (begin < s.size()) {
    size_t i = begin;
    if (!is_white_space(utf8::next_code_point(s, i))) break;
    begin = i;
  }
  return begin;
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(std::vector<const AddedToken*> tokens, std::vector<std::string> patterns)
    : tokens_(std::move(tokens)), patterns_(std::move(patterns)) {
  for (uint32_t i = 0; i < patterns_.size(); ++i) {
    if (patterns_[i].empty()) continue;
    by_first_byte_[static_cast<unsigned char>(patterns_[i][0])].push_back(i);
    if (tokens_[i]->single_word && !word_char_)  // Rust regex's \w, as HF's single_word test uses
      word_char_ = std::make_unique<Regex>(R"(^[\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}])", "single_word");
  }
  for (auto& list : by_first_byte_)
    std::stable_sort(list.begin(), list.end(),
                     [&](uint32_t a, uint32_t b) { return patterns_[a].size() > patterns_[b].size(); });
}

void AddedTokenMatcher::split(std::string_view text, size_t base, std::vector<Piece>& out) const {
  const auto is_word_char_at = [&](size_t pos) {
    size_t i = pos;
    utf8::next_code_point(text, i);
    return word_char_->search(text.substr(pos, i - pos));
  };
  size_t done = 0;  // end of the last emitted piece
  size_t pos = 0;   // where the search for the next match resumes
  while (pos < text.size()) {
    // Leftmost-longest: the first position where some pattern matches, its longest pattern.
    size_t start = pos;
    uint32_t found = UINT32_MAX;
    for (; start < text.size() && found == UINT32_MAX; ++start) {
      for (uint32_t k : by_first_byte_[static_cast<unsigned char>(text[start])]) {
        const std::string& p = patterns_[k];
        if (p.size() <= text.size() - start && std::memcmp(text.data() + start, p.data(), p.size()) == 0) {
          found = k;
          break;
        }
      }
      if (found != UINT32_MAX) break;
    }
    if (found == UINT32_MAX) break;
    size_t stop = start + patterns_[found].size();
    pos = stop;
    const AddedToken& tok = *tokens_[found];
    if (tok.single_word) {
      const bool space_before = start == 0 || !is_word_char_at(previous_char_start(text, start));
      const bool space_after = stop == text.size() || !is_word_char_at(stop);
      if (!space_before || !space_after) continue;
    }
    if (tok.lstrip) start = std::max(white_space_run_start(text, start), done);
    if (tok.rstrip) stop = white_space_run_end(text, stop);
    if (done < start) out.push_back({base + done, base + start, -1});
    out.push_back({base + start, base + stop, tok.id});
    done = stop;
  }
  if (done < text.size() || text.empty()) out.push_back({base + done, base + text.size(), -1});
}

}  // namespace retain::data
