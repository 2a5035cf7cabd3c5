// Byte-level BPE tokenizer read from a Hugging Face tokenizer.json (Qwen3's and the tiny
// model's): NFC normalizer, Split pre-tokenizer (PCRE2, UTF+UCP, JIT), ByteLevel mapping,
// BPE merges by rank, added/special tokens matched before pre-tokenization. Produces the
// ids Hugging Face `tokenizers` produces for the same file and text.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace retain::data {

class Tokenizer {
 public:
  // `path` is a tokenizer.json file or a directory holding one. Throws retain::Error naming
  // the file and the problem (missing file, bad JSON, unsupported feature).
  static Tokenizer load(const std::filesystem::path& path);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Token ids of `text` (no BOS/EOS added). Thread-safe: many threads may encode at once.
  std::vector<int32_t> encode(std::string_view text) const;
  // Appends the ids of `text` to `out`.
  void encode_append(std::string_view text, std::vector<int32_t>& out) const;
  // The text of `ids` (byte-level decode; added tokens as their content). The bytes are
  // returned as they are: a cut through a multi-byte character is not replaced by U+FFFD
  // (HF's decode would; apply sanitize_utf8 to match it). Throws on an unknown id.
  std::string decode(std::span<const int32_t> ids) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // One past the largest id of the vocabulary and the added tokens.
  int64_t vocab_size() const;
  // Lowercase hex SHA-256 of the tokenizer.json bytes.
  const std::string& sha256() const;
  const std::filesystem::path& file() const;

  // Invalid UTF-8 (see data/tokenizer/utf8.h, docs/tokenizer.md): encode replaces each
  // maximal invalid subsequence with U+FFFD, exactly as Python's
  // bytes.decode("utf-8", errors="replace") does, then tokenizes the result.
  // The number of such replacements in `text` (0 for valid UTF-8), for reporting.
  static size_t count_invalid_utf8(std::string_view text);
  // `text` with those replacements made.
  static std::string sanitize_utf8(std::string_view text);

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace retain::data
