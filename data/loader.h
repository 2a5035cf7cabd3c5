// Batches for data-parallel training. Each epoch visits the dataset's sequences in a seeded
// permutation (a pure function of (seed, epoch)); step s of the epoch is the global batch
// perm[s·B, (s+1)·B); rank r of N takes the contiguous slice [r·B/N, (r+1)·B/N) of it. So the
// global batch does not depend on the world size, and the ranks' shards of an epoch are
// disjoint and cover the epoch's full batches. The last N mod B sequences of each epoch's
// permutation (the tail that fills no global batch) are skipped that epoch; the permutation
// changes every epoch, so no sequence is skipped for good. A Cursor (seed, epoch, step) saved
// with a checkpoint resumes the exact sequence of future batches, at any world size.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/packed_dataset.h"

namespace retain::data {

struct Cursor {
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t step = 0;  // global batches already taken in this epoch

  // {"seed", "epoch", "step", "global_batch", "num_sequences"}: the last two let a resume
  // refuse a different dataset or batch size.
  nlohmann::json to_json(int64_t global_batch, int64_t num_sequences) const;
  // Throws retain::Error naming `source` on a missing/ill-typed field or a mismatch with
  // (global_batch, num_sequences).
  static Cursor from_json(const nlohmann::json& j, int64_t global_batch, int64_t num_sequences,
                          const std::string& source);
  bool operator==(const Cursor&) const = default;
};

struct LoaderOptions {
  int64_t global_batch = 1;  // B: sequences per optimizer step over all ranks
  int rank = 0, world_size = 1;
  uint64_t seed = 0;
};

class Loader {
 public:
  // `ds` must outlive the loader. Throws retain::Error when B % world_size != 0, rank is out of range, or the dataset has
  // fewer than B sequences.
  Loader(const PackedDataset& ds, const LoaderOptions& opt);
  Loader(const PackedDataset& ds, const LoaderOptions& opt, const Cursor& resume_from);

  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  int64_t local_batch() const { return opt_.global_batch / opt_.world_size; }
  // Where the next batch comes from; save it with a checkpoint.
  const Cursor& cursor() const { return cursor_; }

  // This rank's rows (dataset indices) for the next step; advances the cursor.
  std::vector<int64_t> next_rows();
  // The same rows, read.
  PackedBatch next();

  // The global batch of any (epoch, step): what every rank's next_rows() concatenate to.
  std::vector<int64_t> global_rows(int64_t epoch, int64_t step) const;
  // The epoch's order of all sequences: a pure function of (num_sequences, seed, epoch).
  static std::vector<int64_t> epoch_permutation(int64_t num_sequences, uint64_t seed, int64_t epoch);

 private:
  void ensure_permutation(int64_t epoch) const;

  const PackedDataset& ds_;
  LoaderOptions opt_;
  int64_t steps_per_epoch_ = 0;
  Cursor cursor_;
  mutable int64_t perm_epoch_ = -1;
  mutable std::vector<int64_t> perm_;
};

}  // namespace retain::data
