// CPU reference for rotary position embedding (HF rotate-half convention).
#include <cmath>

#include "kernels/cpu/ops_cpu.h"

namespace retain::cpu {

void rope_rotate(Tensor& x, const Tensor& positions, const Tensor& inv_freq, float attention_factor,
                 bool transpose) {
  const int64_t T = x.dim(0), heads = x.dim(1), d = x.dim(2), half = d / 2;
  const int32_t* pos = positions.data<int32_t>();
  const float* f = inv_freq.data<float>();
  float* xs = x.data<float>();
  // The transpose of the rotation [c −s; s c] is [c s; −s c]: the same c, negated s.
  const float sign = transpose ? -1.0f : 1.0f;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < half; ++j) {
      // float32 angle, exactly as HF forms it (inv_freq · position in float32).
      const float angle = static_cast<float>(pos[t]) * f[j];
      const float c = std::cos(angle) * attention_factor;
      const float s = sign * (std::sin(angle) * attention_factor);
      for (int64_t h = 0; h < heads; ++h) {
        float* row = xs + (t * heads + h) * d;
        const float a = row[j], b = row[j + half];
        row[j] = a * c - b * s;
        row[j + half] = b * c + a * s;
      }
    }
  }
}

void rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, float attention_factor) {
  rope_rotate(x, positions, inv_freq, attention_factor, /*transpose=*/false);
}

}  // namespace retain::cpu
