// safetensors reader/writer: round trips, the on-disk layout, and -- the point of the
// ASan/UBSan build of this file -- that malformed files (truncated, corrupted, hand-made
// bad headers, broken shard sets) always end in a retain::Error naming the file, never
// in a crash or an out-of-bounds read.
#include "data/formats/safetensors.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace retain {
namespace {

namespace fs = std::filesystem;

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::string& bytes) {
  // Unlink first: ext4 flushes a file truncated and rewritten in place on close, which
  // would make the thousands of rewrites below take seconds.
  fs::remove(path);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A raw file: length, header exactly as given, then `data_bytes` bytes of data.
std::string raw_file(const std::string& header, size_t data_bytes) {
  return le64(header.size()) + header + std::string(data_bytes, '\x5a');
}

std::string bytes_of(const Tensor& t) { return {static_cast<const char*>(t.raw()), t.nbytes()}; }

Tensor random_tensor(const Shape& shape, DType dtype, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, dtype);
  auto* p = static_cast<unsigned char*>(t.raw());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<unsigned char>(rng());
  return t;
}

// Reads every byte of every tensor, so the sanitizer sees each access.
uint64_t touch_all(const formats::SafetensorsFile& f) {
  uint64_t sum = 0;
  for (const std::string& name : f.names()) {
    Tensor t = f.tensor(name);
    const auto* p = static_cast<const unsigned char*>(t.raw());
    for (size_t i = 0; i < t.nbytes(); ++i) sum += p[i];
  }
  return sum;
}

