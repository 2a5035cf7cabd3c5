// wgmma.mma_async on the emulator (wgmma_emu.h), from the PTX ISA's definitions ("Matrix
// Descriptor Format"; "Shared Memory Matrix Layout" for the 128-byte swizzle; "Register
// Fragments" for D and a register A). The descriptor's fields are read as CUTLASS's
// GmmaDescriptor names them (cute/arch/mma_sm90_desc.hpp) and the canonical layouts as its
// make_gmma_desc states them (cute/atom/mma_traits_sm90_gmma.hpp), in 16-byte units T:
//   K-major,  128B swizzle: ((8, m), (T, 2)) : ((8T, SBO), (1, T))
//   MN-major, 128B swizzle: ((T, 8, n), (8, k)) : ((1, T, LBO), (8T, SBO))
// with the swizzle applied to the resulting shared-memory address (bits 4–6 ^= bits 7–9).
// Only that swizzle is emulated, and only with base offset 0 and a start address whose bits
// 7–9 are 0, where reading the swizzle off the absolute address or off the offset from the
// start agree; anything else stops the emulation rather than guess.
#include "kernels/cuda/emu/wgmma_emu.h"

#include <cstring>

#include "kernels/base/half.h"
#include "kernels/cuda/emu/emu.h"

namespace retain::cuda_emu {

namespace {

struct Desc {
  uint32_t start, lbo, sbo;
};

Desc decode(uint64_t desc) {
  const uint32_t layout = static_cast<uint32_t>(desc >> 62), base_offset = static_cast<uint32_t>(desc >> 49) & 7u;
  const Desc d{static_cast<uint32_t>(desc & 0x3fffu) << 4, static_cast<uint32_t>((desc >> 16) & 0x3fffu) << 4,
               static_cast<uint32_t>((desc >> 32) & 0x3fffu) << 4};
  if (layout != 1) device_fault("wgmma: only the 128-byte swizzle (layout type 1) is emulated");
  if (base_offset != 0) device_fault("wgmma: a descriptor base offset other than 0 is not emulated");
  if ((d.start >> 7) & 7u) device_fault("wgmma: a swizzled operand whose start address has bits 7-9 set is not emulated");
  return d;
}

uint32_t swizzle128(uint32_t a) { return a ^ (((a >> 7) & 7u) << 4); }

// Shared-memory addresses of element (row, k) of a K-major operand and (mn, k) of an MN-major one.
uint32_t k_major(const Desc& d, int row, int k) {
  return swizzle128(d.start + static_cast<uint32_t>(row % 8) * 128u + static_cast<uint32_t>(row / 8) * d.sbo +
                    static_cast<uint32_t>(k) * 2u);
}
uint32_t mn_major(const Desc& d, int mn, int k) {
  return swizzle128(d.start + static_cast<uint32_t>(mn % 64) * 2u + static_cast<uint32_t>(mn / 64) * d.lbo +
                    static_cast<uint32_t>(k % 8) * 128u + static_cast<uint32_t>(k / 8) * d.sbo);
}

struct Window {
  const unsigned char* shared;
  size_t lo, hi;
};

float load_bf16(const Window& s, uint32_t address) {
  if (address % 2 != 0 || address < s.lo || size_t{address} + 2 > s.hi)
    device_fault("wgmma: an operand element lies outside the block's dynamic shared memory");
  uint16_t v;
  std::memcpy(&v, s.shared + address, 2);
  return bf16_to_f32(v);
}

}  // namespace

void run_wgmma_warp(const WgmmaOp* const (&lanes)[32], int warp_in_group, const unsigned char* shared, size_t lo,
                    size_t hi) {
  const Window window{shared, lo, hi};
  const WgmmaOp& op = *lanes[0];
  for (const WgmmaOp* l : lanes)
    if (l->n != op.n || l->a_in_registers != op.a_in_registers || l->desc_b != op.desc_b ||
        l->accumulate != op.accumulate || l->trans_b != op.trans_b || (!op.a_in_registers && l->desc_a != op.desc_a))
      device_fault("wgmma: lanes of one warp issued different instructions (shape, descriptors or flags)");
  const int n = op.n;
  float A[16][16], B[16][128];
  if (op.a_in_registers) {  // the mma.m16n8k16 A fragment of the warp's 16 rows
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, c = l % 4;
      const int rows[4] = {g, g + 8, g, g + 8}, cols[4] = {2 * c, 2 * c, 2 * c + 8, 2 * c + 8};
      for (int r = 0; r < 4; ++r) {
        A[rows[r]][cols[r]] = bf16_to_f32(static_cast<uint16_t>(lanes[l]->a[r] & 0xffffu));
        A[rows[r]][cols[r] + 1] = bf16_to_f32(static_cast<uint16_t>(lanes[l]->a[r] >> 16));
      }
    }
  } else {
    const Desc da = decode(op.desc_a);
    for (int r = 0; r < 16; ++r)
      for (int k = 0; k < 16; ++k) A[r][k] = load_bf16(window, k_major(da, 16 * warp_in_group + r, k));
  }
  const Desc db = decode(op.desc_b);
  for (int k = 0; k < 16; ++k)
    for (int j = 0; j < n; ++j)
      B[k][j] = load_bf16(window, op.trans_b ? mn_major(db, j, k) : k_major(db, j, k));
  // d[4j + e] is (row g + 8·(e/2), column 8j + 2c + e%2); the k-sum in fp32, in k order.
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, c = l % 4;
    float* d = lanes[l]->d;
    for (int i = 0; i < n / 2; ++i) {
      const int row = g + 8 * ((i % 4) / 2), col = 8 * (i / 4) + 2 * c + i % 2;
      float s = op.accumulate ? d[i] : 0.0f;
      for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
      d[i] = s;
    }
  }
}

}  // namespace retain::cuda_emu
