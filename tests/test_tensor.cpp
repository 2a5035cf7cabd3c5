// Tensor basics and the 16-bit float conversions against exact float64 definitions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/base/half.h"
#include "kernels/tensor.h"

using namespace retain;

namespace {

// binary16 decoded straight from its definition (sign · 2^(e−15) · 1.m, subnormals 2^−14 · 0.m).
double f16_reference(uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0x1f) return m ? std::numeric_limits<double>::quiet_NaN() : sign * std::numeric_limits<double>::infinity();
  if (e == 0) return sign * std::ldexp(m / 1024.0, -14);
  return sign * std::ldexp(1.0 + m / 1024.0, e - 15);
}

}  // namespace

TEST(Half, F16DecodesEveryBitPatternExactly) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const double want = f16_reference(static_cast<uint16_t>(h));
    const float got = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(want))
      EXPECT_TRUE(std::isnan(got)) << h;
    else
      EXPECT_EQ(static_cast<double>(got), want) << h;
  }
}

TEST(Half, F16EncodeRoundTripsAndRoundsToNearestEven) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_f16(f), h) << h;
  }
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even -> 1.
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  // 1 + 3·2^-11 is halfway between 1+2^-10 (odd) and 1+2^-9 (even) -> up.
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(f32_to_f16(70000.0f), 0x7c00);  // overflow -> inf
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // half of the smallest subnormal: ties to even (0)
  EXPECT_EQ(f32_to_f16(std::ldexp(1.5f, -25)), 0x0001);
}

TEST(Half, BF16RoundTripAndRounding) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = bf16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(f))));
      continue;
    }
    EXPECT_EQ(f32_to_bf16(f), h) << h;
  }
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie -> even (1.0)
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3f81);
}

TEST(Tensor, ShapesViewsAndConversions) {
  Tensor t = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {3, 2});
  EXPECT_EQ(t.numel(), 6);
  EXPECT_EQ(t.nbytes(), 24u);
  EXPECT_EQ(t.dim(-1), 2);
  Tensor r = t.rows(1, 3);
  EXPECT_EQ(r.shape(), (Shape{2, 2}));
  EXPECT_EQ(r.data<float>()[0], 3.0f);
  r.data<float>()[0] = 30;  // a view shares memory
  EXPECT_EQ(t.data<float>()[2], 30.0f);
  Tensor c = t.clone();
  c.data<float>()[0] = -1;
  EXPECT_EQ(t.data<float>()[0], 1.0f);
  EXPECT_EQ(t.reshape({6}).dim(0), 6);
  EXPECT_THROW(t.reshape({4}), Error);
  EXPECT_THROW(t.data<int32_t>(), Error);

  Tensor b = t.to_dtype(DType::BF16).to_dtype(DType::F32);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(b.data<float>()[i], t.data<float>()[i]);  // small ints are exact
  Tensor i64 = Tensor::from_vector<int64_t>({-3, 7}, {2}).to_dtype(DType::F32);
  EXPECT_EQ(i64.data<float>()[0], -3.0f);
}

TEST(Tensor, ShapeOverflowAndNegativeDimsAreErrors) {
  EXPECT_THROW(shape_numel({-1, 2}), Error);
  EXPECT_THROW(shape_numel({1LL << 40, 1LL << 40}), Error);
  EXPECT_EQ(shape_numel({}), 1);
  EXPECT_EQ(shape_numel({0, 5}), 0);
}

TEST(Tensor, DTypeNames) {
  for (DType dt : {DType::BOOL, DType::U8, DType::I8, DType::I16, DType::U16, DType::F16, DType::BF16, DType::I32,
                   DType::U32, DType::F32, DType::I64, DType::U64, DType::F64})
    EXPECT_EQ(dtype_from_name(dtype_name(dt)), dt);
  EXPECT_FALSE(dtype_from_name("F8_E4M3").has_value());
}

TEST(Tensor, CudaRoundTripOnGpu) {
  if (!cuda_built()) GTEST_SKIP() << "this build has no CUDA (nvcc not found at configure time)";
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  Tensor t = Tensor::from_vector<float>({1, -2, 3.5f}, {3});
  Tensor back = t.to(Device::CUDA).to(Device::CPU);
  EXPECT_EQ(std::memcmp(back.raw(), t.raw(), t.nbytes()), 0);
}

TEST(Tensor, CudaTensorWithoutCudaIsAClearError) {
  if (cuda_built() && cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present";
  try {
    Tensor::empty({4}, DType::F32, Device::CUDA);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA"), std::string::npos) << e.what();
  }
}

// host_tensor_memory counts live CPU tensor bytes (each allocation rounded up to 64) and their
// high-water mark; views share their owner's bytes; the peak resets to what is in use.
TEST(Tensor, HostTensorMemoryCountsLiveBytesAndThePeak) {
  const size_t base = host_tensor_memory().in_use;
  reset_host_tensor_peak();
  EXPECT_EQ(host_tensor_memory().peak, base);
  {
    Tensor a = Tensor::empty({10}, DType::F32);  // 40 bytes → 64
    EXPECT_EQ(host_tensor_memory().in_use, base + 64);
    Tensor b = Tensor::zeros({3, 100}, DType::BF16);  // 600 bytes → 640
    const Tensor view = b.rows(1, 2);
    EXPECT_EQ(host_tensor_memory().in_use, base + 704);
    b = Tensor();  // the view keeps the storage alive
    EXPECT_EQ(host_tensor_memory().in_use, base + 704);
    Tensor empty = Tensor::empty({0}, DType::F32);  // a zero-byte tensor still takes one line
    EXPECT_EQ(host_tensor_memory().in_use, base + 768);
  }
  EXPECT_EQ(host_tensor_memory().in_use, base);
  EXPECT_EQ(host_tensor_memory().peak, base + 768);
  reset_host_tensor_peak();
  EXPECT_EQ(host_tensor_memory().peak, base);
}

// on(device): the same tensor, storage shared, when it is there already (to() always copies).
TEST(Tensor, OnSharesWhenAlreadyOnTheDevice) {
  const Tensor t = Tensor::from_vector<float>({1, 2, 3}, {3});
  EXPECT_EQ(t.on(Device::CPU).raw(), t.raw());
  EXPECT_NE(t.to(Device::CPU).raw(), t.raw());
}