// The message of the retain::Error that opening `path` throws ("" if it opens).
std::string open_error(const std::string& path) {
  try {
    formats::SafetensorsFile::open(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string open_dir_error(const std::string& dir) {
  try {
    formats::SafetensorsSet::open_dir(dir);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "retain_st_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (fs::path(dir_) / name).string(); }
  std::vector<std::string> listing() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
  std::string dir_;
};

TEST_F(Safetensors, RoundTripEveryDtypeAndShape) {
  std::mt19937 rng(1);
  const DType dtypes[] = {DType::BOOL, DType::U8,  DType::I8,  DType::I16, DType::U16, DType::F16, DType::BF16,
                          DType::I32,  DType::U32, DType::F32, DType::I64, DType::U64, DType::F64};
  const Shape shapes[] = {{}, {0}, {2, 0, 3}, {5}, {2, 3}, {1, 3, 1, 2}};
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (DType dt : dtypes)
    for (size_t s = 0; s < std::size(shapes); ++s)
      tensors.emplace_back(fmt::format("{}.{}", dtype_name(dt), s), random_tensor(shapes[s], dt, rng));
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "ünïcode ok"}};
  const std::string p = path("model.safetensors");
  formats::write_safetensors(p, tensors, meta);

  formats::SafetensorsFile f = formats::SafetensorsFile::open(p);
  EXPECT_EQ(f.path(), p);
  EXPECT_EQ(f.metadata(), meta);
  std::vector<std::string> want;
  for (const auto& [name, t] : tensors) want.push_back(name);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(f.names(), want);
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(f.contains(name));
    const formats::SafetensorsEntry& e = f.entry(name);
    EXPECT_EQ(e.name, name);
    EXPECT_EQ(e.dtype, t.dtype());
    EXPECT_EQ(e.shape, t.shape());
    EXPECT_EQ(e.end - e.begin, t.nbytes());
    Tensor r = f.tensor(name);
    EXPECT_EQ(r.dtype(), t.dtype()) << name;
    EXPECT_EQ(r.shape(), t.shape()) << name;
    EXPECT_EQ(bytes_of(r), bytes_of(t)) << name;
  }
  EXPECT_FALSE(f.contains("nope"));

  // The same file through the directory interface.
  formats::SafetensorsSet set = formats::SafetensorsSet::open_dir(dir_);
  EXPECT_EQ(set.names(), want);
  EXPECT_EQ(set.metadata(), meta);
  EXPECT_EQ(set.file_of("F32.4"), p);
  EXPECT_EQ(bytes_of(set.tensor("F32.4")), bytes_of(f.tensor("F32.4")));
}

TEST_F(Safetensors, DataLaidOutInGivenOrder) {
  const std::string p = path("a.safetensors");
  formats::write_safetensors(p, {{"z", Tensor::from_vector<float>({1, 2}, {2})}, {"a", Tensor::from_vector<int64_t>({3}, {1})}});
  formats::SafetensorsFile f = formats::SafetensorsFile::open(p);
  EXPECT_EQ(f.entry("z").begin, 0u);
  EXPECT_EQ(f.entry("z").end, 8u);
  EXPECT_EQ(f.entry("a").begin, 8u);
  EXPECT_EQ(f.entry("a").end, 16u);
  EXPECT_EQ(f.tensor("z").data<float>()[1], 2.0f);
  EXPECT_EQ(f.tensor("a").data<int64_t>()[0], 3);
}

TEST_F(Safetensors, HeaderPaddedToMultipleOf8) {
  for (size_t len = 1; len <= 24; ++len) {
    const std::string p = path("pad.safetensors");
    formats::write_safetensors(p, {{std::string(len, 'w'), Tensor::from_vector<uint8_t>({7, 8, 9}, {3})}},
                      len % 2 ? std::map<std::string, std::string>{} : std::map<std::string, std::string>{{"k", "v"}});
    const std::string bytes = read_bytes(p);
    ASSERT_GE(bytes.size(), 8u);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
    EXPECT_EQ((8 + n) % 8, 0u) << len;
    EXPECT_EQ(bytes.size(), 8 + n + 3) << len;
    EXPECT_EQ(bytes.substr(8 + n), std::string("\x07\x08\x09")) << len;
    const std::string header = bytes.substr(8, n);
    EXPECT_EQ(header.find("__metadata__") != std::string::npos, len % 2 == 0) << header;
    // Padding is spaces after the JSON object.
    EXPECT_EQ(header.substr(header.rfind('}') + 1), std::string(n - 1 - header.rfind('}'), ' '));
    EXPECT_EQ(formats::SafetensorsFile::open(p).tensor(std::string(len, 'w')).data<uint8_t>()[2], 9);
  }
}

TEST_F(Safetensors, EmptyFileIsValid) {
  const std::string p = path("empty.safetensors");
  formats::write_safetensors(p, {});
  formats::SafetensorsFile f = formats::SafetensorsFile::open(p);
  EXPECT_TRUE(f.names().empty());
  EXPECT_TRUE(f.metadata().empty());
  EXPECT_EQ(read_bytes(p).size() % 8, 0u);

  write_bytes(p, raw_file("{}", 0));  // unpadded, by hand
  EXPECT_TRUE(formats::SafetensorsFile::open(p).names().empty());
}

TEST_F(Safetensors, ViewIsZeroCopyAndKeepsMappingAlive) {
  const std::string p = path("v.safetensors");
  formats::write_safetensors(p, {{"x", Tensor::from_vector<float>({1.5f, -2.f, 3.f}, {3})}});
  Tensor a, b;
  {
    formats::SafetensorsFile f = formats::SafetensorsFile::open(p);
    a = f.tensor("x");
    b = f.tensor("x");
  }  // the file object is gone; the views hold the mapping
  EXPECT_EQ(a.raw(), b.raw());
  EXPECT_EQ(a.data<float>()[0], 1.5f);
  EXPECT_EQ(b.data<float>()[2], 3.f);
}

TEST_F(Safetensors, MisalignedDataComesBackAsAlignedCopy) {
  // A 1-byte U8 tensor first puts the F32 tensor at data offset 1, and the hand-made
  // header (length 8 + 46) is not padded either.
  const std::string header =
      R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}})";
  std::string bytes = le64(header.size()) + header + '\x01';
  const float vals[2] = {0.25f, -7.f};
  bytes.append(reinterpret_cast<const char*>(vals), sizeof vals);
  const std::string p = path("mis.safetensors");
  write_bytes(p, bytes);
  formats::SafetensorsFile f = formats::SafetensorsFile::open(p);
  Tensor b = f.tensor("b");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.raw()) % alignof(float), 0u);
  EXPECT_EQ(b.data<float>()[0], 0.25f);
  EXPECT_EQ(b.data<float>()[1], -7.f);
  EXPECT_EQ(f.tensor("a").data<uint8_t>()[0], 1);
}

