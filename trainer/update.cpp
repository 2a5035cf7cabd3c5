#include "trainer/update.h"

#include <cmath>

#include "trainer/flat_params.h"

namespace retain::trainer {

ShardedUpdate::ShardedUpdate(ParameterSet& params, dist::Comm& comm, const AdamWConfig& cfg)
    : params_(params),
      comm_(comm),
      n_(trainer::flat_size(params)),
      range_(shard_range(n_, comm.rank(), comm.size())),
      adam_(range_.end - range_.begin, cfg),
      values_(static_cast<size_t>(range_.padded), 0.0f),
      grads_(values_.size(), 0.0f),
      grad_shard_(static_cast<size_t>(range_.end - range_.begin), 0.0f) {
  flatten_values(params_, values_.data());
}

void ShardedUpdate::reload_values() { flatten_values(params_, values_.data()); }

double ShardedUpdate::reduce_gradients() {
  flatten_grads(params_, grads_.data());
  comm_.reduce_scatter(grads_.data(), grad_shard_.data(), grad_shard_.size());
  double sq = 0;
  for (float g : grad_shard_) sq += static_cast<double>(g) * g;
  comm_.all_reduce(&sq, 1);
  norm_ = std::sqrt(sq);
  return norm_;
}

void ShardedUpdate::apply(double lr, double clip) {
  const double factor = clip_factor(norm_, clip);
  if (factor != 1.0)
    for (float& g : grad_shard_) g = static_cast<float>(g * factor);
  adam_.step(values_.data() + range_.begin, grad_shard_.data(), lr);
  comm_.all_gather(values_.data() + range_.begin, values_.data(), grad_shard_.size());
  unflatten_values(params_, values_.data());
}

}  // namespace retain::trainer
