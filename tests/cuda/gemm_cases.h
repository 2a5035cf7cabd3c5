// Shared by the GEMM tests (tests/kernels/test_gemm_cpu.cpp, tests/cuda/test_gemm_cuda.cpp):
// their random inputs.
#pragma once
#include <cmath>
#include <random>

#include "kernels/tensor.h"

namespace retain::gemm_test {

// F32 values of mixed signs and magnitudes (each row scaled by 10^[-2, 2]).
inline Tensor random_f32(const Shape& shape, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, DType::F32);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> e(-2.0f, 2.0f);
  const int64_t cols = shape.back(), rows = cols == 0 ? 0 : t.numel() / cols;
  for (int64_t r = 0; r < rows; ++r) {
    const float s = std::pow(10.0f, e(rng));
    for (int64_t c = 0; c < cols; ++c) t.data<float>()[r * cols + c] = s * n(rng);
  }
  return t;
}

}  // namespace retain::gemm_test
