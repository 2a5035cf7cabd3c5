// The packer's invariants on a generated mixed corpus (text, messages, input_ids; JSON lines,
// plain text, gzip), for concat and bfd: every document's tokens appear once and in order under
// its own doc id, each followed by the separator; padding is accounted for; bfd splits only
// documents longer than S and matches an independent best-fit-decreasing; masks are carried.
#include <random>

#include "data/formats/h5.h"
#include "data/formats/hf_config.h"
#include "data/packed_dataset.h"
#include "tests/data/pack_helpers.h"

namespace retain::data::test {
namespace {

using json = nlohmann::json;

constexpr int32_t kEos = 256, kImStart = 257, kImEnd = 258;

struct Expected {
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
};

// A generated corpus and the documents it must pack to, computed without the packer: the tiny
// tokenizer maps each byte to one token (bytes are ASCII here), so ids follow from the text.
struct Corpus {
  std::vector<fs::path> files;
  std::vector<Expected> docs;  // in doc-id order
  int64_t blank = 0, empty = 0, tokens = 0;
};

class PackerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tok_ = std::make_unique<Tokenizer>(tiny_tokenizer(dir_.path()));
    for (int c = 0; c < 128; ++c) byte_id_[c] = tok_->encode(std::string(1, static_cast<char>(c))).at(0);
  }

  std::vector<int32_t> bytes(const std::string& s) const {
    std::vector<int32_t> v;
    for (unsigned char c : s) v.push_back(byte_id_[c]);
    return v;
  }

  std::string random_text(std::mt19937& g, int64_t len) const {
    static const char alphabet[] = "abcdefghij klmnopqrstuvwxyz .,;:!?ABCXYZ0123456789";
    std::string s;
    for (int64_t i = 0; i < len; ++i) s += alphabet[g() % (sizeof(alphabet) - 1)];
    return s;
  }

  // ~200 documents of 1..3·S tokens over three files, with blank lines and empty documents.
  Corpus make_corpus(int64_t S, Targets targets, bool gzip_third = true) {
    std::mt19937 g(7);
    Corpus c;
    std::string jsonl, txt, third;
    auto len = [&] { return 1 + static_cast<int64_t>(g() % (3 * S)); };
    for (int i = 0; i < 120; ++i) {
      Expected e;
      const int kind = static_cast<int>(g() % 5);
      if (kind == 0) {
        jsonl += (g() % 2 ? "\n" : "   \n");
        ++c.blank;
        continue;
      }
      if (kind == 1) {
        const std::string t = random_text(g, len());
        jsonl += json{{"text", t}}.dump() + "\n";
        e.ids = bytes(t);
        e.mask.assign(e.ids.size(), 1);
      } else if (kind == 2) {
        json msgs = json::array();
        const int n = 1 + static_cast<int>(g() % 3);
        for (int m = 0; m < n; ++m) {
          const std::string role = m % 2 ? "assistant" : (m == 0 && g() % 2 ? "system" : "user");
          const std::string content = random_text(g, static_cast<int64_t>(g() % (S / 2)));
          msgs.push_back({{"role", role}, {"content", content}});
          const bool a = targets == Targets::assistant && role == "assistant";
          const uint8_t all = targets == Targets::all;
          e.ids.push_back(kImStart), e.mask.push_back(all);
          for (int32_t id : bytes(role + "\n")) e.ids.push_back(id), e.mask.push_back(all);
          for (int32_t id : bytes(content)) e.ids.push_back(id), e.mask.push_back(a ? 1 : all);
          e.ids.push_back(kImEnd), e.mask.push_back(a ? 1 : all);
          e.ids.push_back(byte_id_['\n']), e.mask.push_back(all);
        }
        jsonl += json{{"messages", msgs}}.dump() + "\n";
      } else if (kind == 3) {
        const int64_t n = len();
        std::vector<int32_t> ids;
        std::vector<int> m;
        for (int64_t k = 0; k < n; ++k) ids.push_back(static_cast<int32_t>(g() % 259)), m.push_back(g() % 2);
        json j{{"input_ids", ids}};
        if (g() % 2) j["target_mask"] = m;
        else m.assign(ids.size(), 1);
        jsonl += j.dump() + "\n";
        e.ids = ids;
        e.mask.assign(m.begin(), m.end());
      } else {
        jsonl += g() % 2 ? R"({"text": ""})" "\n" : R"({"input_ids": []})" "\n";
        ++c.empty;
        continue;
      }
      e.ids.push_back(kEos);
      e.mask.push_back(e.mask.back());
      c.docs.push_back(e);
    }
    // Plain text, one document per line (--txt-mode line), then a gzip JSON-lines file.
    for (int i = 0; i < 40; ++i) {
      const std::string t = random_text(g, len());
      txt += t + "\n";
      Expected e{bytes(t), {}};
      e.ids.push_back(kEos);
      e.mask.assign(e.ids.size(), 1);
      c.docs.push_back(e);
    }
    txt += "\n";
    ++c.empty;
    for (int i = 0; i < 40; ++i) {
      const std::string t = random_text(g, len());
      third += json{{"text", t}}.dump() + "\n";
      Expected e{bytes(t), {}};
      e.ids.push_back(kEos);
      e.mask.assign(e.ids.size(), 1);
      c.docs.push_back(e);
    }
    c.files = {dir_ / "a.jsonl", dir_ / "b.txt", dir_ / (gzip_third ? "c.jsonl.gz" : "c.jsonl")};
    write_text(c.files[0], jsonl);
    write_text(c.files[1], txt);
    if (gzip_third) write_gzip(c.files[2], third);
    else write_text(c.files[2], third);
    for (const auto& d : c.docs) c.tokens += static_cast<int64_t>(d.ids.size());
    return c;
  }

