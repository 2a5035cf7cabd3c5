// The packed-dataset reader (validation, round trip, positions), the model checks, and the
// data-parallel Loader: shards disjoint and covering, the global batch independent of the world
// size, and an exact resume from a serialized cursor.
#include <algorithm>
#include <numeric>
#include <set>

#include "data/formats/h5.h"
#include "data/loader.h"
#include "data/tokenizer/sha256.h"
#include "model/config.h"
#include "tests/data/pack_helpers.h"

namespace retain::data::test {
namespace {

using json = nlohmann::json;

class LoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tok_ = std::make_unique<Tokenizer>(tiny_tokenizer(dir_.path()));
    // Documents "a", "bb", ..., of 1..12 bytes + separator, packed in order into rows of 8.
    std::string corpus;
    for (int i = 0; i < 41; ++i) corpus += json{{"text", std::string(1 + i % 12, static_cast<char>('a' + i % 26))}}.dump() + "\n";
    write_text(dir_ / "c.jsonl", corpus);
    PackOptions o;
    o.inputs = {dir_ / "c.jsonl"};
    o.out = dir_ / "d.h5";
    o.seq_len = 8;
    o.eos_id = 256;
    o.order = DocOrder::input;
    pack(*tok_, o);
  }

  TempDir dir_;
  std::unique_ptr<Tokenizer> tok_;
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

TEST_F(LoaderTest, ReadGivesTheSequenceWithDesignPositions) {
  const PackedDataset ds = PackedDataset::open(dir_ / "d.h5");
  EXPECT_EQ(ds.seq_len(), 8);
  // 41 documents, i % 12 + 2 tokens each: 41·2 + Σ(i mod 12) = 82 + 3·66 + (0+1+2+3+4) = 290.
  EXPECT_EQ(ds.num_sequences(), (290 + 7) / 8);
  const int32_t a = tok_->encode("a").at(0), b = tok_->encode("b").at(0), c = tok_->encode("c").at(0);
  // "a" EOS "bb" EOS "ccc" | EOS ...: row 0 ends inside document 2, which row 1 continues.
  const PackedSequence s0 = ds.read(0), s1 = ds.read(1);
  EXPECT_EQ(s0.input_ids, (std::vector<int32_t>{a, 256, b, b, 256, c, c, c}));
  EXPECT_EQ(s0.doc_ids, (std::vector<int32_t>{0, 0, 1, 1, 1, 2, 2, 2}));
  EXPECT_EQ(s0.positions, (std::vector<int32_t>{0, 1, 0, 1, 2, 0, 1, 2}));
  EXPECT_EQ(s0.target_mask, std::vector<uint8_t>(8, 1));
  EXPECT_EQ(s1.doc_ids[0], 2);
  EXPECT_EQ(s1.positions[0], 0);  // a continued document restarts at 0 (DESIGN §4)
  EXPECT_EQ(s1.input_ids[0], 256);
  const PackedSequence last = ds.read(ds.num_sequences() - 1);
  EXPECT_EQ(last.doc_ids.back(), -1);
  EXPECT_EQ(last.positions.back(), 0);
  EXPECT_NE(error_of([&] { ds.read(ds.num_sequences()); }).find("out of range"), std::string::npos);

  const std::vector<int64_t> rows = {3, 0};
  const PackedBatch batch = ds.read_batch(rows);
  EXPECT_EQ(batch.input_ids.shape(), (Shape{2, 8}));
  EXPECT_EQ(batch.target_mask.dtype(), DType::U8);
  EXPECT_TRUE(std::equal(s0.positions.begin(), s0.positions.end(), batch.positions.data<int32_t>() + 8));
  EXPECT_TRUE(std::equal(s0.doc_ids.begin(), s0.doc_ids.end(), batch.doc_ids.data<int32_t>() + 8));
}

TEST_F(LoaderTest, ShardsAreDisjointCoverTheEpochAndTheGlobalBatchIgnoresWorldSize) {
  const PackedDataset ds = PackedDataset::open(dir_ / "d.h5");
  const int64_t N = ds.num_sequences(), B = 6;
  ASSERT_NE(N % B, 0);  // there is a tail
  std::vector<std::vector<int64_t>> one_rank;  // global batches of a 1-rank world, 2 epochs
  {
    Loader l(ds, {B, 0, 1, 42});
    EXPECT_EQ(l.steps_per_epoch(), N / B);
    for (int64_t s = 0; s < 2 * l.steps_per_epoch(); ++s) one_rank.push_back(l.next_rows());
  }
  for (int world : {1, 2, 3}) {
    std::vector<Loader> ranks;
    for (int r = 0; r < world; ++r) ranks.emplace_back(ds, LoaderOptions{B, r, world, 42});
    for (int epoch = 0; epoch < 2; ++epoch) {
      std::vector<std::set<int64_t>> shard(static_cast<size_t>(world));
      std::set<int64_t> epoch_rows;
      for (int64_t s = 0; s < N / B; ++s) {
        std::vector<int64_t> global;
        for (int r = 0; r < world; ++r) {
          const auto rows = ranks[static_cast<size_t>(r)].next_rows();
          EXPECT_EQ(static_cast<int64_t>(rows.size()), B / world);
          global.insert(global.end(), rows.begin(), rows.end());
          shard[static_cast<size_t>(r)].insert(rows.begin(), rows.end());
        }
        EXPECT_EQ(global, one_rank[static_cast<size_t>(epoch * (N / B) + s)]) << "world " << world;
        epoch_rows.insert(global.begin(), global.end());
      }
      // Disjoint shards (no row twice in an epoch) covering all but the tail.
      size_t total = 0;
      for (const auto& sh : shard) total += sh.size();
      EXPECT_EQ(total, static_cast<size_t>(N / B * B));
      EXPECT_EQ(epoch_rows.size(), static_cast<size_t>(N / B * B));
      for (int64_t row : epoch_rows) EXPECT_TRUE(row >= 0 && row < N);
      // The skipped tail is the end of this epoch's permutation.
      const auto perm = Loader::epoch_permutation(N, 42, epoch);
      for (int64_t k = N / B * B; k < N; ++k) EXPECT_FALSE(epoch_rows.count(perm[static_cast<size_t>(k)]));
    }
  }
  EXPECT_NE(one_rank[0], one_rank[static_cast<size_t>(N / B)]);  // epochs differ
  EXPECT_NE(Loader::epoch_permutation(N, 42, 0), Loader::epoch_permutation(N, 43, 0));
}

TEST_F(LoaderTest, ResumeFromASerializedCursorYieldsTheSameBatches) {
  const PackedDataset ds = PackedDataset::open(dir_ / "d.h5");
  const int64_t B = 4;
  Loader a(ds, {B, 1, 2, 9});
  for (int i = 0; i < 11; ++i) a.next_rows();  // past the first epoch's end
  const std::string saved = a.cursor().to_json(B, ds.num_sequences()).dump();
  std::vector<PackedBatch> want;
  for (int i = 0; i < 12; ++i) want.push_back(a.next());
  const Cursor c = Cursor::from_json(json::parse(saved), B, ds.num_sequences(), "ckpt/state.json");
  EXPECT_EQ(c.seed, 9u);
  Loader b(ds, {B, 1, 2, 9}, c);
  for (int i = 0; i < 12; ++i) {
    const PackedBatch got = b.next();
    EXPECT_EQ(got.rows, want[static_cast<size_t>(i)].rows);
    EXPECT_EQ(0, std::memcmp(got.input_ids.data<int32_t>(), want[static_cast<size_t>(i)].input_ids.data<int32_t>(),
                             got.input_ids.nbytes()));
  }
  // A different world size resumes the same global batches.
  Loader g1(ds, {B, 0, 1, 9}, c);
  Loader r0(ds, {B, 0, 4, 9}, c), r3(ds, {B, 3, 4, 9}, c);
  const auto global = g1.next_rows();
  EXPECT_EQ(r0.next_rows(), std::vector<int64_t>{global[0]});
  EXPECT_EQ(r3.next_rows(), std::vector<int64_t>{global[3]});

  EXPECT_NE(error_of([&] { Cursor::from_json(json::parse(saved), 8, ds.num_sequences(), "ckpt/state.json"); })
                .find("ckpt/state.json: data cursor was saved with global batch 4, resuming with 8"),
            std::string::npos);
  EXPECT_NE(error_of([&] { Cursor::from_json(json{{"seed", 1}}, B, ds.num_sequences(), "x.json"); }).find("x.json"),
            std::string::npos);
}

// Every world size 1..5 (B = 2·world): each rank's rows over a whole epoch are disjoint from the
// other ranks', together they are exactly the epoch's first steps·B permuted rows, and a loader
// resumed from any step's cursor continues with the same rows.
TEST_F(LoaderTest, EveryWorldSizeUpToFiveShardsDisjointlyAndResumesAtAnyStep) {
  const PackedDataset ds = PackedDataset::open(dir_ / "d.h5");
  const int64_t N = ds.num_sequences();
  for (int world = 1; world <= 5; ++world) {
    const int64_t B = 2 * world, steps = N / B;
    std::vector<Loader> ranks;
    for (int r = 0; r < world; ++r) ranks.emplace_back(ds, LoaderOptions{B, r, world, 7});
    std::vector<int64_t> seen;
    for (int64_t s = 0; s < steps; ++s)
      for (int r = 0; r < world; ++r) {
        const Cursor c = ranks[static_cast<size_t>(r)].cursor();
        const auto rows = ranks[static_cast<size_t>(r)].next_rows();
        Loader resumed(ds, {B, r, world, 7},
                       Cursor::from_json(json::parse(c.to_json(B, N).dump()), B, N, "state.json"));
        EXPECT_EQ(resumed.next_rows(), rows) << "world " << world << " step " << s;
        seen.insert(seen.end(), rows.begin(), rows.end());
      }
    const auto perm = Loader::epoch_permutation(N, 7, 0);
    std::vector<int64_t> want(perm.begin(), perm.begin() + steps * B);
    std::sort(seen.begin(), seen.end());
    std::sort(want.begin(), want.end());
    EXPECT_EQ(seen, want) << "world " << world;
    EXPECT_EQ(std::adjacent_find(seen.begin(), seen.end()), seen.end()) << "world " << world;  // disjoint
    EXPECT_EQ(ranks[0].cursor(), (Cursor{7, 1, 0}));
  }
}

// Review regression: a zero global batch divided by zero, a negative seed wrapped around.
TEST_F(LoaderTest, BadCursorsAreClearErrors) {
  const int64_t N = PackedDataset::open(dir_ / "d.h5").num_sequences();
  const json good = Cursor{3, 1, 2}.to_json(4, N);
  EXPECT_EQ(Cursor::from_json(good, 4, N, "s.json"), (Cursor{3, 1, 2}));
  json zero = good;
  zero["global_batch"] = 0;
  EXPECT_NE(error_of([&] { Cursor::from_json(zero, 0, N, "s.json"); }).find("s.json: data cursor: global batch 0"),
            std::string::npos);
  json negative = good;
  negative["seed"] = -1;
  EXPECT_NE(error_of([&] { Cursor::from_json(negative, 4, N, "s.json"); }).find("'seed' must not be negative"),
            std::string::npos);
  json far = good;
  far["step"] = N / 4 + 1;
  EXPECT_NE(error_of([&] { Cursor::from_json(far, 4, N, "s.json"); }).find("out of range"), std::string::npos);
  json big_seed = good;
  big_seed["seed"] = UINT64_MAX;
  EXPECT_EQ(Cursor::from_json(big_seed, 4, N, "s.json").seed, UINT64_MAX);
}

TEST_F(LoaderTest, BadLoaderSettingsAreClearErrors) {
  const PackedDataset ds = PackedDataset::open(dir_ / "d.h5");
  EXPECT_NE(error_of([&] { (void)Loader(ds, {6, 0, 4, 0}); }).find("multiple of the number of ranks 4"), std::string::npos);
  EXPECT_NE(error_of([&] { (void)Loader(ds, {1000, 0, 1, 0}); }).find("fewer than one global batch of 1000"),
            std::string::npos);
  EXPECT_NE(error_of([&] { (void)Loader(ds, {2, 2, 2, 0}); }).find("rank 2 is outside"), std::string::npos);
}

TEST_F(LoaderTest, ModelChecksRefuseAnotherVocabularyOrTokenizer) {
  const PackedDataset ds = PackedDataset::open(dir_ / "d.h5");
  const fs::path model = dir_ / "model";
  fs::create_directories(model);
  Qwen3Config cfg;
  cfg.vocab_size = 512;
  check_dataset_matches_model(ds, model, cfg.vocab_size);  // no tokenizer.json: the vocabulary check only
  fs::copy_file(dir_ / "tokenizer.json", model / "tokenizer.json");
  check_dataset_matches_model(ds, model, cfg.vocab_size);  // the same tokenizer bytes
  cfg.vocab_size = 200;
  std::string e = error_of([&] { check_dataset_matches_model(ds, model, cfg.vocab_size); });
  EXPECT_NE(e.find("d.h5: vocab_size 259 exceeds the model's vocab_size 200"), std::string::npos) << e;
  EXPECT_NE(e.find("config.json"), std::string::npos) << e;
  cfg.vocab_size = 512;
  write_text(model / "tokenizer.json", tiny_tokenizer_json().dump(1));  // same tokens, other bytes
  e = error_of([&] { check_dataset_matches_model(ds, model, cfg.vocab_size); });
  EXPECT_NE(e.find("d.h5: was packed with a tokenizer (sha256 " + tok_->sha256() + ")"), std::string::npos) << e;
  EXPECT_NE(e.find((model / "tokenizer.json").string()), std::string::npos) << e;
  EXPECT_EQ(sha256_file(dir_ / "tokenizer.json"), tok_->sha256());
}

// Writes an HDF5 file by hand, so the reader meets layouts retain-pack never writes.
void write_h5(const fs::path& p, hid_t ids_type, bool with_vocab, int32_t bad_id = -2) {
  hid_t f = H5Fcreate(p.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  const hsize_t dims[2] = {2, 4};
  hid_t space = H5Screate_simple(2, dims, nullptr);
  std::vector<int32_t> ids(8, 1), docs(8, 0);
  std::vector<uint8_t> mask(8, 1);
  if (bad_id != -2) ids[5] = bad_id;
  hid_t d1 = H5Dcreate2(f, "input_ids", ids_type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  H5Dwrite(d1, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, ids.data());
  hid_t d2 = H5Dcreate2(f, "doc_ids", H5T_STD_I32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  H5Dwrite(d2, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, docs.data());
  hid_t d3 = H5Dcreate2(f, "target_mask", H5T_STD_U8LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  H5Dwrite(d3, H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, mask.data());
  const std::string f_name = p.string();
  formats::h5::write_attr_i64(f, "seq_len", 4, f_name);
  if (with_vocab) formats::h5::write_attr_i64(f, "vocab_size", 10, f_name);
  formats::h5::write_attr_i64(f, "eos_token_id", 2, f_name);
  formats::h5::write_attr_str(f, "tokenizer_sha256", std::string(64, 'a'), f_name);
  formats::h5::write_attr_str(f, "packing", "concat", f_name);
  H5Dclose(d1), H5Dclose(d2), H5Dclose(d3), H5Sclose(space), H5Fclose(f);
}

TEST_F(LoaderTest, OpenValidatesTheLayoutWithClearErrors) {
  formats::h5::silence_hdf5_errors();
  write_h5(dir_ / "ok.h5", H5T_STD_I32LE, true);
  EXPECT_EQ(PackedDataset::open(dir_ / "ok.h5").num_sequences(), 2);
  write_h5(dir_ / "i64.h5", H5T_STD_I64LE, true);
  EXPECT_NE(error_of([&] { PackedDataset::open(dir_ / "i64.h5"); }).find("i64.h5: dataset '/input_ids' must be int32"),
            std::string::npos);
  write_h5(dir_ / "novocab.h5", H5T_STD_I32LE, false);
  EXPECT_NE(error_of([&] { PackedDataset::open(dir_ / "novocab.h5"); }).find("novocab.h5: missing attribute 'vocab_size'"),
            std::string::npos);
  write_h5(dir_ / "badid.h5", H5T_STD_I32LE, true, 10);
  const PackedDataset bad = PackedDataset::open(dir_ / "badid.h5");
  EXPECT_NO_THROW(bad.read(0));
  EXPECT_NE(error_of([&] { bad.read(1); }).find("badid.h5: sequence 1 position 1: token id 10 is outside"),
            std::string::npos);
  write_text(dir_ / "text.h5", "not hdf5");
  EXPECT_NE(error_of([&] { PackedDataset::open(dir_ / "text.h5"); }).find("text.h5: not an HDF5 file"),
            std::string::npos);
  EXPECT_NE(error_of([&] { PackedDataset::open(dir_ / "none.h5"); }).find("none.h5: no such file"), std::string::npos);
}

}  // namespace
}  // namespace retain::data::test