TEST_F(Safetensors, AtomicWriteLeavesNoTemporary) {
  formats::write_safetensors(path("ok.safetensors"), {{"x", Tensor::from_vector<int32_t>({1, 2}, {2})}});
  EXPECT_EQ(listing(), std::vector<std::string>{"ok.safetensors"});

  // Into a missing directory: a retain::Error naming the path, and nothing created.
  const std::string missing = path("no/such/dir/x.safetensors");
  try {
    formats::write_safetensors(missing, {{"x", Tensor::from_vector<int32_t>({1}, {1})}});
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(path("no")));
  EXPECT_EQ(listing(), std::vector<std::string>{"ok.safetensors"});

  // Rejected inputs leave nothing behind either, and never clobber an existing file.
  const std::string before = read_bytes(path("ok.safetensors"));
  Tensor t = Tensor::from_vector<float>({1}, {1});
  EXPECT_THROW(formats::write_safetensors(path("ok.safetensors"), {{"x", t}, {"x", t}}), Error);
  EXPECT_THROW(formats::write_safetensors(path("ok.safetensors"), {{"__metadata__", t}}), Error);
  EXPECT_THROW(formats::write_safetensors(path("ok.safetensors"), {{"x", Tensor()}}), Error);
  EXPECT_THROW(formats::write_safetensors(path("ok.safetensors"), {{std::string("\xff\xfe"), t}}), Error);
  EXPECT_EQ(listing(), std::vector<std::string>{"ok.safetensors"});
  EXPECT_EQ(read_bytes(path("ok.safetensors")), before);
}

TEST_F(Safetensors, LookupOfMissingTensorNamesFileAndTensor) {
  const std::string p = path("m.safetensors");
  formats::write_safetensors(p, {{"x", Tensor::from_vector<float>({1}, {1})}});
  formats::SafetensorsFile f = formats::SafetensorsFile::open(p);
  try {
    f.tensor("nope");
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), p + ": no tensor 'nope'");
  }
  EXPECT_THROW(f.entry("nope"), Error);
  EXPECT_THROW(formats::SafetensorsSet::open_dir(dir_), Error);  // no model.safetensors here
}

TEST_F(Safetensors, TruncatedAtEveryLengthFails) {
  const std::string good = path("good.safetensors");
  formats::write_safetensors(good, {{"a", Tensor::from_vector<float>({1, 2, 3}, {3})},
                           {"b", Tensor::from_vector<uint8_t>({4, 5}, {2})}},
                    {{"k", "v"}});
  const std::string bytes = read_bytes(good);
  const std::string p = path("cut.safetensors");
  for (size_t len = 0; len < bytes.size(); ++len) {
    write_bytes(p, bytes.substr(0, len));
    const std::string err = open_error(p);
    EXPECT_EQ(err.rfind(p + ": ", 0), 0u) << "length " << len << ": '" << err << "'";
  }
}