  PackOptions options(const Corpus& c, int64_t S, Packing p, const std::string& out) {
    PackOptions o;
    o.inputs = c.files;
    o.out = dir_ / out;
    o.seq_len = S;
    o.packing = p;
    o.txt_mode = TxtMode::line;
    o.eos_id = kEos;
    o.threads = 2;
    return o;
  }

  // Invariants shared by both packings.
  void check_common(const Corpus& c, const Packed& r, const PackSummary& s) {
    ASSERT_EQ(r.doc_tokens.size(), c.docs.size());
    for (size_t d = 0; d < c.docs.size(); ++d) {
      const auto id = static_cast<int32_t>(d);
      ASSERT_TRUE(r.doc_tokens.count(id)) << "document " << d << " missing";
      EXPECT_EQ(r.doc_tokens.at(id), c.docs[d].ids) << "document " << d;
      EXPECT_EQ(r.doc_masks.at(id), c.docs[d].mask) << "document " << d;
      EXPECT_EQ(r.doc_tokens.at(id).back(), kEos);
    }
    for (int64_t i = 0; i < r.n; ++i) {
      bool in_padding = false;
      for (int64_t t = 0; t < r.S; ++t) {
        const auto u = static_cast<size_t>(t);
        if (r.docs[i][u] < 0) {
          in_padding = true;
          EXPECT_EQ(r.ids[i][u], kEos);
          EXPECT_EQ(r.mask[i][u], 0);
          EXPECT_EQ(r.pos[i][u], 0);
        } else {
          ASSERT_FALSE(in_padding) << "padding before a document in sequence " << i;
          // DESIGN §4: positions count within the run, from 0 at the run's start.
          const bool starts = t == 0 || r.docs[i][u - 1] != r.docs[i][u];
          EXPECT_EQ(r.pos[i][u], starts ? 0 : r.pos[i][u - 1] + 1);
        }
      }
    }
    EXPECT_EQ(s.documents, static_cast<int64_t>(c.docs.size()));
    EXPECT_EQ(s.tokens, c.tokens);
    EXPECT_EQ(s.sequences, r.n);
    EXPECT_EQ(s.padding_tokens, r.padding);
    EXPECT_EQ(r.n * r.S, c.tokens + r.padding);
    EXPECT_EQ(s.blank_lines, c.blank);
    EXPECT_EQ(s.empty_documents, c.empty);
  }

  TempDir dir_;
  std::unique_ptr<Tokenizer> tok_;
  int32_t byte_id_[128] = {};
};

