// Shared by the data tests: a scratch directory, the tiny byte-level tokenizer, corpus writers,
// and a whole packed dataset read back into plain vectors.
#pragma once
#include <unistd.h>
#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "data/packed_dataset.h"
#include "data/packer.h"
#include "data/tokenizer/tokenizer.h"
#include "model/tiny.h"

namespace retain::data::test {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() /
            ("retain_data_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& name) const { return path_ / name; }
  // Every file name in the directory (to prove nothing was left behind).
  std::vector<std::string> files() const {
    std::vector<std::string> v;
    for (const auto& e : fs::directory_iterator(path_)) v.push_back(e.path().filename().string());
    std::sort(v.begin(), v.end());
    return v;
  }

 private:
  fs::path path_;
};

inline void write_text(const fs::path& p, const std::string& s) {
  std::ofstream(p, std::ios::binary) << s;
}

inline void write_gzip(const fs::path& p, const std::string& s) {
  gzFile g = gzopen(p.c_str(), "wb");
  ASSERT_NE(g, nullptr);
  ASSERT_EQ(gzwrite(g, s.data(), static_cast<unsigned>(s.size())), static_cast<int>(s.size()));
  gzclose(g);
}

// The tiny model's tokenizer (one token per byte, no merges; <|endoftext|> = 256,
// <|im_start|> = 257, <|im_end|> = 258) written into `dir`.
inline Tokenizer tiny_tokenizer(const fs::path& dir) {
  write_text(dir / "tokenizer.json", tiny_tokenizer_json().dump());
  return Tokenizer::load(dir / "tokenizer.json");
}

// A packed dataset read whole.
struct Packed {
  int64_t n = 0, S = 0;
  std::vector<std::vector<int32_t>> ids, docs, pos;
  std::vector<std::vector<uint8_t>> mask;
  // Per document id: its tokens and masks gathered row-major (sequence by sequence).
  std::map<int32_t, std::vector<int32_t>> doc_tokens;
  std::map<int32_t, std::vector<uint8_t>> doc_masks;
  std::map<int32_t, std::vector<int64_t>> doc_rows;  // distinct rows holding the document
  int64_t padding = 0;
};

inline Packed read_all(const fs::path& p) {
  const PackedDataset ds = PackedDataset::open(p);
  Packed r;
  r.n = ds.num_sequences();
  r.S = ds.seq_len();
  for (int64_t i = 0; i < r.n; ++i) {
    PackedSequence s = ds.read(i);
    for (int64_t t = 0; t < r.S; ++t) {
      const int32_t d = s.doc_ids[static_cast<size_t>(t)];
      if (d < 0) {
        ++r.padding;
        continue;
      }
      r.doc_tokens[d].push_back(s.input_ids[static_cast<size_t>(t)]);
      r.doc_masks[d].push_back(s.target_mask[static_cast<size_t>(t)]);
      auto& rows = r.doc_rows[d];
      if (rows.empty() || rows.back() != i) rows.push_back(i);
    }
    r.ids.push_back(std::move(s.input_ids));
    r.docs.push_back(std::move(s.doc_ids));
    r.pos.push_back(std::move(s.positions));
    r.mask.push_back(std::move(s.target_mask));
  }
  return r;
}

inline std::vector<uint8_t> file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

}  // namespace retain::data::test