TEST_F(Safetensors, RandomCorruptionNeverCrashes) {
  const std::string good = path("good.safetensors");
  formats::write_safetensors(good, {{"w", Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2})},
                           {"b", Tensor::from_vector<uint8_t>({1, 2, 3, 4, 5, 6, 7, 8}, {8})},
                           {"s", Tensor::from_vector<int64_t>({9}, {})}},
                    {{"format", "pt"}});
  const std::string bytes = read_bytes(good);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  const std::string p = path("fuzz.safetensors");
  const char interesting[] = "0123456789{}[]\",:-. eE";
  std::mt19937 rng(12345);
  int opened = 0, rejected = 0;
  for (int iter = 0; iter < 2000; ++iter) {
    std::string b = bytes;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < edits; ++k) {
      const size_t at = 8 + rng() % n;
      switch (rng() % 5) {
        case 0: b[at] = static_cast<char>(b[at] ^ (1 << (rng() % 8))); break;  // bit flip
        case 1: b[at] = static_cast<char>(rng()); break;                        // random byte
        case 2: b[at] = interesting[rng() % (sizeof interesting - 1)]; break;   // JSON-ish byte
        case 3: b[rng() % 8] = static_cast<char>(rng()); break;                 // length byte
        case 4: b.replace(0, 8, le64(n + (rng() % 33) - 16)); break;            // length nearby
      }
    }
    write_bytes(p, b);
    try {
      formats::SafetensorsFile f = formats::SafetensorsFile::open(p);
      touch_all(f);
      ++opened;
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind(p + ": ", 0), 0u) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << iter << ": non-retain exception: " << e.what();
    }
  }
  EXPECT_GT(rejected, 0);
  EXPECT_GT(opened, 0);  // some edits (padding, digits in values) keep the file valid
}

TEST_F(Safetensors, BadHeadersAreRejected) {
  // A valid F32 [2] entry at [0, 8) to combine with.
  const std::string ok = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  struct Case {
    const char* what;
    std::string file;
    const char* expect;  // substring of the message
  };
  const Case cases[] = {
      {"7-byte file", std::string(7, '\0'), "too small"},
      {"header length past the end", le64(100) + "{}", "exceeds"},
      {"header length huge", le64(~0ull) + "{}", "exceeds"},
      {"header length 2^63", le64(1ull << 63) + std::string(16, ' '), "exceeds"},
      {"empty header", raw_file("", 0), "start with"},
      {"leading space", raw_file(" {}", 0), "start with"},
      {"array header", raw_file("[]", 0), "start with"},
      {"not JSON", raw_file("{abc", 0), "not valid JSON"},
      {"truncated JSON", raw_file("{" + ok, 8), "not valid JSON"},
      {"garbage after object", raw_file("{}x", 0), "not valid JSON"},
      {"bad UTF-8", raw_file("{\"\xff\":{}}", 0), "not valid JSON"},
      {"entry not object", raw_file(R"({"a":5})", 0), "not a JSON object"},
      {"missing dtype", raw_file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8), "dtype"},
      {"dtype not string", raw_file(R"({"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", 8), "dtype"},
      {"unknown dtype", raw_file(R"({"a":{"dtype":"F8","shape":[2],"data_offsets":[0,2]}})", 2), "unknown dtype"},
      {"missing shape", raw_file(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", 8), "shape"},
      {"shape not array", raw_file(R"({"a":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", 8), "shape"},
      {"negative dim", raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "negative"},
      {"fractional dim", raw_file(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8), "not an integer"},
      {"string dim", raw_file(R"({"a":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", 8), "not an integer"},
      {"dim beyond int64",
       raw_file(R"({"a":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,1]}})", 1), "too large"},
      {"dim beyond uint64",
       raw_file(R"({"a":{"dtype":"U8","shape":[99999999999999999999999],"data_offsets":[0,1]}})", 1), "not an integer"},
      {"numel overflows",
       raw_file(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296,4294967296,0],"data_offsets":[0,0]}})", 0),
       "int64"},
      {"bytes overflow",
       raw_file(R"({"a":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,8]}})", 8), "overflows"},
      {"missing offsets", raw_file(R"({"a":{"dtype":"F32","shape":[2]}})", 8), "data_offsets"},
      {"one offset", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8]}})", 8), "data_offsets"},
      {"three offsets", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})", 8), "data_offsets"},
      {"negative offset", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", 8), "data_offsets"},
      {"string offset", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":["0",8]}})", 8), "data_offsets"},
      {"begin > end", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "begin > end"},
      {"end beyond data", raw_file("{" + ok + "}", 7), "beyond"},
      {"end far beyond data",
       raw_file(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[18446744073709551615,18446744073709551615]}})", 0),
       "beyond"},
      {"wrong size for shape", raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "needs 12"},
      {"overlap",
       raw_file("{" + ok + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12), "overlaps"},
      {"same range twice",
       raw_file("{" + ok + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8), "overlaps"},
      {"empty tensor inside another",
       raw_file("{" + ok + R"(,"b":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})", 8), "overlaps"},
      {"gap", raw_file("{" + ok + R"(,"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})", 16), "gap"},
      {"not starting at 0", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12), "gap"},
      {"trailing bytes", raw_file("{" + ok + "}", 9), "trailing"},
      {"data but no tensors", raw_file("{}", 1), "trailing"},
      {"metadata not object", raw_file(R"({"__metadata__":["x"]})", 0), "__metadata__"},
      {"metadata value number", raw_file(R"({"__metadata__":{"k":1}})", 0), "__metadata__"},
      {"metadata value null", raw_file(R"({"__metadata__":{"k":null}})", 0), "__metadata__"},
  };
  const std::string p = path("bad.safetensors");
  for (const Case& c : cases) {
    write_bytes(p, c.file);
    const std::string err = open_error(p);
    EXPECT_EQ(err.rfind(p + ": ", 0), 0u) << c.what << ": '" << err << "'";
    EXPECT_NE(err.find(c.expect), std::string::npos) << c.what << ": '" << err << "'";
    EXPECT_EQ(err.find('\n'), std::string::npos) << c.what << ": '" << err << "'";
  }
  // Not a file at all.
  EXPECT_EQ(open_error(path("missing.safetensors")).rfind(path("missing.safetensors") + ": ", 0), 0u);
  EXPECT_EQ(open_error(dir_).rfind(dir_ + ": ", 0), 0u);
}