TEST_F(PackerTest, ConcatInInputOrderIsTheDocumentStreamCutEverySTokens) {
  const int64_t S = 64;
  const Corpus c = make_corpus(S, Targets::all);
  PackOptions o = options(c, S, Packing::concat, "concat.h5");
  o.order = DocOrder::input;
  const PackSummary s = pack(*tok_, o);
  const Packed r = read_all(o.out);
  check_common(c, r, s);
  EXPECT_EQ(r.n, (c.tokens + S - 1) / S);
  // Row-major, the non-padding tokens are the documents back to back with ascending ids.
  std::vector<int32_t> stream, want, stream_docs, want_docs;
  for (size_t d = 0; d < c.docs.size(); ++d) {
    want.insert(want.end(), c.docs[d].ids.begin(), c.docs[d].ids.end());
    want_docs.insert(want_docs.end(), c.docs[d].ids.size(), static_cast<int32_t>(d));
  }
  for (int64_t i = 0; i < r.n; ++i)
    for (int64_t t = 0; t < S; ++t)
      if (r.docs[i][t] >= 0) stream.push_back(r.ids[i][t]), stream_docs.push_back(r.docs[i][t]);
  EXPECT_EQ(stream, want);
  EXPECT_EQ(stream_docs, want_docs);
  // Only the last sequence has padding; a cut document restarts at position 0 next sequence.
  int64_t split = 0;
  for (size_t d = 0; d < c.docs.size(); ++d) split += r.doc_rows.at(static_cast<int32_t>(d)).size() > 1;
  EXPECT_EQ(s.split_documents, split);
  EXPECT_GT(split, 0);
  EXPECT_EQ(r.padding, r.n * S - c.tokens);
  const PackedDataset ds = PackedDataset::open(o.out);
  EXPECT_EQ(ds.packing(), "concat");
  EXPECT_EQ(ds.eos_token_id(), kEos);
  EXPECT_EQ(ds.vocab_size(), 259);
  EXPECT_EQ(ds.tokenizer_sha256(), tok_->sha256());
}

TEST_F(PackerTest, ConcatShuffledKeepsEveryDocumentWholeAndInOrder) {
  const int64_t S = 48;
  const Corpus c = make_corpus(S, Targets::all);
  PackOptions o = options(c, S, Packing::concat, "shuffled.h5");
  o.seed = 11;
  const PackSummary s = pack(*tok_, o);
  const Packed r = read_all(o.out);
  check_common(c, r, s);
  // The documents are not in input order any more, and a document's rows are consecutive.
  std::vector<int32_t> first_docs;
  for (int64_t i = 0; i < r.n; ++i) first_docs.push_back(r.docs[i][0]);
  EXPECT_FALSE(std::is_sorted(first_docs.begin(), first_docs.end()));
  for (const auto& [d, rows] : r.doc_rows)
    for (size_t k = 1; k < rows.size(); ++k) EXPECT_EQ(rows[k], rows[k - 1] + 1) << "document " << d;
}

// Best-fit-decreasing written out plainly (linear scans), as docs/data-format.md states it:
// pieces by length descending, ties by document order, into the open sequence with the least
// room that fits (lowest index on ties), else a new sequence.
std::vector<std::vector<std::pair<int32_t, int64_t>>> reference_bfd(const std::vector<int64_t>& lens, int64_t S) {
  struct P {
    int64_t len;
    int32_t doc;
    int64_t off;
  };
  std::vector<P> pieces;
  for (size_t d = 0; d < lens.size(); ++d)
    for (int64_t off = 0; off < lens[d]; off += S) pieces.push_back({std::min(S, lens[d] - off), static_cast<int32_t>(d), off});
  std::stable_sort(pieces.begin(), pieces.end(), [](const P& a, const P& b) { return a.len > b.len; });
  std::vector<std::vector<std::pair<int32_t, int64_t>>> bins;  // (doc, piece length)
  std::vector<int64_t> room;
  for (const P& p : pieces) {
    int64_t best = -1;
    for (size_t b = 0; b < bins.size(); ++b)
      if (room[b] >= p.len && (best < 0 || room[b] < room[static_cast<size_t>(best)])) best = static_cast<int64_t>(b);
    if (best < 0) {
      bins.emplace_back();
      room.push_back(S);
      best = static_cast<int64_t>(bins.size()) - 1;
    }
    bins[static_cast<size_t>(best)].push_back({p.doc, p.len});
    room[static_cast<size_t>(best)] -= p.len;
  }
  return bins;
}

