// One optimizer update of a parameter set sharded over the ranks (ZeRO-1: each rank keeps the fp32
// master values and the AdamW state of its slice of the flat parameters, trainer/flat_params.h):
// this rank's gradient flattened and reduce-scattered into its shard, the global norm
// all-reduced, the shard clipped and stepped by AdamW, the values all-gathered and written back
// into the parameters. retain-train's loop and retain-bench train both step through it; the
// loop checks the norm between the two halves, so that a non-finite gradient stops every rank
// before any value changes.
#pragma once
#include <cstdint>
#include <vector>

#include "kernels/dist/comm.h"
#include "model/param_set.h"
#include "trainer/optim.h"

namespace retain::trainer {

class ShardedUpdate {
 public:
  // Takes the master values from `params` as they are now; `params` must outlive this.
  ShardedUpdate(ParameterSet& params, dist::Comm& comm, const AdamWConfig& cfg);

  // Reads the master values from the parameters again (after a checkpoint was loaded into them).
  void reload_values();
  // Reduce-scatters this rank's gradient (the parameters' grad tensors) into its shard and
  // returns the global gradient norm. Collective.
  double reduce_gradients();
  // Clips the shard to global norm `clip` (≤ 0: no clipping; torch's clip_grad_norm_), steps
  // AdamW at `lr`, all-gathers the values and writes them into the parameters. Collective; after
  // reduce_gradients.
  void apply(double lr, double clip);

  AdamW& adam() { return adam_; }
  const ShardRange& range() const { return range_; }
  int64_t flat_size() const { return n_; }

 private:
  ParameterSet& params_;
  dist::Comm& comm_;
  int64_t n_;
  ShardRange range_;
  AdamW adam_;
  std::vector<float> values_, grads_, grad_shard_;  // values_ and grads_ padded to range_.padded
  double norm_ = 0;
};

}  // namespace retain::trainer