// A 2-shard checkpoint: a, b in shard 1 and c in shard 2, unless a test changes it.
class ShardedSet : public Safetensors {
 protected:
  void SetUp() override {
    Safetensors::SetUp();
    formats::write_safetensors(path(kShard1), {{"a", Tensor::from_vector<float>({1, 2}, {2})},
                                      {"b", Tensor::from_vector<int32_t>({3}, {1})}},
                      {{"format", "pt"}});
    formats::write_safetensors(path(kShard2), {{"c", Tensor::from_vector<double>({4, 5, 6}, {3, 1})}});
  }
  void write_index(const std::string& weight_map) {
    write_bytes(path("model.safetensors.index.json"),
                R"({"metadata":{"total_size":44},"weight_map":)" + weight_map + "}");
  }
  std::string good_map() const {
    return fmt::format(R"({{"a":"{0}","b":"{0}","c":"{1}"}})", kShard1, kShard2);
  }
  // Expects open_dir to fail with a message starting with `who` and containing `what`.
  void expect_error(const std::string& who, const std::string& what) {
    const std::string err = open_dir_error(dir_);
    EXPECT_EQ(err.rfind(who + ": ", 0), 0u) << err;
    EXPECT_NE(err.find(what), std::string::npos) << err;
  }
  std::string index() const { return path("model.safetensors.index.json"); }
  static constexpr const char* kShard1 = "model-00001-of-00002.safetensors";
  static constexpr const char* kShard2 = "model-00002-of-00002.safetensors";
};

TEST_F(ShardedSet, RoundTrip) {
  write_index(good_map());
  // Decoy single file: the index must win when both exist.
  formats::write_safetensors(path("model.safetensors"), {{"zzz", Tensor::from_vector<float>({0}, {1})}});
  formats::SafetensorsSet set = formats::SafetensorsSet::open_dir(dir_);
  EXPECT_EQ(set.dir(), dir_);
  EXPECT_EQ(set.names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_TRUE(set.contains("c"));
  EXPECT_FALSE(set.contains("zzz"));
  EXPECT_EQ(set.file_of("a"), path(kShard1));
  EXPECT_EQ(set.file_of("c"), path(kShard2));
  EXPECT_EQ(set.entry("c").shape, (Shape{3, 1}));
  EXPECT_EQ(set.tensor("a").data<float>()[1], 2.f);
  EXPECT_EQ(set.tensor("b").data<int32_t>()[0], 3);
  EXPECT_EQ(set.tensor("c").data<double>()[2], 6.0);
  EXPECT_EQ(set.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  try {
    set.tensor("nope");
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), dir_ + ": no tensor 'nope'");
  }
}

