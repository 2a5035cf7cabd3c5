// The per-element and per-row math of the CUDA Qwen3 row/elementwise ops (kernels/cuda/ops.cu),
// written as __host__ __device__ functions so that tests/cuda/test_ops_rows.cpp runs the very
// same code on the CPU (each kernel's grid emulated thread by thread, the block reduction in
// the kernel's order) against the CPU reference ops in every build, GPU or not. Plain C++ when
// not compiled by nvcc. Not yet run on a GPU (none has been lent); tests/cuda/test_ops_cuda.cpp
// is the GPU check.
//
// Reductions (rmsnorm and its backward): one block of kRowThreads per row; thread i sums
// elements i, i + kRowThreads, ... in float32 in that order (row_partials), then the block
// folds the kRowThreads partials as a fixed pairwise tree in shared memory (fold_tree: slot i
// += slot i + s for s = kRowThreads/2, ..., 1). No atomics: results are bitwise repeatable.
// A sum of n float32 terms folded this way has relative error ≤ (⌈D/kRowThreads⌉ + log2
// kRowThreads)·u (u = 2^-24) of the sum of |terms|: 9u at head_dim 128, 27u at D = 2560.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cuda/host_device.h"

namespace retain::cuda::ops_rows {

inline constexpr int kRowThreads = 128;        // threads per row block (a power of two)

// ---- 16-bit float loads (bit for bit as kernels/base/half.h, which is host-only) ----------

RETAIN_HD float bits_to_f32(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

RETAIN_HD float bf16_load(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }

// IEEE binary16 → binary32, exact for every input (subnormals, inf, NaN).
RETAIN_HD float f16_load(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_f32(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return bits_to_f32(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_to_f32(sign);
  uint32_t e = 113;  // subnormal: shift the leading 1 into the implicit bit
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return bits_to_f32(sign | (e << 23) | ((mant & 0x3ffu) << 13));
}

// ---- embedding ---------------------------------------------------------------------------

enum class TableType : int { F32, BF16, F16 };

// out[i] for flat index i = t·D + j: table[ids[t], j] widened to float32.
RETAIN_HD float embedding_element(const void* table, TableType type, const int32_t* ids, int64_t D, int64_t i) {
  const int64_t t = i / D, j = i % D, src = static_cast<int64_t>(ids[t]) * D + j;
  switch (type) {
    case TableType::BF16: return bf16_load(static_cast<const uint16_t*>(table)[src]);
    case TableType::F16: return f16_load(static_cast<const uint16_t*>(table)[src]);
    default: return static_cast<const float*>(table)[src];
  }
}

RETAIN_HD bool bad_id(const int32_t* ids, int64_t t, int64_t V) { return ids[t] < 0 || ids[t] >= V; }

// ---- RMSNorm -----------------------------------------------------------------------------

struct RowPartials {
  float ss;   // Σ x² over this thread's elements
  float dot;  // Σ (w·dy)·x (backward only)
};

// Thread `tid`'s partial sums of one row, in the order the kernel adds them. dy == nullptr:
// forward (dot stays 0).
RETAIN_HD RowPartials row_partials(const float* x, const float* w, const float* dy, int64_t D, int tid) {
  RowPartials p{0.0f, 0.0f};
  for (int64_t j = tid; j < D; j += kRowThreads) {
    const float xj = x[j];
    p.ss += xj * xj;
    if (dy) p.dot += (w[j] * dy[j]) * xj;
  }
  return p;
}

// One level of the block's pairwise tree: slot i (< s) takes slot i + s.
RETAIN_HD void fold_pair(RowPartials* slots, int i, int s) {
  slots[i].ss += slots[i + s].ss;
  slots[i].dot += slots[i + s].dot;
}

// r = 1/sqrt(mean(x²) + eps), IEEE sqrt and division (the CPU forms it in float64).
RETAIN_HD float rms_inverse(float ss, int64_t D, float eps) {
  return 1.0f / sqrtf(ss / static_cast<float>(D) + eps);
}

// Forward element j: w·(x·r), the CPU's order of products.
RETAIN_HD float rmsnorm_element(float x, float w, float r) { return w * (x * r); }

// Backward element j: r·(w·dy) − x·c with c = r³·⟨w⊙dy, x⟩/D.
RETAIN_HD float rmsnorm_backward_coef(float dot, float r, int64_t D) {
  return dot * r * r * r / static_cast<float>(D);
}
RETAIN_HD float rmsnorm_backward_element(float x, float w, float dy, float r, float c) {
  return r * (w * dy) - c * x;
}

// ---- RoPE --------------------------------------------------------------------------------

// The rotation of pair (x_j, x_{j+d/2}) for token t, rope() (sign = +1) or its transpose
// (sign = −1): c and s formed exactly as kernels/cpu/rope.cpp forms them.
struct Rotation {
  float c, s;
};
RETAIN_HD Rotation rope_rotation(int32_t pos, float inv_freq, float attention_factor, float sign) {
  const float angle = static_cast<float>(pos) * inv_freq;  // float32, as HF
  return {cosf(angle) * attention_factor, sign * (sinf(angle) * attention_factor)};
}

// Thread i of T·(d/2) owns (t, j) = (i / half, i % half) and rotates that pair in every head.
RETAIN_HD void rope_pair(float* x, const int32_t* positions, const float* inv_freq, float attention_factor,
                             float sign, int64_t heads, int64_t d, int64_t i) {
  const int64_t half = d / 2, t = i / half, j = i % half;
  const Rotation r = rope_rotation(positions[t], inv_freq[j], attention_factor, sign);
  for (int64_t h = 0; h < heads; ++h) {
    float* row = x + (t * heads + h) * d;
    const float a = row[j], b = row[j + half];
    row[j] = a * r.c - b * r.s;
    row[j + half] = b * r.c + a * r.s;
  }
}

// ---- SwiGLU and the residual add ---------------------------------------------------------

RETAIN_HD float swiglu_element(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// dgate and dup of element i from gate g, up u, dout o (kernels/cpu/ops_backward.cpp's formulas).
struct SwigluGrad {
  float dgate, dup;
};
RETAIN_HD SwigluGrad swiglu_backward_element(float g, float u, float o) {
  const float e = expf(-fabsf(g));  // σ without exponentiating a positive number
  const float sig = g >= 0 ? 1.0f / (1.0f + e) : e / (1.0f + e);
  return {o * u * (sig * (1.0f + g * (1.0f - sig))), o * (g * sig)};
}

}  // namespace retain::cuda::ops_rows
