// What the fixture-driven tests share: finding the cases of a fixtures folder, converting the
// I64 id tensors Python writes, and the relative error ‖got − want‖ / ‖want‖ they report.
#pragma once
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/tensor.h"

namespace retain::test_support {

// Sorted names of the sub-folders of tests/fixtures/<folder> that hold expected.safetensors.
inline std::vector<std::string> fixture_cases(const std::string& folder) {
  namespace fs = std::filesystem;
  std::vector<std::string> out;
  const fs::path root = fs::path(RETAIN_FIXTURES_DIR) / folder;
  if (fs::is_directory(root))
    for (const auto& e : fs::directory_iterator(root))
      if (fs::exists(e.path() / "expected.safetensors")) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// I64 (what torch/numpy write for ids) to I32 (what the ops take).
inline Tensor as_i32(const Tensor& t) {
  Tensor out = Tensor::empty(t.shape(), DType::I32);
  for (int64_t i = 0; i < t.numel(); ++i) out.data<int32_t>()[i] = static_cast<int32_t>(t.data<int64_t>()[i]);
  return out;
}

// ‖got − want‖₂ / ‖want‖₂ over F32 tensors of one shape (+inf, and a failure, when shapes differ).
inline double rel_diff(const Tensor& got, const Tensor& want) {
  EXPECT_EQ(got.shape(), want.shape());
  if (got.shape() != want.shape()) return INFINITY;
  double num = 0, den = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double d = double(got.data<float>()[i]) - want.data<float>()[i];
    num += d * d;
    den += double(want.data<float>()[i]) * want.data<float>()[i];
  }
  return std::sqrt(num / den);
}

}  // namespace retain::test_support
