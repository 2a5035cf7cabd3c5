#include "data/tokenizer/tokenizer.h"

#include <array>
#include <atomic>
#include <cstdlib>
#include <unordered_map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <utf8proc.h>

#include "data/tokenizer/added_tokens.h"
#include "data/tokenizer/bpe.h"
#include "data/tokenizer/byte_level.h"
#include "data/tokenizer/pre_tokenizer.h"
#include "data/tokenizer/sha256.h"
#include "data/tokenizer/utf8.h"
#include "kernels/base/atomic_file.h"
#include "kernels/base/error.h"

namespace retain::data {

using json = nlohmann::json;

namespace {

// GPT-2's pattern, which ByteLevel applies itself when use_regex is true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// NFC of valid UTF-8 (utf8proc). Text whose code points are all below U+0300 (lead bytes
// below 0xCC) is already NFC: nothing there decomposes or combines.
bool may_change_under_nfc(std::string_view s) {
  for (const char c : s)
    if (static_cast<unsigned char>(c) >= 0xCC) return true;
  return false;
}

std::string nfc(std::string_view s) {
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                          static_cast<utf8proc_ssize_t>(s.size()), &out,
                                          static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) fail("NFC normalization failed: {}", utf8proc_errmsg(n));
  std::string result(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return result;
}

// Reading tokenizer.json fields with errors that name the file and the field.
struct Reader {
  std::string file;
  [[noreturn]] void bad(const std::string& field, const std::string& problem) const {
    // Fields and problems quote the file's own strings (tokens, patterns, type names), which
    // may hold newlines: the message stays one line.
    fail("{}: {}: {}", file, one_line(field), one_line(problem));
  }
  bool flag(const json& j, const std::string& key, bool fallback, const std::string& where) const {
    if (!j.contains(key) || j.at(key).is_null()) return fallback;
    if (!j.at(key).is_boolean()) bad(where + "." + key, "expected true or false");
    return j.at(key).get<bool>();
  }
  std::string text(const json& j, const std::string& key, const std::string& where) const {
    if (!j.contains(key) || !j.at(key).is_string()) bad(where + "." + key, "expected a string");
    return j.at(key).get<std::string>();
  }
  std::string type(const json& j, const std::string& where) const {
    if (!j.is_object()) bad(where, "expected an object");
    return text(j, "type", where);
  }
};

}  // namespace

struct Tokenizer::Impl {
  std::filesystem::path file;
  std::string sha256;
  bool normalize_nfc = false;
  std::vector<AddedToken> added;
  std::unordered_map<std::string, int32_t> added_by_content;
  std::unordered_map<int32_t, const AddedToken*> added_by_id;
  std::unique_ptr<AddedTokenMatcher> raw_matcher, normalized_matcher;
  PreTokenizer pre_tokenizer;
  std::unique_ptr<Bpe> bpe;
  int64_t vocab_size = 0;
  uint64_t instance = 0;  // distinguishes tokenizers in the per-thread word caches

