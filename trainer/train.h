// The training loop of retain-train (DESIGN §2, §6, §7): setup (model, data, gates, the
// weight provider for this world), steps (compute_gradients → reduce-scatter → clip → sharded
// AdamW → all-gather), metrics, checkpoints, exact resume, stop signals; and --dump-grads.
#pragma once
#include "kernels/base/error.h"
#include "kernels/dist/comm.h"
#include "trainer/train_config.h"

namespace retain::trainer {

// An error every rank raised together (agreed over the ranks), so every rank can exit cleanly
// with no MPI_Abort; only one rank (`print`) reports it, so the line appears once.
class CollectiveError : public Error {
 public:
  CollectiveError(const std::string& what, bool print) : Error(what), print_(print) {}
  bool print() const { return print_; }

 private:
  bool print_;
};

// Trains as `cfg` says on the world of `comm` (every rank calls it). Rank 0 alone prints.
// Returns the process exit code: 0 when the run finished or stopped on SIGTERM/SIGINT after
// saving a checkpoint. Bad input, a non-finite loss or gradient: retain::Error (nothing is
// saved for the failing step; the last good checkpoint stays `latest`).
int run_training(const TrainConfig& cfg, dist::Comm& comm);

// --dump-grads (DESIGN §7): one optimizer-free step on the first global batch; rank 0 writes
// every gate parameter P, its global gradient grad/P, the loss scalars and the global batch
// (every rank's sequences in rank order) to cfg.dump_grads.
void dump_gradients(const TrainConfig& cfg, dist::Comm& comm);

}  // namespace retain::trainer
