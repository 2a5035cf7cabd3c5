// The tokenizer against ids that Hugging Face `tokenizers` produced (tests/fixtures/tokenizer,
// written by make_fixtures.py): Qwen3's tokenizer, the tiny model's, and variants that each
// exercise one feature (split behaviors, prefix space, trained merges, added-token flags).
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "data/tokenizer/tokenizer.h"
#include "kernels/base/error.h"
#include "model/tiny.h"

using retain::data::Tokenizer;
namespace fs = std::filesystem;

namespace {

const fs::path kDir = fs::path(RETAIN_FIXTURES_DIR) / "tokenizer";

std::string base64_decode(const std::string& in) {
  const std::string a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (const char c : in) {
    if (c == '=') break;
    acc = (acc << 6) | static_cast<uint32_t>(a.find(c));
    bits += 6;
    if (bits >= 8) out += static_cast<char>((acc >> (bits -= 8)) & 0xFF);
  }
  return out;
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct Case {
  std::string text, nfc;
  std::optional<std::string> replaced;
  std::vector<int32_t> ids;
};

std::vector<Case> read_cases(const std::string& name) {
  std::ifstream f(kDir / (name + ".jsonl"));
  EXPECT_TRUE(f.good()) << name;
  std::vector<Case> out;
  std::string line;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    Case c{base64_decode(j.at("text_b64")), base64_decode(j.at("nfc_b64")), std::nullopt,
           j.at("ids").get<std::vector<int32_t>>()};
    if (j.contains("replaced_b64")) c.replaced = base64_decode(j.at("replaced_b64"));
    out.push_back(std::move(c));
  }
  EXPECT_FALSE(out.empty()) << name;
  return out;
}

// Qwen3's tokenizer.json is 11 MB, so it is not committed: RETAIN_QWEN3_TOKENIZER (env or
// CMake) points at it. The fixture records its SHA-256, so a different file is an error.
std::optional<fs::path> qwen3_path() {
  const char* env = std::getenv("RETAIN_QWEN3_TOKENIZER");
  fs::path p = env && *env ? env : RETAIN_QWEN3_TOKENIZER;
  if (!fs::exists(p)) return std::nullopt;
  return p;
}

const Tokenizer& qwen3() {
  static const Tokenizer tok = Tokenizer::load(*qwen3_path());
  return tok;
}

#define REQUIRE_QWEN3()                                                                  \
  if (!qwen3_path()) GTEST_SKIP() << "Qwen3 tokenizer.json not found (set RETAIN_QWEN3_TOKENIZER)"

void expect_fixture_ids(const Tokenizer& tok, const std::string& name) {
  const auto cases = read_cases(name);
  for (size_t i = 0; i < cases.size(); ++i)
    EXPECT_EQ(tok.encode(cases[i].text), cases[i].ids) << name << ".jsonl line " << i + 1;
}

std::string trimmed(const std::string& s) { return s.substr(0, s.find_last_not_of("\n") + 1); }

}  // namespace

TEST(Tokenizer, Qwen3MatchesHuggingFaceIds) {
  REQUIRE_QWEN3();
  EXPECT_EQ(qwen3().sha256(), trimmed(slurp(kDir / "qwen3.sha256")));  // independent: Python hashlib
  EXPECT_EQ(qwen3().vocab_size(), 151669);
  EXPECT_EQ(qwen3().token_to_id("<|endoftext|>"), 151643);
  EXPECT_EQ(qwen3().token_to_id("<|im_end|>"), 151645);
  EXPECT_EQ(qwen3().token_to_id("Hello"), 9707);
  EXPECT_EQ(qwen3().token_to_id("no such token"), std::nullopt);
  expect_fixture_ids(qwen3(), "qwen3");
}

TEST(Tokenizer, TinyMatchesHuggingFaceIds) {
  // The committed copy is what retain-make-tiny writes today; otherwise regenerate fixtures.
  EXPECT_EQ(nlohmann::json::parse(slurp(kDir / "tiny_tokenizer.json")), retain::tiny_tokenizer_json());
  const Tokenizer tok = Tokenizer::load(kDir / "tiny_tokenizer.json");
  EXPECT_EQ(tok.sha256(), trimmed(slurp(kDir / "tiny_tokenizer.sha256")));
  EXPECT_EQ(tok.vocab_size(), retain::kTinyTokenizerSize);
  EXPECT_EQ(tok.token_to_id("<|im_start|>"), retain::kTinyImStart);
  expect_fixture_ids(tok, "tiny");
}

