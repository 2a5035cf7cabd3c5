// Trainer checkpoints (DESIGN §6; layout and protocol in docs/checkpoints.md).
//
//   RUN/checkpoints/step-00000100/        one directory per saved step (8+ digits)
//       gates.safetensors                 the gate values (RetentionGates::save), metadata step
//       optimizer-rank00000-of-00002.safetensors   each rank's AdamW shard (m, v; t, ranges)
//       state.json                        the trainer's JSON + {"step", "world_size"}
//   RUN/checkpoints/latest                "step-00000100\n", replaced atomically, last
//
// A checkpoint is written under "step-XXXXXXXX.tmp" and renamed when complete; `latest` is
// rewritten only after that rename, so a SIGKILL at any moment leaves `latest` naming a
// complete checkpoint, or absent. All ranks must see one shared file system.
//
// The optimizer state is a flat vector of flat_size scalars padded with zeros up to a multiple
// of the world size; rank r of W holds the contiguous slice [r·P/W, (r+1)·P/W) of the padded
// length P. Loading assembles any slice from all saved shards, so N ranks' checkpoint resumes
// on M ranks.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/param_set.h"
#include "kernels/dist/comm.h"

namespace retain::ckpt {

struct OptimizerShard {
  int64_t t = 0;           // AdamW steps taken (bias correction)
  int64_t flat_size = 0;   // scalars in the unpadded flat vector
  int64_t begin = 0, end = 0;  // this shard's slice of the padded vector
  std::vector<float> m, v;     // end − begin each
};

struct SaveRequest {
  int64_t step = 0;                              // optimizer steps completed
  const ParameterSet* gates = nullptr;  // gates or kvpop scorers; rank 0 writes it (all ranks hold the same values)
  nlohmann::json state;                          // rank 0 writes it as state.json (plus step, world_size)
  OptimizerShard optimizer;                      // this rank's
  int keep_last = 3;                             // <= 0 keeps every checkpoint
};

// What the ranks that did not fail throw when another rank's part of a save failed (that rank
// throws its own retain::Error): the caller can let the failing rank alone report it.
class PeerSaveError : public Error {
 public:
  using Error::Error;
};

// Collective: every rank calls it with the same run_dir and step. Returns the final checkpoint
// directory. A failure on any rank makes every rank throw retain::Error (the failing rank its
// own message, the others a PeerSaveError), and leaves `latest` as it was.
std::string save_checkpoint(dist::Comm& comm, const std::string& run_dir, const SaveRequest& req);

// RUN/checkpoints/<latest> if `latest` exists and names a complete checkpoint; nullopt when the
// run has none. A `latest` naming a missing or incomplete directory is a retain::Error naming it.
std::optional<std::string> latest_checkpoint(const std::string& run_dir);

// Removes what an interrupted save leaves in RUN/checkpoints ("step-*.tmp" directories and
// "latest.tmp.*" files). Rank 0 only, before the other ranks may save.
void remove_stale_temporaries(const std::string& run_dir);

struct Loaded {
  int64_t step = 0;
  nlohmann::json state;    // all of state.json (the trainer's keys, step, world_size)
  std::string gates_path;  // <dir>/gates.safetensors, for RetentionGates::load
  OptimizerShard optimizer;
};

// Reads state.json and the optimizer state for [begin, end) of a flat vector of flat_size
// scalars, assembled from ALL optimizer-rank* files of the checkpoint (indices >= flat_size are
// padding: 0). Every inconsistency (missing shard, sizes, world_size, t differing between
// shards, NaN) is one retain::Error naming the file. `check_state`, when given, sees state.json
// first and may throw: a resume with another configuration is named by what differs, before a
// size check would name only its consequence.
Loaded load_checkpoint(const std::string& ckpt_dir, int64_t flat_size, int64_t begin, int64_t end,
                       const std::function<void(const nlohmann::json& state)>& check_state = {});

// Names used by the layout (exposed for tools and tests).
std::string step_dir_name(int64_t step);                      // "step-00000100"
std::string optimizer_file_name(int rank, int world_size);    // "optimizer-rank00000-of-00002.safetensors"
std::string checkpoints_dir(const std::string& run_dir);      // RUN/checkpoints

}  // namespace retain::ckpt
