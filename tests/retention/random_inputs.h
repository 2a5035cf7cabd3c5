// Random inputs shared by the capacity tests (CPU reference, CUDA kernels, their CPU
// emulation) and the span and ring tests: packed document ids with padding runs, logβ in every
// decay regime, normal tensors.
#pragma once
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/tensor.h"

namespace retain::test {

// An F32 tensor of `shape` with N(0, 1) entries (the span and ring tests' q, k, v, dout).
inline Tensor random_normal(const Shape& shape, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, DType::F32);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int64_t x = 0; x < t.numel(); ++x) t.data<float>()[x] = n(rng);
  return t;
}

// Contiguous documents of random lengths (1..max_len) with padding runs (−1) between some of them.
inline std::vector<int32_t> packed_docs(int64_t T, std::mt19937& rng, int64_t max_len) {
  std::vector<int32_t> doc;
  int32_t id = 0;
  std::uniform_int_distribution<int64_t> len(1, max_len);
  std::bernoulli_distribution pad(0.2);
  while (static_cast<int64_t>(doc.size()) < T) {
    const int32_t value = pad(rng) ? -1 : id++;
    for (int64_t n = len(rng); n > 0 && static_cast<int64_t>(doc.size()) < T; --n) doc.push_back(value);
  }
  return doc;
}

// logβ [L, T, K]: per (layer, head) a decay regime — barely decaying, moderate, steep (−0.3 …
// −3, so far tiles are skipped), mixed with −30 and −inf keys — so that every kernel path and
// the tile skip run. Head (0, 0) is steep; all four regimes appear once L·K ≥ 4.
inline std::vector<float> random_log_betas(int64_t L, int64_t T, int64_t K, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> lb(static_cast<size_t>(L * T * K));
  for (int64_t l = 0; l < L; ++l)
    for (int64_t k = 0; k < K; ++k) {
      const int regime = static_cast<int>((l * K + k + 2) % 4);
      for (int64_t t = 0; t < T; ++t) {
        float& x = lb[static_cast<size_t>((l * T + t) * K + k)];
        const float r = u(rng);
        if (regime == 0) x = -1e-6f * r;
        else if (regime == 1) x = -0.05f * r;
        else if (regime == 2) x = -0.3f - 2.7f * r;
        else x = r < 0.4f ? -1e-5f * u(rng) : r < 0.8f ? -0.5f * u(rng) : r < 0.95f ? -30.0f : -INFINITY;
      }
    }
  return lb;
}

}  // namespace retain::test