TEST_F(PackerTest, BfdSplitsOnlyLongDocumentsAndMatchesAReferenceBestFit) {
  const int64_t S = 64;
  const Corpus c = make_corpus(S, Targets::all);
  PackOptions o = options(c, S, Packing::bfd, "bfd.h5");
  o.order = DocOrder::input;
  const PackSummary s = pack(*tok_, o);
  const Packed r = read_all(o.out);
  check_common(c, r, s);
  int64_t long_docs = 0;
  std::vector<int64_t> lens;
  for (size_t d = 0; d < c.docs.size(); ++d) {
    const auto len = static_cast<int64_t>(c.docs[d].ids.size());
    lens.push_back(len);
    long_docs += len > S;
    // Never split unless longer than S; then in ceil(len / S) sequences.
    EXPECT_EQ(static_cast<int64_t>(r.doc_rows.at(static_cast<int32_t>(d)).size()), (len + S - 1) / S) << d;
  }
  EXPECT_EQ(s.split_documents, long_docs);
  EXPECT_GT(long_docs, 0);
  const auto bins = reference_bfd(lens, S);
  ASSERT_EQ(static_cast<int64_t>(bins.size()), r.n);
  for (int64_t i = 0; i < r.n; ++i) {
    std::vector<std::pair<int32_t, int64_t>> runs;
    for (int64_t t = 0; t < S; ++t) {
      if (r.docs[i][t] < 0) break;
      if (t == 0 || r.docs[i][t] != r.docs[i][t - 1]) runs.push_back({r.docs[i][t], 0});
      ++runs.back().second;
    }
    EXPECT_EQ(runs, bins[static_cast<size_t>(i)]) << "sequence " << i;
  }
  // Much less padding than one document per sequence would need.
  EXPECT_LT(r.padding, r.n * S / 4);
}

TEST_F(PackerTest, BfdShuffledKeepsTheInvariants) {
  const int64_t S = 100;
  const Corpus c = make_corpus(S, Targets::assistant);
  PackOptions o = options(c, S, Packing::bfd, "bfd_shuffled.h5");
  o.targets = Targets::assistant;
  o.seed = 3;
  const PackSummary s = pack(*tok_, o);
  const Packed r = read_all(o.out);
  check_common(c, r, s);
}

TEST_F(PackerTest, AssistantTargetsMaskExactlyTheAssistantContentAndItsImEnd) {
  // check_common compares every mask with the expected one; here also one document by hand.
  write_text(dir_ / "chat.jsonl",
             R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})" "\n");
  PackOptions o;
  o.inputs = {dir_ / "chat.jsonl"};
  o.out = dir_ / "chat.h5";
  o.seq_len = 32;
  o.eos_id = kEos;
  o.targets = Targets::assistant;
  pack(*tok_, o);
  const Packed r = read_all(o.out);
  // <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n<|endoftext|>
  std::vector<int32_t> want = {kImStart};
  for (int32_t id : bytes("user\nhi")) want.push_back(id);
  want.push_back(kImEnd);
  want.push_back(byte_id_['\n']);
  want.push_back(kImStart);
  for (int32_t id : bytes("assistant\nyo")) want.push_back(id);
  want.push_back(kImEnd);
  want.push_back(byte_id_['\n']);
  want.push_back(kEos);
  const std::vector<uint8_t> mask = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0};
  EXPECT_EQ(r.doc_tokens.at(0), want);
  EXPECT_EQ(r.doc_masks.at(0), mask);
}

TEST_F(PackerTest, OutputIsByteIdenticalForAnyThreadCount) {
  const Corpus c = make_corpus(64, Targets::all);
  for (Packing p : {Packing::concat, Packing::bfd}) {
    PackOptions o1 = options(c, 64, p, "t1.h5"), o4 = options(c, 64, p, "t4.h5");
    o1.threads = 1;
    o4.threads = 4;
    pack(*tok_, o1);
    pack(*tok_, o4);
    EXPECT_EQ(file_bytes(o1.out), file_bytes(o4.out));
  }
  // The seed changes the shuffled order.
  PackOptions a = options(c, 64, Packing::concat, "s1.h5"), b = options(c, 64, Packing::concat, "s2.h5");
  b.seed = 1;
  pack(*tok_, a);
  pack(*tok_, b);
  EXPECT_NE(read_all(a.out).docs, read_all(b.out).docs);
}

TEST_F(PackerTest, GzipIsRecognisedByItsMagicBytesWhateverTheName) {
  const std::string text = R"({"text": "abc"})" "\n" R"({"text": "defg"})" "\n";
  write_text(dir_ / "plain.jsonl", text);
  write_gzip(dir_ / "z.jsonl.gz", text);
  write_gzip(dir_ / "z_named_plain.jsonl", text);
  std::vector<std::vector<int32_t>> results;
  for (const char* f : {"plain.jsonl", "z.jsonl.gz", "z_named_plain.jsonl"}) {
    PackOptions o;
    o.inputs = {dir_ / f};
    o.out = dir_ / (std::string(f) + ".h5");
    o.seq_len = 16;
    o.eos_id = kEos;
    o.order = DocOrder::input;
    pack(*tok_, o);
    results.push_back(read_all(o.out).ids.at(0));
  }
  std::vector<int32_t> want = bytes("abc");
  want.push_back(kEos);
  for (int32_t id : bytes("defg")) want.push_back(id);
  want.push_back(kEos);
  want.resize(16, kEos);
  for (const auto& r : results) EXPECT_EQ(r, want);
}

