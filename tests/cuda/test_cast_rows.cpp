// The per-element conversions of the CUDA cast kernel (kernels/cuda/cast_rows.h) run on the CPU,
// in every build, bit for bit against kernels/base/half.h: every 16-bit pattern widened (BF16,
// F16) and cast between the two 16-bit formats, and float32 patterns rounded to each — every
// upper half combined with low halves at and around the rounding ties of both formats (so
// every exponent, the binary16 subnormal range and its shifting tie bit), ±0, ±inf, signalling
// and quiet NaNs, the overflow edge, plus random patterns. What this cannot check is the
// kernel's launch and indexing; tests/cuda/test_gemm_cuda.cpp does, on a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <iterator>
#include <vector>

#include "kernels/base/half.h"
#include "kernels/cuda/cast_rows.h"
#include "tests/cuda/cuda_test.h"

using namespace retain;
namespace cr = retain::cuda::cast_rows;

namespace {

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// The float32 patterns of the test: every upper half with the low halves that decide rounding.
std::vector<uint32_t> f32_patterns(std::mt19937& rng) {
  // bf16 ties at bit 15; binary16 normal ties at bit 12; binary16 subnormal ties at bits 13..23
  // (the upper halves cover 16..23 with a zero low half); each ± one unit.
  const uint32_t lows[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff, 0x0fff, 0x1000, 0x1001, 0x3000,
                           0x2000, 0x1fff, 0x2001, 0x4000, 0x3fff, 0x4001, 0xc000, 0x7000, 0xe000, 0x9000};
  std::vector<uint32_t> v;
  for (uint32_t hi = 0; hi < 0x10000u; ++hi)
    for (uint32_t lo : lows) v.push_back(hi << 16 | lo);
  const uint32_t special[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u,
                              0x7f800001u, 0x7fa00000u, 0xff800001u, 0x7fffffffu, 0x00000001u, 0x807fffffu,
                              0x477fe000u, 0x477fefffu, 0x477ff000u, 0x477fffffu, 0x7f7fffffu, 0x7f7f8000u,
                              0x33000000u, 0x33000001u, 0x32ffffffu, 0x387fe000u, 0x387ff000u};
  v.insert(v.end(), std::begin(special), std::end(special));
  std::uniform_int_distribution<uint32_t> any;
  for (int i = 0; i < 1000000; ++i) v.push_back(any(rng));
  return v;
}

class CastRows : public cuda_test::SeededTest {};

TEST_F(CastRows, WideningEvery16BitPatternIsHalfH) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const auto p = static_cast<uint16_t>(h);
    ASSERT_EQ(bits_of(cr::bf16_load(p)), bits_of(bf16_to_f32(p))) << std::hex << "bf16 0x" << h;
    ASSERT_EQ(bits_of(cr::f16_load(p)), bits_of(f16_to_f32(p))) << std::hex << "f16 0x" << h;
    // Through load_f32, the kernel's path, from a buffer.
    ASSERT_EQ(bits_of(cr::load_f32(&p, cr::Type::BF16, 0)), bits_of(bf16_to_f32(p))) << std::hex << h;
    ASSERT_EQ(bits_of(cr::load_f32(&p, cr::Type::F16, 0)), bits_of(f16_to_f32(p))) << std::hex << h;
  }
}

TEST_F(CastRows, Every16BitPatternBetweenBf16AndF16IsHalfH) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const auto p = static_cast<uint16_t>(h);
    uint16_t got = 0;
    cr::cast_element(&p, cr::Type::BF16, &got, cr::Type::F16, 0);
    ASSERT_EQ(got, f32_to_f16(bf16_to_f32(p))) << std::hex << "bf16 -> f16 0x" << h;
    cr::cast_element(&p, cr::Type::F16, &got, cr::Type::BF16, 0);
    ASSERT_EQ(got, f32_to_bf16(f16_to_f32(p))) << std::hex << "f16 -> bf16 0x" << h;
    float wide = 0;
    cr::cast_element(&p, cr::Type::F16, &wide, cr::Type::F32, 0);
    ASSERT_EQ(bits_of(wide), bits_of(f16_to_f32(p))) << std::hex << "f16 -> f32 0x" << h;
  }
}

TEST_F(CastRows, RoundingFloat32IsHalfH) {
  TRACE_SEED();
  const std::vector<uint32_t> patterns = f32_patterns(rng_);
  int64_t ties_bf16 = 0, subnormal_f16 = 0;
  for (uint32_t b : patterns) {
    const float f = float_of(b);
    ASSERT_EQ(cr::bf16_store(f), f32_to_bf16(f)) << std::hex << "f32 0x" << b << " -> bf16";
    ASSERT_EQ(cr::f16_store(f), f32_to_f16(f)) << std::hex << "f32 0x" << b << " -> f16";
    uint16_t got = 0;
    cr::cast_element(&f, cr::Type::F32, &got, cr::Type::BF16, 0);
    ASSERT_EQ(got, f32_to_bf16(f)) << std::hex << "cast_element f32 0x" << b << " -> bf16";
    cr::cast_element(&f, cr::Type::F32, &got, cr::Type::F16, 0);
    ASSERT_EQ(got, f32_to_f16(f)) << std::hex << "cast_element f32 0x" << b << " -> f16";
    ties_bf16 += (b & 0xffffu) == 0x8000u;
    const uint32_t exp = (b >> 23) & 0xffu;
    subnormal_f16 += exp >= 102 && exp <= 112;
  }
  // The set did reach the cases it is for.
  EXPECT_GE(ties_bf16, 0x10000);
  EXPECT_GE(subnormal_f16, 11 * 2 * 128 * 20);  // 11 exponents × signs × upper mantissa bits × low halves
}

// The conversions are the rounding they claim, not only half.h's: spot values with known bits.
TEST_F(CastRows, KnownRoundings) {
  EXPECT_EQ(cr::bf16_store(1.0f), 0x3f80);
  EXPECT_EQ(cr::bf16_store(float_of(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(cr::bf16_store(float_of(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(cr::bf16_store(float_of(0x7f7fffffu)), 0x7f80);  // FLT_MAX rounds to inf
  EXPECT_EQ(cr::bf16_store(float_of(0x7f800001u)), 0x7fc0);  // a signalling NaN is made quiet
  EXPECT_EQ(cr::f16_store(65504.0f), 0x7bff);
  EXPECT_EQ(cr::f16_store(65520.0f), 0x7c00);                // the tie above max half overflows
  EXPECT_EQ(cr::f16_store(float_of(0x33000000u)), 0x0000);   // 2^-25: tie to even zero
  EXPECT_EQ(cr::f16_store(float_of(0x33000001u)), 0x0001);   // just above: the smallest subnormal
  EXPECT_EQ(cr::f16_store(-0.0f), 0x8000);
}

}  // namespace
