// UTF-8 helpers of the tokenizer: validation, the invalid-byte rule, code point decoding.
//
// Invalid UTF-8 rule: every maximal invalid subsequence (the longest prefix of a
// well-formed sequence that cannot be completed, or else a single bad byte) becomes one
// U+FFFD, exactly like Python's `bytes.decode("utf-8", errors="replace")` and Rust's
// `String::from_utf8_lossy` (Unicode §3.9 "substitution of maximal subparts"). So a
// Python script reproduces the tokenizer's ids with tokenizer.encode(b.decode(errors="replace")).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace retain::data::utf8 {

// Length of the well-formed sequence starting at s[i], or 0 if it is not well formed.
// When 0, *bad_len (if given) receives the length of the maximal invalid subpart (>= 1).
size_t valid_sequence_length(std::string_view s, size_t i, size_t* bad_len = nullptr);

// Number of maximal invalid subsequences (each becomes one U+FFFD); 0 for valid UTF-8.
size_t count_invalid(std::string_view s);

// `s` with each maximal invalid subsequence replaced by U+FFFD (a copy of s if valid).
std::string sanitize(std::string_view s);

// Decodes the (well-formed) code point at s[i] and advances i past it.
char32_t next_code_point(std::string_view s, size_t& i);

// Appends the UTF-8 encoding of code point cp.
void append(std::string& out, char32_t cp);

}  // namespace retain::data::utf8