TEST_F(PackerTest, TruncatedGzipIsAnErrorNamingTheFile) {
  std::string big;
  for (int i = 0; i < 2000; ++i) big += R"({"text": "some text to compress )" + std::to_string(i) + "\"}\n";
  write_gzip(dir_ / "t.jsonl.gz", big);
  auto bytes = file_bytes(dir_ / "t.jsonl.gz");
  bytes.resize(bytes.size() / 2);
  write_text(dir_ / "t.jsonl.gz", std::string(bytes.begin(), bytes.end()));
  PackOptions o;
  o.inputs = {dir_ / "t.jsonl.gz"};
  o.out = dir_ / "t.h5";
  o.seq_len = 16;
  o.eos_id = kEos;
  try {
    pack(*tok_, o);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("t.jsonl.gz"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("gzip"), std::string::npos) << e.what();
  }
  EXPECT_EQ(dir_.files(), (std::vector<std::string>{"t.jsonl.gz", "tokenizer.json"}));
}

TEST_F(PackerTest, TxtModesFileAndLine) {
  write_text(dir_ / "doc.txt", "first line\nsecond\n");
  for (TxtMode m : {TxtMode::file, TxtMode::line}) {
    PackOptions o;
    o.inputs = {dir_ / "doc.txt"};
    o.out = dir_ / "txt.h5";
    o.seq_len = 32;
    o.eos_id = kEos;
    o.order = DocOrder::input;
    o.txt_mode = m;
    const PackSummary s = pack(*tok_, o);
    const Packed r = read_all(o.out);
    if (m == TxtMode::file) {
      std::vector<int32_t> want = bytes("first line\nsecond\n");
      want.push_back(kEos);
      EXPECT_EQ(s.documents, 1);
      EXPECT_EQ(r.doc_tokens.at(0), want);
    } else {
      std::vector<int32_t> a = bytes("first line"), b = bytes("second");
      a.push_back(kEos);
      b.push_back(kEos);
      EXPECT_EQ(s.documents, 2);
      EXPECT_EQ(r.doc_tokens.at(0), a);
      EXPECT_EQ(r.doc_tokens.at(1), b);
    }
  }
}

TEST_F(PackerTest, HugeSeqLenPacksIntoOneRowReadBack) {
  write_text(dir_ / "d.jsonl", R"({"text": "tiny"})" "\n");
  PackOptions o;
  o.inputs = {dir_ / "d.jsonl"};
  o.out = dir_ / "huge.h5";
  o.seq_len = 140000;  // more than one chunk of columns
  o.eos_id = kEos;
  const PackSummary s = pack(*tok_, o);
  EXPECT_EQ(s.sequences, 1);
  EXPECT_EQ(s.padding_tokens, 140000 - 5);
  const Packed r = read_all(o.out);
  EXPECT_EQ(r.docs[0][4], 0);
  EXPECT_EQ(r.docs[0][5], -1);
  EXPECT_EQ(r.docs[0][139999], -1);
}

// Bad input: one message naming file:line, and nothing left in the output directory.
void expect_error(const PackOptions& o, const Tokenizer& tok, const std::string& needle, const TempDir& dir,
                  const std::vector<std::string>& files_before) {
  try {
    pack(tok, o);
    ADD_FAILURE() << "no error; wanted " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
  }
  EXPECT_EQ(dir.files(), files_before);
}

