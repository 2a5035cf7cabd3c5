// Added (special) tokens, found in the text before pre-tokenization the way HF `tokenizers`
// finds them: leftmost-longest matching, then the single_word test and lstrip/rstrip
// widening of each match. Two matchers exist per tokenizer: tokens with normalized=false
// match the raw text; tokens with normalized=true match the normalized pieces.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer/regex.h"

namespace retain::data {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
};

// A piece of text: either an added token (id >= 0) or text to tokenize (id < 0).
struct Piece {
  size_t begin = 0, end = 0;
  int32_t id = -1;
};

class AddedTokenMatcher {
 public:
  // `patterns[i]` is the text that token `tokens[i]` matches (its content, normalized for
  // normalized tokens).
  AddedTokenMatcher(std::vector<const AddedToken*> tokens, std::vector<std::string> patterns);
  bool empty() const { return tokens_.empty(); }
  // Appends the pieces of text[0, size) (offsets shifted by `base`), covering all of it.
  void split(std::string_view text, size_t base, std::vector<Piece>& out) const;

 private:
  std::vector<const AddedToken*> tokens_;
  std::vector<std::string> patterns_;
  std::array<std::vector<uint32_t>, 256> by_first_byte_;  // pattern indices, longest first
  std::unique_ptr<Regex> word_char_;                      // only when a token is single_word
};

}  // namespace retain::data
