#include "model/infer/oracle.h"

#include <cmath>
#include <algorithm>
#include <limits>

#include "kernels/kvpop.h"
#include "model/kvpop_step.h"

namespace retain::infer {

float OracleScores::rank_key(int64_t l, int64_t h, int64_t u) const {
  const Tensor& lm = log_m[static_cast<size_t>(l)];
  if (u < 0 || u >= lm.dim(1))
    fail("oracle-m: token {} is beyond the {} tokens of the sequence its targets were computed for", u, lm.dim(1));
  const float v = lm.data<float>()[h * lm.dim(1) + u];
  RETAIN_CHECK(!std::isnan(v), "oracle-m: target of token {} (layer {}, KV head {}) is NaN", u, l, h);
  if (std::isinf(v) && v < 0) return std::numeric_limits<float>::lowest();
  const int64_t steps = decay_every == 1 ? u : u / decay_every;  // ⌊u/n⌋, as kvpop_state.cpp
  return static_cast<float>(static_cast<double>(v) -
                            static_cast<double>(steps) * log_gamma[static_cast<size_t>(l)][static_cast<size_t>(h)]);
}

OracleScores oracle_scores(WeightProvider& weights, std::span<const int32_t> ids, const kvpop::Scorers& scorers) {
  if (!scorers.geometry()) fail("--policy oracle-m: the scorers record no window/sinks/topk");
  const kvpop::PolicyGeometry& g = *scorers.geometry();
  const int64_t T = static_cast<int64_t>(ids.size());
  RETAIN_CHECK(T > 0, "oracle-m: empty sequence");
  kvpop::StepSettings st;
  st.window = g.window, st.sinks = g.sinks, st.topk = std::max<int64_t>(g.topk, 1);
  const kvpop::TeacherPass pass = kvpop::teacher_pass(weights, Tensor::from_vector(std::vector<int32_t>(ids.begin(), ids.end()), {T}),
                                                      Tensor::zeros({T}, DType::I32), st);
  OracleScores out;
  out.log_m = pass.log_m;
  out.window = g.window, out.sinks = g.sinks;
  out.decay_every = scorers.decay().every;
  for (const auto& layer : scorers.head_values()) {
    out.log_gamma.emplace_back();
    for (const kvpop::HeadParams& h : layer)
      out.log_gamma.back().push_back(kvpop::log_gamma(h.theta.data<float>()[0], scorers.decay()));
  }
  return out;
}

}  // namespace retain::infer