TEST(Tokenizer, DirectoryPathFindsTokenizerJson) {
  const fs::path dir = fs::temp_directory_path() / ("retain_tok_dir_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  fs::copy_file(kDir / "tiny_tokenizer.json", dir / "tokenizer.json", fs::copy_options::overwrite_existing);
  const Tokenizer tok = Tokenizer::load(dir);
  EXPECT_EQ(tok.file(), dir / "tokenizer.json");
  EXPECT_EQ(tok.encode("hi"), (std::vector<int32_t>{71, 72}));
  fs::remove_all(dir);
}

class Variant : public ::testing::TestWithParam<std::string> {};

TEST_P(Variant, MatchesHuggingFaceIds) {
  const Tokenizer tok = Tokenizer::load(kDir / "variants" / (GetParam() + ".json"));
  expect_fixture_ids(tok, GetParam());
}

INSTANTIATE_TEST_SUITE_P(
    Tokenizer, Variant,
    ::testing::Values("split_removed_plain", "split_removed_inverted", "split_isolated_plain", "split_isolated_inverted",
                      "split_mergedwithprevious_plain", "split_mergedwithprevious_inverted",
                      "split_mergedwithnext_plain", "split_mergedwithnext_inverted", "split_contiguous_plain",
                      "split_contiguous_inverted", "split_string", "trained", "trained_affixes",
                      "trained_ignore_merges", "unk_fused", "unk_unfused", "no_unk", "byte_fallback",
                      "no_normalizer"));

// decode(encode(x)) == NFC(x) (of Python's U+FFFD replacement, for invalid input).
TEST(Tokenizer, DecodeInvertsEncodeUpToNfc) {
  std::vector<std::pair<std::string, const Tokenizer*>> sets;
  const Tokenizer tiny = Tokenizer::load(kDir / "tiny_tokenizer.json");
  sets.emplace_back("tiny", &tiny);
  if (qwen3_path()) sets.emplace_back("qwen3", &qwen3());
  for (const auto& [name, tok] : sets) {
    const auto cases = read_cases(name);
    for (size_t i = 0; i < cases.size(); ++i) {
      const auto ids = tok->encode(cases[i].text);
      EXPECT_EQ(tok->decode(ids), cases[i].nfc) << name << ".jsonl line " << i + 1;
    }
  }
}

TEST(Tokenizer, AddedTokensDecodeToTheirContent) {
  const Tokenizer tok = Tokenizer::load(kDir / "variants/trained.json");
  const auto nam = tok.token_to_id("ñam");
  ASSERT_TRUE(nam.has_value());
  // [LR] strips the spaces around it; ByteLevel then prefixes a space to "x" and to "y".
  EXPECT_EQ(tok.decode(tok.encode("x ñam [LR] y")), " x ñam[LR] y");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{*nam, *nam}), "ñamñam");
}

TEST(Tokenizer, InvalidUtf8IsReplacedLikePython) {
  size_t checked = 0;
  for (const Case& c : read_cases("tiny")) {
    if (!c.replaced) {
      EXPECT_EQ(Tokenizer::count_invalid_utf8(c.text), 0u);
      EXPECT_EQ(Tokenizer::sanitize_utf8(c.text), c.text);
      continue;
    }
    ++checked;
    EXPECT_EQ(Tokenizer::sanitize_utf8(c.text), *c.replaced);
    // Each replacement is one U+FFFD more than the input had.
    const auto count = [](const std::string& s, const std::string& what) {
      size_t n = 0;
      for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
      return n;
    };
    EXPECT_EQ(Tokenizer::count_invalid_utf8(c.text), count(*c.replaced, "\xEF\xBF\xBD") - count(c.text, "\xEF\xBF\xBD"));
  }
  EXPECT_GE(checked, 3u);
  EXPECT_EQ(Tokenizer::count_invalid_utf8("\xE0\x80\x80"), 3u);    // E0 needs A0..BF next
  EXPECT_EQ(Tokenizer::count_invalid_utf8("\xF0\x9F\x98"), 1u);    // one truncated sequence
  EXPECT_EQ(Tokenizer::count_invalid_utf8("\xED\xA0\x80"), 3u);    // surrogate
  EXPECT_EQ(Tokenizer::count_invalid_utf8("\xF0\x9F\x98\x80"), 0u);  // 😀
}

TEST(Tokenizer, ConcurrentEncodingMatchesSequential) {
  std::vector<std::pair<const Tokenizer*, std::vector<Case>>> work;
  const Tokenizer tiny = Tokenizer::load(kDir / "tiny_tokenizer.json");
  const Tokenizer trained = Tokenizer::load(kDir / "variants/trained.json");
  work.emplace_back(&tiny, read_cases("tiny"));
  work.emplace_back(&trained, read_cases("trained"));
  if (qwen3_path()) work.emplace_back(&qwen3(), read_cases("qwen3"));
  // Each thread encodes every text of every tokenizer, in its own random order, many times
  // (the per-thread caches see several tokenizers interleaved).
  std::vector<std::thread> threads;
  std::vector<int> failures(8, 0);
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::vector<std::pair<size_t, size_t>> order;
      for (size_t w = 0; w < work.size(); ++w)
        for (size_t i = 0; i < work[w].second.size(); ++i) order.emplace_back(w, i);
      for (int round = 0; round < 20; ++round) {
        std::shuffle(order.begin(), order.end(), rng);
        for (const auto& [w, i] : order)
          if (work[w].first->encode(work[w].second[i].text) != work[w].second[i].ids) ++failures[t];
      }
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < 8; ++t) EXPECT_EQ(failures[t], 0) << "thread " << t;
}

