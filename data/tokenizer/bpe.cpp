#include "data/tokenizer/bpe.h"

#include <algorithm>

#include <fmt/format.h>

#include "data/tokenizer/byte_level.h"
#include "kernels/base/error.h"

namespace retain::data {

namespace {

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

uint64_t mix(uint64_t k) {  // splitmix64 finalizer: spreads consecutive ids over the table
  k ^= k >> 30;
  k *= 0xbf58476d1ce4e5b9ULL;
  k ^= k >> 27;
  k *= 0x94d049bb133111ebULL;
  return k ^ (k >> 31);
}

}  // namespace

Bpe::Bpe(Vocab vocab, const std::vector<std::pair<std::string_view, std::string_view>>& merges, BpeOptions options,
         const std::string& where)
    : vocab_(std::move(vocab)), options_(std::move(options)) {
  int32_t max_id = -1;
  for (const auto& [token, id] : vocab_) {
    if (id < 0) fail("{}: model.vocab: token '{}' has negative id {}", where, printable(token), id);
    // The id -> token table has one slot per id: a vocabulary whose ids run far past its size
    // (a damaged file) would cost gigabytes. 2^24 is ~64x the largest LLM vocabularies.
    if (id >= kMaxVocabId)
      fail("{}: model.vocab: token '{}' has id {}; retain takes ids below {}", where, printable(token), id,
           kMaxVocabId);
    max_id = std::max(max_id, id);
  }
  id_to_token_.assign(static_cast<size_t>(max_id + 1), nullptr);
  for (const auto& [token, id] : vocab_) id_to_token_[id] = &token;

  const auto& bytes = byte_level::byte_to_utf8();
  for (int b = 0; b < 256; ++b) {
    auto it = vocab_.find(bytes[b]);
    byte_id_[b] = it == vocab_.end() ? -1 : it->second;
  }
  if (options_.unk_token) {
    auto it = vocab_.find(*options_.unk_token);
    if (it == vocab_.end()) fail("{}: model.unk_token '{}' is not in the vocabulary", where,
                                    printable(*options_.unk_token));
    unk_id_ = it->second;
  }

  size_t cap = 16;
  while (cap < merges.size() * 2) cap <<= 1;
  merges_.assign(cap, Merge{});
  mask_ = cap - 1;
  const size_t prefix_len = options_.continuing_subword_prefix.size();
  std::string merged;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    // Named references, not a structured binding: clang before 16 (the fuzz build) cannot
    // capture bindings in a lambda.
    const auto& a = merges[rank].first;
    const auto& b = merges[rank].second;
    const auto find = [&](std::string_view t) {
      auto it = vocab_.find(t);
      if (it == vocab_.end())
        fail("{}: model.merges[{}] (\"{} {}\"): token '{}' is not in the vocabulary", where, rank, printable(a),
             printable(b), printable(t));
      return it->second;
    };
    // As in HF tokenizers: the merged token is a + b without its first prefix_len bytes.
    merged.assign(a);
    if (b.size() >= prefix_len) merged.append(b.substr(prefix_len));
    insert_merge(find(a), find(b), static_cast<int32_t>(rank), find(merged));
  }
}

void Bpe::insert_merge(int32_t left, int32_t right, int32_t rank, int32_t new_id) {
  const uint64_t key = pair_key(left, right);
  for (uint64_t i = mix(key) & mask_;; i = (i + 1) & mask_) {
    Merge& m = merges_[i];
    if (m.key == kEmpty || m.key == key) {  // a repeated pair keeps its last rank, like HF's HashMap
      m = {key, rank, new_id};
      return;
    }
  }
}

const Bpe::Merge* Bpe::find_merge(int32_t left, int32_t right) const {
  const uint64_t key = pair_key(left, right);
  for (uint64_t i = mix(key) & mask_;; i = (i + 1) & mask_) {
    const Merge& m = merges_[i];
    if (m.key == key) return &m;
    if (m.key == kEmpty) return nullptr;
  }
}

