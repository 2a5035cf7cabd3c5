// The per-element conversions of the CUDA cast kernel (kernels/cuda/gemm.cu: ops::cast on CUDA
// tensors and the bf16 rounding of activations before a BF16 GEMM), written as __host__
// __device__ functions so that tests/cuda/test_cast_rows.cpp checks this very code on the CPU
// against kernels/base/half.h (host-only) bit for bit, in every build. Plain C++ when not
// compiled by nvcc. Not yet run on a GPU (none has been lent).
//
// Every conversion goes through float32, as the CPU's does: widening is exact, so each cast
// rounds once (to nearest even), and NaN stays a quiet NaN exactly as half.h makes it.
#pragma once
#include <cstdint>

#include "kernels/cuda/ops_rows.h"

namespace retain::cuda::cast_rows {

using ops_rows::bf16_load;
using ops_rows::f16_load;

enum class Type : int { F32, BF16, F16 };

RETAIN_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
#endif
}

// half.h's f32_to_bf16: round to nearest even; NaN made quiet with its upper payload kept.
RETAIN_HD uint16_t bf16_store(float f) {
  const uint32_t bits = f32_bits(f);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0)
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// half.h's f32_to_f16: round to nearest even, overflow to inf, any NaN to the quiet 0x7e00.
RETAIN_HD uint16_t f16_store(float f) {
  const uint32_t bits = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t exp = (bits >> 23) & 0xffu;
  uint32_t mant = bits & 0x7fffffu;
  if (exp == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0u));
  const int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 0x1f) return static_cast<uint16_t>(sign | 0x7c00u);
  if (e <= 0) {  // a binary16 subnormal (or zero): the implicit 1 shifted in with the rest
    if (e < -10) return sign;
    mant |= 0x800000u;
    const int shift = 14 - e;
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;  // a carry into the exponent is right
  return static_cast<uint16_t>(sign | half);
}

RETAIN_HD float load_f32(const void* src, Type t, int64_t i) {
  switch (t) {
    case Type::BF16: return bf16_load(static_cast<const uint16_t*>(src)[i]);
    case Type::F16: return f16_load(static_cast<const uint16_t*>(src)[i]);
    default: return static_cast<const float*>(src)[i];
  }
}

RETAIN_HD void store_f32(void* dst, Type t, int64_t i, float v) {
  switch (t) {
    case Type::BF16: static_cast<uint16_t*>(dst)[i] = bf16_store(v); break;
    case Type::F16: static_cast<uint16_t*>(dst)[i] = f16_store(v); break;
    default: static_cast<float*>(dst)[i] = v; break;
  }
}

// Element i of the cast kernel (src and dst types differ; equal types are a plain copy, which
// keeps a NaN's payload where this round trip would not).
RETAIN_HD void cast_element(const void* src, Type st, void* dst, Type dt, int64_t i) {
  store_f32(dst, dt, i, load_f32(src, st, i));
}

}  // namespace retain::cuda::cast_rows
