#include "model/rope_params.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace retain {

namespace {

// base^(2j/dim) with the exponent formed in float32 (torch.arange(0, dim, 2).float() / dim)
// and the power rounded once to float32.
float pos_freq(double base, int64_t j, int64_t dim) {
  const float exponent = static_cast<float>(2 * j) / static_cast<float>(dim);
  return static_cast<float>(std::pow(static_cast<double>(static_cast<float>(base)), static_cast<double>(exponent)));
}

// YaRN's "inverse dimension formula": the rotary dim at which a wavelength completes
// `rotations` turns within the original context.
double correction_dim(double rotations, int64_t dim, double base, int64_t max_pos) {
  return (static_cast<double>(dim) * std::log(static_cast<double>(max_pos) / (rotations * 2 * std::numbers::pi))) /
         (2 * std::log(base));
}

double yarn_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

RopeParams host_rope_params(const Qwen3Config& c) {
  const int64_t dim = c.head_dim, half = dim / 2;
  const RopeConfig& r = c.rope;
  RopeParams out;
  out.inv_freq = Tensor::empty({half}, DType::F32);
  float* inv = out.inv_freq.data<float>();

  if (r.type == "default") {
    for (int64_t j = 0; j < half; ++j) inv[j] = 1.0f / pos_freq(r.theta, j, dim);
    return out;
  }

  // YaRN (transformers' _compute_yarn_parameters).
  double attention_factor;
  if (r.attention_factor)
    attention_factor = *r.attention_factor;
  else if (r.mscale && r.mscale_all_dim && *r.mscale != 0 && *r.mscale_all_dim != 0)
    attention_factor = yarn_mscale(r.factor, *r.mscale) / yarn_mscale(r.factor, *r.mscale_all_dim);
  else
    attention_factor = yarn_mscale(r.factor, 1.0);
  out.attention_factor = static_cast<float>(attention_factor);

  double low = correction_dim(r.beta_fast, dim, r.theta, r.original_max_position_embeddings);
  double high = correction_dim(r.beta_slow, dim, r.theta, r.original_max_position_embeddings);
  if (r.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // avoid a zero-width ramp

  const float factor = static_cast<float>(r.factor);
  for (int64_t j = 0; j < half; ++j) {
    const float pf = pos_freq(r.theta, j, dim);
    const float extrapolation = 1.0f / pf;
    const float interpolation = 1.0f / (factor * pf);
    // Linear ramp over rotary dims, in float32 like torch: (j - low) / (high - low), clamped.
    float ramp = (static_cast<float>(j) - static_cast<float>(low)) / static_cast<float>(high - low);
    ramp = std::clamp(ramp, 0.0f, 1.0f);
    const float extrapolation_weight = 1.0f - ramp;
    inv[j] = interpolation * (1.0f - extrapolation_weight) + extrapolation * extrapolation_weight;
  }
  return out;
}

}  // namespace

RopeParams compute_rope_params(const Qwen3Config& c, Device device) {
  RopeParams p = host_rope_params(c);
  p.inv_freq = p.inv_freq.on(device);
  return p;
}

}  // namespace retain
