// Writes the packed dataset (docs/data-format.md): /input_ids int32 [N,S], /doc_ids int32 [N,S],
// /target_mask uint8 [N,S], chunked one row (at most 65536 columns) per chunk, shuffle + deflate,
// attributes on the root group. The file is built under "<out>.tmp.<pid>" in the same directory
// and renamed onto <out> by commit(); destroyed uncommitted, it removes the temporary.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>

#include "data/formats/h5.h"

namespace retain::data {

// Format version of the layout in docs/data-format.md (bumped on incompatible change).
inline constexpr int64_t kPackedFormatVersion = 1;
inline constexpr int64_t kMaxChunkColumns = 65536;

struct PackedAttributes {
  int64_t seq_len = 0;
  int64_t vocab_size = 0;
  int64_t eos_token_id = 0;
  int64_t pad_token_id = 0;
  std::string tokenizer_sha256;
  std::string packing;  // "concat" or "bfd"
  std::string order;    // "shuffle" or "input"
  std::string targets;  // "all" or "assistant"
  uint64_t seed = 0;
  int64_t num_documents = 0;
  int64_t num_tokens = 0;      // document tokens, separators included, padding excluded
  int64_t padding_tokens = 0;
  int64_t split_documents = 0; // documents spread over more than one sequence
  std::string created_by;
};

class PackedWriter {
 public:
  PackedWriter(std::filesystem::path out, int64_t seq_len, int compression_level);
  ~PackedWriter();
  PackedWriter(const PackedWriter&) = delete;
  PackedWriter& operator=(const PackedWriter&) = delete;

  // Appends `rows` sequences (row-major [rows, seq_len] each).
  void append(const int32_t* input_ids, const int32_t* doc_ids, const uint8_t* target_mask, int64_t rows);
  int64_t rows() const { return rows_; }
  // Writes the attributes, closes, fsyncs and renames the file onto its final name.
  void commit(const PackedAttributes& attrs);
  const std::filesystem::path& temp_path() const { return tmp_; }

 private:
  std::filesystem::path out_, tmp_;
  std::string name_;  // for messages: the final path
  int64_t seq_len_;
  int64_t rows_ = 0;
  formats::h5::Handle file_, ids_, docs_, mask_;
  bool committed_ = false;
};

}  // namespace retain::data