TEST_F(PackerTest, BadInputsFailNamingFileAndLineAndLeaveNothing) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"text": "ok"})" "\n" R"({"text": "unterminated)" "\n", "bad.jsonl:2: invalid JSON"},
      {"\n" R"({"input_ids": [1, 2, 259]})" "\n", "bad.jsonl:2: input_ids[2] = 259 is outside the vocabulary [0, 259)"},
      {R"({"input_ids": [-1]})" "\n", "bad.jsonl:1: input_ids[0] = -1 is outside"},
      {R"({"input_ids": [1, 2], "target_mask": [1]})" "\n", "bad.jsonl:1: \"target_mask\" has 1 values for 2"},
      {R"({"txt": "typo"})" "\n", "bad.jsonl:1: the object has none of"},
      {R"({"text": "a", "input_ids": [1]})" "\n", "bad.jsonl:1: the object has more than one of"},
      {R"({"messages": [{"role": "user"}]})" "\n", "bad.jsonl:1: messages[0] has no string \"content\""},
      {R"([1, 2])" "\n", "bad.jsonl:1: the line is not a JSON object"},
      // Review regressions: a mask beside text was silently ignored; nlohmann stops at a NUL
      // byte, so anything after one was silently ignored too.
      {R"({"text": "ab", "target_mask": [0, 0]})" "\n", "bad.jsonl:1: \"target_mask\" goes only with \"input_ids\""},
      {std::string(R"({"text": "ok"})") + std::string(1, '\0') + R"({"text": "lost"})" "\n",
       "bad.jsonl:1: invalid JSON: the line holds a NUL byte"},
      {"\n\n", "the inputs hold no documents"},
  };
  for (const auto& [content, needle] : cases) {
    write_text(dir_ / "bad.jsonl", content);
    PackOptions o;
    o.inputs = {dir_ / "bad.jsonl"};
    o.out = dir_ / "out.h5";
    o.seq_len = 8;
    o.eos_id = kEos;
    expect_error(o, *tok_, needle, dir_, {"bad.jsonl", "tokenizer.json"});
  }
  write_text(dir_ / "bad.txt", "ok\n\xff\xfe bad\n");
  PackOptions o;
  o.inputs = {dir_ / "bad.txt"};
  o.out = dir_ / "out.h5";
  o.seq_len = 8;
  o.eos_id = kEos;
  o.txt_mode = TxtMode::line;
  expect_error(o, *tok_, "bad.txt:2: invalid UTF-8", dir_, {"bad.jsonl", "bad.txt", "tokenizer.json"});
  o.inputs = {dir_ / "missing.jsonl"};
  expect_error(o, *tok_, "missing.jsonl: cannot open", dir_, {"bad.jsonl", "bad.txt", "tokenizer.json"});
  o.inputs = {dir_ / "bad.jsonl"};
  o.seq_len = 1;
  expect_error(o, *tok_, "--seq-len must be at least 2", dir_, {"bad.jsonl", "bad.txt", "tokenizer.json"});
}

// Review regression: zlib's gzread ignores whatever follows a gzip member that is not a valid
// member header, so a damaged second member (of `cat a.gz b.gz`) was silently dropped.
TEST_F(PackerTest, GzipMembersAndZeroPaddingAreReadTrailingGarbageIsAnError) {
  write_gzip(dir_ / "a.gz", R"({"text": "ab"})" "\n");
  write_gzip(dir_ / "b.gz", R"({"text": "cd"})" "\n");
  const auto a = file_bytes(dir_ / "a.gz"), b = file_bytes(dir_ / "b.gz");
  auto join = [](std::vector<std::vector<uint8_t>> parts) {
    std::string s;
    for (const auto& p : parts) s.append(p.begin(), p.end());
    return s;
  };
  const std::vector<uint8_t> zeros(70000, 0);  // more than one read of padding
  write_text(dir_ / "two.jsonl", join({a, zeros, b, zeros}));
  PackOptions o;
  o.inputs = {dir_ / "two.jsonl"};
  o.out = dir_ / "two.h5";
  o.seq_len = 8;
  o.eos_id = kEos;
  o.order = DocOrder::input;
  const PackSummary s = pack(*tok_, o);
  EXPECT_EQ(s.documents, 2);
  const Packed r = read_all(o.out);
  std::vector<int32_t> cd = bytes("cd");
  cd.push_back(kEos);
  EXPECT_EQ(r.doc_tokens.at(1), cd);
  fs::remove(o.out);

  auto damaged = b;
  damaged[1] = 0;  // the second member's magic bytes
  const std::vector<std::string> files = {"a.gz", "b.gz", "bad.jsonl", "tokenizer.json", "two.jsonl"};
  write_text(dir_ / "bad.jsonl", join({a, damaged}));
  o.inputs = {dir_ / "bad.jsonl"};
  expect_error(o, *tok_, "bad.jsonl: corrupt gzip data", dir_, files);
  write_text(dir_ / "bad.jsonl", join({a, {'x', 'y', 'z'}}));
  expect_error(o, *tok_, "bad.jsonl: trailing garbage after the gzip data at byte", dir_, files);
  write_text(dir_ / "bad.jsonl", join({a, std::vector<uint8_t>(b.begin(), b.begin() + 12)}));
  expect_error(o, *tok_, "bad.jsonl: corrupt or truncated gzip data", dir_, files);
}