TEST(Tokenizer, EncodeAppendAppends) {
  const Tokenizer tok = Tokenizer::load(kDir / "tiny_tokenizer.json");
  std::vector<int32_t> ids{7};
  tok.encode_append("<|endoftext|>a", ids);
  EXPECT_EQ(ids, (std::vector<int32_t>{7, 256, 64}));
  EXPECT_THROW(tok.decode(std::vector<int32_t>{100000}), retain::Error);
}

namespace {

fs::path write_temp(const std::string& name, const std::string& text) {
  const fs::path p = fs::temp_directory_path() / ("retain_tok_" + std::to_string(::getpid()) + "_" + name);
  std::ofstream(p, std::ios::binary) << text;
  return p;
}

// Loading `text` fails with a retain::Error naming the file and containing `needle`.
void expect_load_error(const std::string& name, const std::string& text, const std::string& needle) {
  const fs::path p = write_temp(name, text);
  try {
    Tokenizer::load(p);
    ADD_FAILURE() << name << ": no error";
  } catch (const retain::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  fs::remove(p);
}

std::string tiny_with(const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = retain::tiny_tokenizer_json();
  edit(j);
  return j.dump();
}

}  // namespace

TEST(Tokenizer, MissingFileNamesIt) {
  try {
    Tokenizer::load("/nonexistent/dir/tokenizer.json");
    ADD_FAILURE();
  } catch (const retain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/tokenizer.json"), std::string::npos) << e.what();
  }
}

TEST(Tokenizer, RejectsBadOrUnsupportedFilesClearly) {
  using J = nlohmann::json;
  expect_load_error("badjson.json", "{\"model\": [1, 2", "invalid JSON");
  expect_load_error("notobject.json", "[1, 2]", "expected a JSON object");
  expect_load_error("wordpiece.json", tiny_with([](J& j) { j["model"]["type"] = "WordPiece"; }), "WordPiece");
  expect_load_error("unigram.json", tiny_with([](J& j) { j["model"]["type"] = "Unigram"; }), "Unigram");
  expect_load_error("lowercase.json", tiny_with([](J& j) { j["normalizer"] = {{"type", "Lowercase"}}; }), "Lowercase");
  expect_load_error("nfkc_seq.json",
                    tiny_with([](J& j) { j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFKC"}}}}}; }),
                    "NFKC");
  expect_load_error("whitespace.json", tiny_with([](J& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; }),
                    "Whitespace");
  expect_load_error("no_bytelevel.json",
                    tiny_with([](J& j) { j["pre_tokenizer"]["pretokenizers"].erase(1); }), "ByteLevel");
  expect_load_error("metaspace.json",
                    tiny_with([](J& j) { j["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Metaspace"}}; }),
                    "Metaspace");
  expect_load_error("badregex.json",
                    tiny_with([](J& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed"; }),
                    "(unclosed");
  expect_load_error("behavior.json",
                    tiny_with([](J& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways"; }),
                    "Sideways");
  expect_load_error("dropout.json", tiny_with([](J& j) { j["model"]["dropout"] = 0.1; }), "dropout");
  expect_load_error("merge.json", tiny_with([](J& j) { j["model"]["merges"] = {"a zz"}; }), "model.merges[0]");
  expect_load_error("merge_form.json", tiny_with([](J& j) { j["model"]["merges"] = {"a b c"}; }), "model.merges[0]");
  expect_load_error("decoder.json", tiny_with([](J& j) { j["decoder"] = {{"type", "WordPiece"}}; }), "decoder");
  expect_load_error("truncation.json", tiny_with([](J& j) { j["truncation"] = {{"max_length", 5}}; }), "truncation");
  expect_load_error("unk.json", tiny_with([](J& j) { j["model"]["unk_token"] = "<unk>"; }), "unk_token");
  // The file's strings quoted in a message keep it one line (fuzzer finds: a bad regex and
  // tokens holding newlines).
  expect_load_error("newline_regex.json",
                    tiny_with([](J& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "a\n(unclosed"; }),
                    "a?(unclosed");
  expect_load_error("newline_token.json", tiny_with([](J& j) { j["model"]["vocab"]["z\nz"] = 1 << 30; }),
                    "token 'z?z' has id 1073741824");
  expect_load_error("newline_merge.json", tiny_with([](J& j) { j["model"]["merges"] = {"a\n z"}; }),
                    "(\"a? z\"): token 'a?z' is not in the vocabulary");
  // An id far past the vocabulary (a fuzzer's find: the id table cost gigabytes) is refused.
  expect_load_error("huge_id.json", tiny_with([](J& j) { j["model"]["vocab"]["zz"] = 1 << 30; }),
                    "has id 1073741824; retain takes ids below 16777216");
  expect_load_error("negative_id.json", tiny_with([](J& j) { j["model"]["vocab"]["zz"] = -3; }), "token 'zz' has an invalid id");
}
