// The BPE model of a byte-level tokenizer.json: vocabulary, merges by rank, and the merge
// of one pre-tokenized word (a min-heap of candidate pairs over a linked list of symbols,
// so a word of n bytes costs O(n log n), never a rescan per merge).
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace retain::data {

struct BpeOptions {
  std::optional<std::string> unk_token;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  std::string continuing_subword_prefix;
  std::string end_of_word_suffix;
};

class Bpe {
 public:
  // Vocabulary ids must be below this (one table slot per id; see the constructor).
  static constexpr int32_t kMaxVocabId = int32_t{1} << 24;
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using Vocab = std::unordered_map<std::string, int32_t, Hash, std::equal_to<>>;

  // `where` prefixes error messages (the file name). Throws retain::Error when a merge
  // names a token that is not in the vocabulary, the unk token is missing, or an id is
  // negative or ≥ kMaxVocabId.
  Bpe(Vocab vocab, const std::vector<std::pair<std::string_view, std::string_view>>& merges, BpeOptions options,
      const std::string& where);

  // Appends the ids of one word, given as raw bytes (mapped to the byte-level alphabet here).
  void encode_word(std::string_view bytes, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The vocabulary token of `id`, or nullptr.
  const std::string* id_to_token(int32_t id) const;
  int64_t max_id() const { return static_cast<int64_t>(id_to_token_.size()) - 1; }
  // Number of vocabulary entries (HF's get_vocab_size, which assigns added-token ids).
  int64_t entries() const { return static_cast<int64_t>(vocab_.size()); }

 private:
  struct Merge {
    uint64_t key = kEmpty;  // left id << 32 | right id
    int32_t rank = 0;
    int32_t new_id = 0;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  const Merge* find_merge(int32_t left, int32_t right) const;
  void insert_merge(int32_t left, int32_t right, int32_t rank, int32_t new_id);
  void initial_symbols(std::string_view bytes, std::vector<int32_t>& ids) const;

  Vocab vocab_;
  std::vector<const std::string*> id_to_token_;
  std::vector<Merge> merges_;  // open addressing, power-of-two size
  uint64_t mask_ = 0;
  std::array<int32_t, 256> byte_id_{};  // id of each byte's single-character token, -1 if none
  BpeOptions options_;
  std::optional<int32_t> unk_id_;
};

}  // namespace retain::data