std::optional<int32_t> Bpe::token_to_id(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* Bpe::id_to_token(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < id_to_token_.size() ? id_to_token_[id] : nullptr;
}

// The symbols a word starts from: one per byte (byte-level character), with the
// continuing-subword prefix / end-of-word suffix, byte fallback and unk rules of HF BPE.
void Bpe::initial_symbols(std::string_view bytes, std::vector<int32_t>& ids) const {
  const auto& utf8 = byte_level::byte_to_utf8();
  const bool affixes = !options_.continuing_subword_prefix.empty() || !options_.end_of_word_suffix.empty();
  bool last_was_unk = false;
  std::string piece;
  for (size_t i = 0; i < bytes.size(); ++i) {
    const auto b = static_cast<unsigned char>(bytes[i]);
    int32_t id = byte_id_[b];
    if (affixes) {
      piece.clear();
      if (i > 0) piece += options_.continuing_subword_prefix;
      piece += utf8[b];
      if (i + 1 == bytes.size()) piece += options_.end_of_word_suffix;
      auto it = vocab_.find(piece);
      id = it == vocab_.end() ? -1 : it->second;
    }
    if (id >= 0) {
      ids.push_back(id);
      last_was_unk = false;
      continue;
    }
    if (!affixes) piece = utf8[b];
    if (options_.byte_fallback) {  // the piece's UTF-8 bytes as <0xXX> tokens, if all exist
      std::vector<int32_t> fallback;
      for (const char c : piece) {
        auto it = vocab_.find(fmt::format("<0x{:02X}>", static_cast<unsigned char>(c)));
        if (it == vocab_.end()) break;
        fallback.push_back(it->second);
      }
      if (fallback.size() == piece.size()) {
        ids.insert(ids.end(), fallback.begin(), fallback.end());
        last_was_unk = false;
        continue;
      }
    }
    if (unk_id_) {
      if (!(options_.fuse_unk && last_was_unk)) ids.push_back(*unk_id_);
      last_was_unk = true;
    }
  }
}

void Bpe::encode_word(std::string_view bytes, std::vector<int32_t>& out) const {
  if (bytes.empty()) return;
  if (options_.ignore_merges) {  // a word that is a vocabulary token is taken whole
    std::string mapped;
    for (const char c : bytes) mapped += byte_level::byte_to_utf8()[static_cast<unsigned char>(c)];
    if (auto id = token_to_id(mapped)) return out.push_back(*id);
  }
  struct Symbol {
    int32_t id, prev, next;
  };
  struct Candidate {
    int32_t rank, pos, new_id;
    bool operator<(const Candidate& o) const {  // max-heap order: lowest rank, then leftmost
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  thread_local std::vector<int32_t> ids;
  thread_local std::vector<Symbol> sym;
  thread_local std::vector<Candidate> heap;
  ids.clear();
  sym.clear();
  heap.clear();
  initial_symbols(bytes, ids);
  const auto n = static_cast<int32_t>(ids.size());
  for (int32_t i = 0; i < n; ++i) sym.push_back({ids[i], i - 1, i + 1 < n ? i + 1 : -1});
  const auto push_candidate = [&](int32_t pos) {
    const int32_t next = sym[pos].next;
    if (next < 0) return;
    if (const Merge* m = find_merge(sym[pos].id, sym[next].id)) {
      heap.push_back({m->rank, pos, m->new_id});
      std::push_heap(heap.begin(), heap.end());
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_candidate(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const Candidate c = heap.back();
    heap.pop_back();
    Symbol& left = sym[c.pos];
    if (left.id < 0 || left.next < 0) continue;  // merged away since it was queued
    const Merge* m = find_merge(left.id, sym[left.next].id);
    if (!m || m->new_id != c.new_id || m->rank != c.rank) continue;  // stale candidate
    Symbol& right = sym[left.next];
    left.id = c.new_id;
    left.next = right.next;
    right.id = -1;
    if (left.next >= 0) sym[left.next].prev = c.pos;
    if (left.prev >= 0) push_candidate(left.prev);
    push_candidate(c.pos);
  }
  for (int32_t i = 0; i >= 0 && i < n; i = sym[i].next) out.push_back(sym[i].id);
}

}  // namespace retain::data