// Review regression: a UTF-8 byte order mark at the start of a file was tokenized as text.
TEST_F(PackerTest, ALeadingByteOrderMarkIsNotText) {
  const std::string bom = "\xEF\xBB\xBF";
  write_text(dir_ / "b.txt", bom + "hi\n" + bom + "x");  // only the first one is a mark
  write_gzip(dir_ / "b.jsonl.gz", bom + R"({"text": "gz"})" "\n");
  for (TxtMode m : {TxtMode::file, TxtMode::line}) {
    PackOptions o;
    o.inputs = {dir_ / "b.txt", dir_ / "b.jsonl.gz"};
    o.out = dir_ / "bom.h5";
    o.seq_len = 32;
    o.eos_id = kEos;
    o.order = DocOrder::input;
    o.txt_mode = m;
    pack(*tok_, o);
    const Packed r = read_all(o.out);
    std::vector<std::vector<int32_t>> want;
    if (m == TxtMode::file) want = {tok_->encode("hi\n" + bom + "x")};
    else want = {tok_->encode("hi"), tok_->encode(bom + "x")};
    want.push_back(tok_->encode("gz"));
    ASSERT_EQ(r.doc_tokens.size(), want.size());
    for (size_t d = 0; d < want.size(); ++d) {
      want[d].push_back(kEos);
      EXPECT_EQ(r.doc_tokens.at(static_cast<int32_t>(d)), want[d]) << d;
    }
  }
}

// Review regression: --out naming an input replaced it (the final rename); --out naming a
// directory failed only at that rename, after all the work.
TEST_F(PackerTest, TheOutputMayNotBeAnInputTheTokenizerOrADirectory) {
  write_text(dir_ / "in.jsonl", R"({"text": "ab"})" "\n");
  fs::create_directories(dir_ / "sub");
  const std::vector<std::string> files = {"in.jsonl", "sub", "tokenizer.json"};
  PackOptions o;
  o.inputs = {dir_ / "in.jsonl"};
  o.seq_len = 8;
  o.eos_id = kEos;
  o.out = dir_ / "sub" / ".." / "in.jsonl";
  expect_error(o, *tok_, "is also an input", dir_, files);
  EXPECT_EQ(file_bytes(dir_ / "in.jsonl").size(), 15u);
  o.out = dir_ / "tokenizer.json";
  expect_error(o, *tok_, "is the tokenizer file", dir_, files);
  o.out = dir_ / "sub";
  expect_error(o, *tok_, "sub: is a directory", dir_, files);
  o.out = dir_ / "sub" / "";
  expect_error(o, *tok_, "the output must name a file", dir_, files);
}

// Review regression: bytes read run ahead of the records parsed, so a report said 100% while
// chunks were still being tokenized, and the last chunk's report could be rate-limited away.
TEST_F(PackerTest, TokenizeProgressReachesTotalOnceAtTheEnd) {
  std::string corpus;
  for (int i = 0; i < 300; ++i) corpus += R"({"text": "doc )" + std::to_string(i) + "\"}\n";
  write_text(dir_ / "p.jsonl", corpus);
  PackOptions o;
  o.inputs = {dir_ / "p.jsonl"};
  o.out = dir_ / "p.h5";
  o.seq_len = 16;
  o.eos_id = kEos;
  std::vector<PackProgress> reports;
  o.progress = [&](const PackProgress& p) {
    if (std::string_view(p.phase) == "tokenize") reports.push_back(p);
  };
  const PackSummary s = pack(*tok_, o);
  ASSERT_FALSE(reports.empty());
  EXPECT_EQ(reports.back().done, corpus.size());
  EXPECT_EQ(reports.back().total, corpus.size());
  EXPECT_EQ(reports.back().documents, s.documents);
  for (size_t i = 0; i + 1 < reports.size(); ++i) EXPECT_LT(reports[i].done, reports[i].total) << i;
}

