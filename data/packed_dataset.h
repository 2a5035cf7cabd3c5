// Reading a packed dataset written by retain-pack (docs/data-format.md) and checking it against
// the model it will train. A PackedDataset holds HDF5 handles: use one from one thread at a time.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "data/formats/h5.h"
#include "kernels/tensor.h"

namespace retain::data {

// One sequence; positions follow DESIGN §4 (0-based within each document run of this
// sequence, restarting at the sequence start for a continued document; 0 for padding).
struct PackedSequence {
  std::vector<int32_t> input_ids, doc_ids, positions;
  std::vector<uint8_t> target_mask;
};

// Sequences as tensors: input_ids, doc_ids, positions I32 [B, S]; target_mask U8 [B, S];
// rows = the dataset row of each batch entry.
struct PackedBatch {
  Tensor input_ids, doc_ids, positions, target_mask;
  std::vector<int64_t> rows;
};

class PackedDataset {
 public:
  // Opens and validates: the three datasets exist with rank 2, the same shape [N, seq_len] and
  // integer types of the documented width; the required attributes exist with sane values.
  // Throws retain::Error naming the file and the problem.
  static PackedDataset open(const std::filesystem::path& path);

  int64_t num_sequences() const { return n_; }
  int64_t seq_len() const { return seq_len_; }
  int64_t vocab_size() const { return vocab_size_; }
  int64_t eos_token_id() const { return eos_token_id_; }
  const std::string& tokenizer_sha256() const { return tokenizer_sha256_; }
  const std::string& packing() const { return packing_; }
  const std::filesystem::path& path() const { return path_; }

  // Sequence i (0 <= i < num_sequences()). Validates the values it reads: ids in
  // [0, vocab_size), doc ids >= -1 in contiguous runs, masks 0/1 and 0 on padding.
  PackedSequence read(int64_t i) const;
  PackedBatch read_batch(std::span<const int64_t> rows) const;

 private:
  void read_row(int64_t i, int32_t* ids, int32_t* docs, uint8_t* mask) const;

  std::filesystem::path path_;
  std::string name_;
  formats::h5::Handle file_, ids_, docs_, mask_;
  int64_t n_ = 0, seq_len_ = 0, vocab_size_ = 0, eos_token_id_ = 0;
  std::string tokenizer_sha256_, packing_;
};

// Refuses a dataset the model cannot train on: its vocab_size attribute above the model's
// `model_vocab_size` (the caller reads it from model_dir/config.json: data/ stands below the
// model; every id is checked against the attribute when read, so every id is then a valid model
// id), or — when model_dir holds a tokenizer.json — a tokenizer other than the one the dataset
// was packed with (SHA-256 of the file bytes). Errors name both files.
void check_dataset_matches_model(const PackedDataset& ds, const std::filesystem::path& model_dir,
                                 int64_t model_vocab_size);

}  // namespace retain::data