TEST_F(ShardedSet, MissingShardFile) {
  write_index(R"({"a":"model-00001-of-00002.safetensors","b":"model-00001-of-00002.safetensors",)"
              R"("c":"model-00003-of-00003.safetensors"})");
  expect_error(index(), "model-00003-of-00003.safetensors does not exist");
}

TEST_F(ShardedSet, TensorMissingFromShard) {
  write_index(fmt::format(R"({{"a":"{0}","b":"{0}","c":"{1}","d":"{1}"}})", kShard1, kShard2));
  expect_error(index(), "'d' is listed in weight_map but missing from " + path(kShard2));
}

TEST_F(ShardedSet, TensorListedUnderWrongShard) {
  write_index(fmt::format(R"({{"a":"{1}","b":"{0}","c":"{1}"}})", kShard1, kShard2));
  expect_error(index(), "'a' is listed in weight_map but missing from " + path(kShard2));
}

TEST_F(ShardedSet, UnlistedTensor) {
  write_index(fmt::format(R"({{"a":"{0}","c":"{1}"}})", kShard1, kShard2));
  expect_error(index(), "'b' in " + path(kShard1) + " is not listed");
}

TEST_F(ShardedSet, DuplicateTensorAcrossShards) {
  formats::write_safetensors(path(kShard2), {{"c", Tensor::from_vector<double>({4, 5, 6}, {3, 1})},
                                    {"a", Tensor::from_vector<float>({1, 2}, {2})}});
  write_index(good_map());
  expect_error(index(), "'a' is in two shards: " + path(kShard1) + " and " + path(kShard2));
}

TEST_F(ShardedSet, PathEscapesInShardNames) {
  for (const char* bad : {"../model-00001-of-00002.safetensors", "sub/x.safetensors", "..", ".",
                          "/etc/passwd", "", "a\\\\b.safetensors"}) {
    write_index(fmt::format(R"({{"a":"{0}","b":"{0}","c":"{1}"}})", kShard1, bad));
    const std::string err = open_dir_error(dir_);
    EXPECT_EQ(err.rfind(index() + ": ", 0), 0u) << bad << ": " << err;
    EXPECT_NE(err.find("not a plain file name"), std::string::npos) << bad << ": " << err;
  }
  // A NUL byte must not cut the name short to an existing shard.
  write_index(fmt::format(R"({{"a":"{0}","b":"{0}","c":"{1}\u0000x"}})", kShard1, kShard2));
  expect_error(index(), "not a plain file name");
}

TEST_F(ShardedSet, MalformedIndex) {
  write_bytes(index(), "{\"weight_map\":");
  expect_error(index(), "not valid JSON");
  write_bytes(index(), "[1]");
  expect_error(index(), "weight_map");
  write_index("[]");
  expect_error(index(), "weight_map");
  write_index(R"({"a":1})");
  expect_error(index(), "not a string");
}

TEST_F(ShardedSet, CorruptShardNamesTheShard) {
  write_index(good_map());
  write_bytes(path(kShard2), raw_file("{}", 3));
  expect_error(path(kShard2), "trailing");
}

TEST_F(ShardedSet, NeitherFilePresent) {
  fs::remove(path(kShard1));
  fs::remove(path(kShard2));
  expect_error(dir_, "neither");
  expect_error(dir_, "neither");
  const std::string nodir = path("nodir");
  const std::string err = open_dir_error(nodir);
  EXPECT_EQ(err.rfind(nodir + ": ", 0), 0u) << err;
}

}  // namespace
}  // namespace retain