TEST_F(PackerTest, SkipBadCountsAndSkipsMalformedRecords) {
  write_text(dir_ / "mixed.jsonl", R"({"text": "ok"})" "\n" "{broken\n" R"({"input_ids": [999]})" "\n"
                                   R"({"text": "fine"})" "\n");
  write_text(dir_ / "u.txt", "good\n\xc3\x28\n");
  PackOptions o;
  o.inputs = {dir_ / "mixed.jsonl", dir_ / "u.txt"};
  o.out = dir_ / "skip.h5";
  o.seq_len = 8;
  o.eos_id = kEos;
  o.skip_bad = true;
  o.txt_mode = TxtMode::line;
  std::vector<std::string> warnings;
  o.warn = [&](const std::string& w) { warnings.push_back(w); };
  const PackSummary s = pack(*tok_, o);
  EXPECT_EQ(s.documents, 3);
  EXPECT_EQ(s.bad_records, 2);
  EXPECT_EQ(s.invalid_utf8, 1);
  ASSERT_EQ(warnings.size(), 3u);
  EXPECT_NE(warnings[0].find("mixed.jsonl:2:"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[1].find("mixed.jsonl:3:"), std::string::npos) << warnings[1];
  EXPECT_NE(warnings[2].find("u.txt:2:"), std::string::npos) << warnings[2];
}

TEST_F(PackerTest, SeparatorResolution) {
  EXPECT_EQ(resolve_separator(*tok_, "", {}), kEos);
  EXPECT_EQ(resolve_separator(*tok_, "<|im_end|>", {}), kImEnd);
  try {
    resolve_separator(*tok_, "<|nope|>", {});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--eos-token '<|nope|>'"), std::string::npos) << e.what();
  }
  // A tokenizer without <|endoftext|>: the model's eos_token_id, or an error saying what to give.
  json j = tiny_tokenizer_json();
  json kept = json::array();
  for (const auto& t : j["added_tokens"])
    if (t["content"] != "<|endoftext|>") kept.push_back(t);
  j["added_tokens"] = kept;
  fs::create_directories(dir_ / "noeos");
  write_text(dir_ / "noeos" / "tokenizer.json", j.dump());
  const Tokenizer noeos = Tokenizer::load(dir_ / "noeos");
  ASSERT_FALSE(noeos.token_to_id("<|endoftext|>"));
  try {
    resolve_separator(noeos, "", {});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no <|endoftext|> token; give --eos-token"), std::string::npos) << e.what();
  }
  TinyModelOptions mo;
  Qwen3Config cfg = tiny_config(mo);
  cfg.eos_token_id = kImStart;
  write_text(dir_ / "noeos" / "config.json", cfg.to_json().dump());
  const std::string config = (dir_ / "noeos" / "config.json").string();
  EXPECT_EQ(resolve_separator(noeos, "", ModelEos{formats::read_config_token_id(config, "eos_token_id"), config}),
            kImStart);
  try {
    resolve_separator(noeos, "", ModelEos{std::nullopt, config});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(config + ": has no eos_token_id; give --eos-token"), std::string::npos)
        << e.what();
  }
}


// A packed file whose global heap (the store of its string attributes) was damaged so that
// libhdf5 1.10 loops forever reading it (found by tests/fuzz): opening it must end with one
// line naming the file and a non-zero exit, not hang.
TEST(PackedDatasetDamage, AGlobalHeapThatHangsLibhdf5EndsTheProcessWithOneLine) {
  const std::string file = std::string(RETAIN_FIXTURES_DIR) + "/../fuzz/regressions/packed_dataset/hdf5-global-heap-loop.h5";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        formats::h5::set_read_deadline_seconds(1);
        (void)PackedDataset::open(file);
      },
      ::testing::ExitedWithCode(1), "error: .*hdf5-global-heap-loop.h5: reading attribute .* did not finish in 1 s: the file is damaged");
}

// A string whose heap reference names an object the heap does not hold: libhdf5 1.10 reads
// out of bounds and crashes (found by tests/fuzz). One line and exit 1, not a segfault.
TEST(PackedDatasetDamage, AHeapReferenceThatCrashesLibhdf5EndsTheProcessWithOneLine) {
  const std::string file = std::string(RETAIN_FIXTURES_DIR) + "/../fuzz/regressions/packed_dataset/libhdf5-heap-index-segv.h5";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT((void)PackedDataset::open(file), ::testing::ExitedWithCode(1),
              "error: .*libhdf5-heap-index-segv.h5: reading attribute .* crashed inside libhdf5: the file is damaged");
}

}  // namespace
}  // namespace retain::data::test
