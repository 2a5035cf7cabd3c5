// A PCRE2 pattern (8-bit, UTF + UCP, JIT-compiled) standing in for the Oniguruma patterns
// of Hugging Face `tokenizers`. Compiled once, then matched concurrently from any thread.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace retain::data {

class Regex {
 public:
  // Throws retain::Error "<where>: <pattern>: <PCRE2 message>" on a bad pattern.
  Regex(const std::string& pattern, const std::string& where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends the [start, end) byte ranges of the successive non-overlapping matches in
  // `subject` (valid UTF-8), leftmost first, as the Rust `onig` crate's find_iter (used by
  // HF tokenizers) yields them: an empty match where the previous match ended is skipped.
  void find_all(std::string_view subject, std::vector<std::pair<size_t, size_t>>& out) const;
  // Whether the pattern matches somewhere in `subject`.
  bool search(std::string_view subject) const;

  // Oniguruma's \s is Unicode's White_Space; PCRE2's differs (U+0085, U+180E), so \s and
  // \S (outside character classes) are rewritten as explicit White_Space classes; \h and
  // \H are Oniguruma's hex digit classes. (\w, \b keep PCRE2's UCP meaning, which differs
  // from Oniguruma's on a few characters; no supported tokenizer uses them.)
  static std::string onig_to_pcre2(std::string_view pattern);
  // A pattern matching `literal` verbatim.
  static std::string escape(std::string_view literal);

 private:
  struct Code;
  std::unique_ptr<Code> code_;
  std::string where_;
};

}  // namespace retain::data
