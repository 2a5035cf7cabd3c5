#include "data/loader.h"

#include "data/shuffle.h"
#include "kernels/base/error.h"

namespace retain::data {

nlohmann::json Cursor::to_json(int64_t global_batch, int64_t num_sequences) const {
  return {{"seed", seed}, {"epoch", epoch}, {"step", step}, {"global_batch", global_batch},
          {"num_sequences", num_sequences}};
}

Cursor Cursor::from_json(const nlohmann::json& j, int64_t global_batch, int64_t num_sequences,
                         const std::string& source) {
  if (global_batch < 1) fail("{}: data cursor: global batch {} must be positive", source, global_batch);
  auto field = [&](const char* name) -> const nlohmann::json& {
    if (!j.is_object() || !j.contains(name) || !j[name].is_number_integer())
      fail("{}: data cursor: missing or non-integer '{}'", source, name);
    return j[name];
  };
  Cursor c;
  if (field("seed").get<int64_t>() < 0 && !j["seed"].is_number_unsigned())
    fail("{}: data cursor: 'seed' must not be negative", source);
  c.seed = field("seed").get<uint64_t>();
  c.epoch = field("epoch").get<int64_t>();
  c.step = field("step").get<int64_t>();
  const auto b = field("global_batch").get<int64_t>();
  const auto n = field("num_sequences").get<int64_t>();
  if (b != global_batch)
    fail("{}: data cursor was saved with global batch {}, resuming with {}", source, b, global_batch);
  if (n != num_sequences)
    fail("{}: data cursor was saved for a dataset of {} sequences, this one has {}", source, n, num_sequences);
  if (c.epoch < 0 || c.step < 0 || c.step > num_sequences / global_batch)
    fail("{}: data cursor epoch {} step {} is out of range", source, c.epoch, c.step);
  return c;
}

Loader::Loader(const PackedDataset& ds, const LoaderOptions& opt) : Loader(ds, opt, Cursor{opt.seed, 0, 0}) {}

Loader::Loader(const PackedDataset& ds, const LoaderOptions& opt, const Cursor& resume_from)
    : ds_(ds), opt_(opt), cursor_(resume_from) {
  if (opt.world_size < 1 || opt.rank < 0 || opt.rank >= opt.world_size)
    fail("loader: rank {} is outside a world of {} ranks", opt.rank, opt.world_size);
  if (opt.global_batch < 1 || opt.global_batch % opt.world_size != 0)
    fail("loader: the global batch {} must be a positive multiple of the number of ranks {}", opt.global_batch,
         opt.world_size);
  if (ds.num_sequences() < opt.global_batch)
    fail("{}: holds {} sequences, fewer than one global batch of {}", ds.path().string(), ds.num_sequences(),
         opt.global_batch);
  if (resume_from.seed != opt.seed)
    fail("loader: the cursor's seed {} differs from the run's data seed {}", resume_from.seed, opt.seed);
  steps_per_epoch_ = ds.num_sequences() / opt.global_batch;
  if (cursor_.step == steps_per_epoch_) cursor_ = {cursor_.seed, cursor_.epoch + 1, 0};
}

std::vector<int64_t> Loader::epoch_permutation(int64_t num_sequences, uint64_t seed, int64_t epoch) {
  return seeded_permutation(num_sequences, derive_seed(seed, static_cast<uint64_t>(epoch)));
}

void Loader::ensure_permutation(int64_t epoch) const {
  if (perm_epoch_ == epoch) return;
  perm_ = epoch_permutation(ds_.num_sequences(), opt_.seed, epoch);
  perm_epoch_ = epoch;
}

std::vector<int64_t> Loader::global_rows(int64_t epoch, int64_t step) const {
  RETAIN_CHECK(step >= 0 && step < steps_per_epoch_, "step {} of {}", step, steps_per_epoch_);
  ensure_permutation(epoch);
  const auto first = perm_.begin() + step * opt_.global_batch;
  return std::vector<int64_t>(first, first + opt_.global_batch);
}

std::vector<int64_t> Loader::next_rows() {
  const std::vector<int64_t> global = global_rows(cursor_.epoch, cursor_.step);
  const int64_t b = local_batch();
  std::vector<int64_t> mine(global.begin() + opt_.rank * b, global.begin() + (opt_.rank + 1) * b);
  if (++cursor_.step == steps_per_epoch_) cursor_ = {cursor_.seed, cursor_.epoch + 1, 0};
  return mine;
}

PackedBatch Loader::next() {
  const std::vector<int64_t> rows = next_rows();
  return ds_.read_batch(rows);
}

}  // namespace retain::data