  void load_normalizer(const Reader& r, const json& j);
  void load_pre_tokenizer(const Reader& r, const json& j);
  void load_model(const Reader& r, const json& j);
  void load_added_tokens(const Reader& r, const json& j);
  void encode_text(std::string_view text, std::vector<int32_t>& out) const;
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;
};

void Tokenizer::Impl::load_normalizer(const Reader& r, const json& j) {
  if (j.is_null()) return;
  const std::string t = r.type(j, "normalizer");
  if (t == "NFC") {
    normalize_nfc = true;
  } else if (t == "Sequence" && j.contains("normalizers") && j.at("normalizers").is_array()) {
    for (const json& n : j.at("normalizers")) {
      const std::string nt = r.type(n, "normalizer.normalizers[]");
      if (nt != "NFC") r.bad("normalizer", "normalizer '" + nt + "' is not supported (only NFC)");
      normalize_nfc = true;
    }
  } else {
    r.bad("normalizer", "normalizer '" + t + "' is not supported (only NFC, or none)");
  }
}

void Tokenizer::Impl::load_pre_tokenizer(const Reader& r, const json& j) {
  std::vector<const json*> steps;
  if (j.is_null()) r.bad("pre_tokenizer", "missing: only byte-level tokenizers (ending in ByteLevel) are supported");
  if (r.type(j, "pre_tokenizer") == "Sequence") {
    if (!j.contains("pretokenizers") || !j.at("pretokenizers").is_array())
      r.bad("pre_tokenizer.pretokenizers", "expected an array");
    for (const json& s : j.at("pretokenizers")) steps.push_back(&s);
  } else {
    steps.push_back(&j);
  }
  for (size_t i = 0; i < steps.size(); ++i) {
    const json& s = *steps[i];
    const std::string where = fmt::format("pre_tokenizer[{}]", i);
    const std::string t = r.type(s, where);
    const bool last = i + 1 == steps.size();
    if (t == "Split") {
      if (last) r.bad(where, "Split must be followed by ByteLevel (only byte-level tokenizers are supported)");
      SplitStep step;
      const json& p = s.contains("pattern") ? s.at("pattern") : json();
      std::string pattern;
      if (p.is_object() && p.contains("Regex") && p.at("Regex").is_string())
        pattern = p.at("Regex").get<std::string>();
      else if (p.is_object() && p.contains("String") && p.at("String").is_string())
        pattern = Regex::escape(p.at("String").get<std::string>());
      else
        r.bad(where + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
      step.pattern = std::make_unique<Regex>(pattern, r.file + ": " + where + ".pattern");
      const std::string b = r.text(s, "behavior", where);
      if (b == "Removed") step.behavior = SplitBehavior::Removed;
      else if (b == "Isolated") step.behavior = SplitBehavior::Isolated;
      else if (b == "MergedWithPrevious") step.behavior = SplitBehavior::MergedWithPrevious;
      else if (b == "MergedWithNext") step.behavior = SplitBehavior::MergedWithNext;
      else if (b == "Contiguous") step.behavior = SplitBehavior::Contiguous;
      else r.bad(where + ".behavior", "unknown split behavior '" + b + "'");
      step.invert = r.flag(s, "invert", false, where);
      pre_tokenizer.add_step(std::move(step));
    } else if (t == "ByteLevel") {
      if (!last) r.bad(where, "ByteLevel must be the last pre-tokenizer");
      SplitStep step;
      step.add_prefix_space = r.flag(s, "add_prefix_space", true, where);
      if (r.flag(s, "use_regex", true, where))
        step.pattern = std::make_unique<Regex>(kGpt2Pattern, r.file + ": ByteLevel regex");
      if (step.add_prefix_space || step.pattern) pre_tokenizer.add_step(std::move(step));
    } else {
      r.bad(where, "pre-tokenizer '" + t + "' is not supported (only Split and ByteLevel)");
    }
  }
  if (steps.empty() || r.type(*steps.back(), "pre_tokenizer") != "ByteLevel")
    r.bad("pre_tokenizer", "must end in ByteLevel (only byte-level tokenizers are supported)");
}

void Tokenizer::Impl::load_model(const Reader& r, const json& m) {
  const std::string t = r.type(m, "model");
  if (t != "BPE") r.bad("model", "model type '" + t + "' is not supported (only BPE)");
  if (m.contains("dropout") && !m.at("dropout").is_null()) {
    if (!m.at("dropout").is_number()) r.bad("model.dropout", "expected a number or null");
    if (m.at("dropout").get<double>() != 0.0)
      r.bad("model.dropout", "BPE dropout is not supported (it makes encoding random)");
  }
  BpeOptions opt;
  if (m.contains("unk_token") && !m.at("unk_token").is_null()) opt.unk_token = r.text(m, "unk_token", "model");
  opt.fuse_unk = r.flag(m, "fuse_unk", false, "model");
  opt.byte_fallback = r.flag(m, "byte_fallback", false, "model");
  opt.ignore_merges = r.flag(m, "ignore_merges", false, "model");
  if (m.contains("continuing_subword_prefix") && !m.at("continuing_subword_prefix").is_null())
    opt.continuing_subword_prefix = r.text(m, "continuing_subword_prefix", "model");
  if (m.contains("end_of_word_suffix") && !m.at("end_of_word_suffix").is_null())
    opt.end_of_word_suffix = r.text(m, "end_of_word_suffix", "model");

  if (!m.contains("vocab") || !m.at("vocab").is_object()) r.bad("model.vocab", "expected an object");
  Bpe::Vocab vocab;
  vocab.reserve(m.at("vocab").size());
  for (const auto& [token, id] : m.at("vocab").items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
      r.bad("model.vocab", "token '" + token + "' has an invalid id");
    vocab.emplace(token, id.get<int32_t>());
  }
  // Views into the parsed JSON, which outlives the Bpe constructor.
  std::vector<std::pair<std::string_view, std::string_view>> merges;
  if (m.contains("merges") && !m.at("merges").is_null()) {
    if (!m.at("merges").is_array()) r.bad("model.merges", "expected an array");
    merges.reserve(m.at("merges").size());
    size_t k = 0;
    for (const json& e : m.at("merges")) {
      const auto where = [k] { return fmt::format("model.merges[{}]", k); };
      ++k;
      if (e.is_string()) {  // "a b"
        const std::string_view s = e.get_ref<const std::string&>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          r.bad(where(), "expected two tokens separated by one space, got '" + std::string(s) + "'");
        merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {  // ["a", "b"]
        merges.emplace_back(e[0].get_ref<const std::string&>(), e[1].get_ref<const std::string&>());
      } else {
        r.bad(where(), "expected \"a b\" or [\"a\", \"b\"]");
      }
    }
  }
  bpe = std::make_unique<Bpe>(std::move(vocab), merges, std::move(opt), r.file);
}

void Tokenizer::Impl::load_added_tokens(const Reader& r, const json& list) {
  // No "added_tokens" is no added tokens: the matchers below must exist all the same (encode
  // uses them unconditionally; found by tests/fuzz, regressions/tokenizer/no-added-tokens.json).
  const json j = list.is_null() ? json::array() : list;
  if (!j.is_array()) r.bad("added_tokens", "expected an array");
  added.reserve(j.size());  // pointers into `added` stay valid
  std::optional<int64_t> max_added;
  for (size_t i = 0; i < j.size(); ++i) {
    const json& t = j[i];
    const std::string where = fmt::format("added_tokens[{}]", i);
    if (!t.is_object()) r.bad(where, "expected an object");
    AddedToken tok;
    tok.content = r.text(t, "content", where);
    if (!t.contains("id") || !t.at("id").is_number_integer() || t.at("id").get<int64_t>() < 0 ||
        t.at("id").get<int64_t>() > INT32_MAX)
      r.bad(where + ".id", "expected a non-negative integer");
    tok.id = t.at("id").get<int32_t>();
    tok.single_word = r.flag(t, "single_word", false, where);
    tok.lstrip = r.flag(t, "lstrip", false, where);
    tok.rstrip = r.flag(t, "rstrip", false, where);
    tok.special = r.flag(t, "special", false, where);
    tok.normalized = r.flag(t, "normalized", !tok.special, where);
    if (tok.content.empty()) continue;  // HF ignores it too
    if (utf8::count_invalid(tok.content)) r.bad(where + ".content", "is not valid UTF-8");
    // Ids as HF assigns them when it loads the file (it warns, but goes on, when the
    // file's id differs): a content seen before keeps its id and takes the new flags;
    // a content in the model's vocabulary takes the vocabulary's id; any other takes
    // the vocabulary size, or one past the largest added id once that reaches it.
    if (auto it = added_by_content.find(tok.content); it != added_by_content.end()) {
      for (AddedToken& a : added)
        if (a.id == it->second) a = AddedToken{a.id, tok.content, tok.single_word, tok.lstrip, tok.rstrip,
                                               tok.normalized, tok.special};
      continue;
    }
    if (auto vocab_id = bpe->token_to_id(tok.content)) {
      tok.id = *vocab_id;
    } else {
      const int64_t entries = bpe->entries();
      const int64_t id = !max_added ? entries : (*max_added >= entries || entries == 0) ? *max_added + 1 : entries;
      if (id > INT32_MAX) r.bad(where, "too many tokens");
      tok.id = static_cast<int32_t>(id);
    }
    max_added = std::max<int64_t>(max_added.value_or(tok.id), tok.id);
    added.push_back(tok);
    added_by_content.emplace(tok.content, tok.id);
  }
  std::vector<const AddedToken*> raw, norm;
  std::vector<std::string> raw_p, norm_p;
  for (const AddedToken& t : added) {
    added_by_id[t.id] = &t;
    if (t.normalized) {
      norm.push_back(&t);
      norm_p.push_back(normalize_nfc ? nfc(t.content) : t.content);
    } else {
      raw.push_back(&t);
      raw_p.push_back(t.content);
    }
  }
  raw_matcher = std::make_unique<AddedTokenMatcher>(std::move(raw), std::move(raw_p));
  normalized_matcher = std::make_unique<AddedTokenMatcher>(std::move(norm), std::move(norm_p));
}

Tokenizer Tokenizer::load(const std::filesystem::path& path) {
  auto impl = std::make_unique<Impl>();
  impl->file = std::filesystem::is_directory(path) ? path / "tokenizer.json" : path;
  Reader r{impl->file.string()};
  if (!std::filesystem::exists(impl->file)) fail("{}: no such file", r.file);
  const std::string bytes = read_file(r.file);
  impl->sha256 = sha256_hex(bytes);
  json j;
  try {
    j = json::parse(bytes);
  } catch (const json::exception& e) {
    fail("{}: invalid JSON: {}", r.file, e.what());
  }
  try {
    if (!j.is_object()) r.bad("top level", "expected a JSON object");
    if (j.contains("truncation") && !j.at("truncation").is_null())
      r.bad("truncation", "is not supported (set it to null; retain never truncates)");
    if (!j.contains("model") && (j.contains("model_type") || j.contains("architectures") || j.contains("vocab_size")))
      fail("{}: is a model config.json, not a tokenizer.json (give tokenizer.json or the directory holding it)", r.file);
    if (!j.contains("model")) r.bad("model", "missing");
    impl->load_normalizer(r, j.value("normalizer", json()));
    impl->load_pre_tokenizer(r, j.value("pre_tokenizer", json()));
    impl->load_model(r, j.at("model"));
    const json decoder = j.value("decoder", json());
    if (decoder.is_null() || r.type(decoder, "decoder") != "ByteLevel")
      r.bad("decoder", "only the ByteLevel decoder is supported");
    impl->load_added_tokens(r, j.value("added_tokens", json()));
  } catch (const json::exception& e) {
    fail("{}: unexpected structure: {}", r.file, e.what());
  }
  impl->vocab_size = impl->bpe->max_id() + 1;
  for (const AddedToken& t : impl->added) impl->vocab_size = std::max<int64_t>(impl->vocab_size, int64_t{t.id} + 1);
  static std::atomic<uint64_t> instances{0};
  impl->instance = ++instances;
  return Tokenizer(std::move(impl));
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

namespace {

// Word -> ids cache, one per thread (so encode needs no lock), holding a few tokenizers'
// words at once; an entry is keyed by the tokenizer's instance number.
struct WordCache {
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  uint64_t owner = 0;
  std::unordered_map<std::string, std::vector<int32_t>, Hash, std::equal_to<>> words;
};
constexpr size_t kCachedWordMaxBytes = 128;
constexpr size_t kCacheMaxWords = 1 << 17;

WordCache& cache_for(uint64_t instance) {
  thread_local std::array<WordCache, 4> caches;
  thread_local size_t next_victim = 0;
  for (WordCache& c : caches)
    if (c.owner == instance) return c;
  WordCache& c = caches[next_victim++ % caches.size()];
  c.owner = instance;
  c.words.clear();
  return c;
}

}  // namespace

void Tokenizer::Impl::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.size() > kCachedWordMaxBytes) return bpe->encode_word(word, out);
  WordCache& cache = cache_for(instance);
  if (auto it = cache.words.find(word); it != cache.words.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  const size_t before = out.size();
  bpe->encode_word(word, out);
  if (cache.words.size() >= kCacheMaxWords) cache.words.clear();
  cache.words.emplace(std::string(word), std::vector<int32_t>(out.begin() + static_cast<std::ptrdiff_t>(before), out.end()));
}

// Normalize, find normalized added tokens, pre-tokenize, BPE: one piece of text between
// raw added tokens.
void Tokenizer::Impl::encode_text(std::string_view text, std::vector<int32_t>& out) const {
  std::string normalized;
  if (normalize_nfc && may_change_under_nfc(text)) {
    normalized = nfc(text);
    text = normalized;
  }
  thread_local PreTokenizerScratch scratch;
  std::vector<Piece> pieces;
  if (normalized_matcher->empty()) pieces.push_back({0, text.size(), -1});
  else normalized_matcher->split(text, 0, pieces);
  for (const Piece& p : pieces) {
    if (p.id >= 0) {
      out.push_back(p.id);
      continue;
    }
    for (std::string_view word : pre_tokenizer.split(text.substr(p.begin, p.end - p.begin), scratch))
      encode_word(word, out);
  }
  // A huge text grows the scratch to ~100 bytes per word; do not keep that for the thread's
  // lifetime (a packer worker would hold it to the end of the run).
  constexpr size_t kKeepScratchWords = size_t{1} << 16;
  if (scratch.pieces.capacity() > kKeepScratchWords || scratch.next.capacity() > kKeepScratchWords ||
      scratch.spans.capacity() > 2 * kKeepScratchWords)
    scratch = PreTokenizerScratch{};
}

void Tokenizer::encode_append(std::string_view text, std::vector<int32_t>& out) const {
  std::string sanitized;
  if (utf8::count_invalid(text)) {
    sanitized = utf8::sanitize(text);
    text = sanitized;
  }
  std::vector<Piece> pieces;
  impl_->raw_matcher->split(text, 0, pieces);
  for (const Piece& p : pieces) {
    if (p.id >= 0) out.push_back(p.id);
    else if (p.end > p.begin) impl_->encode_text(text.substr(p.begin, p.end - p.begin), out);
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  encode_append(text, ids);
  return ids;
}

// Added tokens decode to their content. Vocabulary tokens decode as in HF's ByteLevel
// decoder: a token whose characters all belong to the byte-level alphabet becomes those
// bytes, any other is copied as it is. Differences from HF's decode: invalid UTF-8 in the
// result is kept, not replaced by U+FFFD, and HF also passes added tokens through the
// byte-level mapping (so "ñam" would come out as "\xF1am", then "\uFFFDam"); for ASCII
// added tokens such as Qwen3's the two agree.
std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  std::string bytes;
  for (const int32_t id : ids) {
    if (auto it = impl_->added_by_id.find(id); it != impl_->added_by_id.end()) {
      out += it->second->content;
      continue;
    }
    const std::string* token = impl_->bpe->id_to_token(id);
    if (!token) fail("{}: decode: token id {} is not in the vocabulary", impl_->file.string(), id);
    bytes.clear();
    bool all_mapped = true;
    for (size_t i = 0; i < token->size() && all_mapped;) {
      const int b = byte_level::code_point_to_byte(utf8::next_code_point(*token, i));
      if (b < 0) all_mapped = false;
      else bytes += static_cast<char>(b);
    }
    out += all_mapped ? bytes : *token;
  }
  return out;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(std::string(token)); it != impl_->added_by_content.end()) return it->second;
  return impl_->bpe->token_to_id(token);
}

int64_t Tokenizer::vocab_size() const { return impl_->vocab_size; }
const std::string& Tokenizer::sha256() const { return impl_->sha256; }
const std::filesystem::path& Tokenizer::file() const { return impl_->file; }

size_t Tokenizer::count_invalid_utf8(std::string_view text) { return utf8::count_invalid(text); }
std::string Tokenizer::sanitize_utf8(std::string_view text) { return utf8::sanitize(text); }

}  // namespace retain::data
