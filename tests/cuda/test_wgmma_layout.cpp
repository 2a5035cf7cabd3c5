// The wgmma operand layouts and descriptors (kernels/cuda/wgmma_layout.h), on the host: the
// descriptor's fields where the PTX ISA's "Matrix Descriptor Format" puts them; the 128-byte
// swizzle a permutation of 16-byte chunks inside each 1,024-byte atom; a tile's elements at
// distinct, in-range, 2-byte-aligned offsets; and what an instruction reads through each
// descriptor (decoded with the canonical layouts of kernels/cuda/emu/wgmma_emu.cpp, written
// out again here) is the tile's element it should be. The hardware's reading is checked by
// tests/cuda_emu (CudaEmu.WgmmaGivesTheMatrixProductInEveryOperandLayout) on a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <vector>

#include "kernels/cuda/wgmma_layout.h"

namespace {

using namespace retain::cuda::wgmma;

struct Fields {
  uint32_t start, lbo, sbo, base_offset, layout;
};
Fields fields(uint64_t d) {
  return {static_cast<uint32_t>(d & 0x3fff) << 4, static_cast<uint32_t>((d >> 16) & 0x3fff) << 4,
          static_cast<uint32_t>((d >> 32) & 0x3fff) << 4, static_cast<uint32_t>((d >> 49) & 7),
          static_cast<uint32_t>(d >> 62)};
}

TEST(WgmmaLayout, DescriptorFieldsSitWhereThePtxIsaPutsThem) {
  const uint64_t d = make_desc(0x3fff0, 0x2000, 0x400);
  const Fields f = fields(d);
  EXPECT_EQ(f.start, 0x3fff0u);
  EXPECT_EQ(f.lbo, 0x2000u);
  EXPECT_EQ(f.sbo, 0x400u);
  EXPECT_EQ(f.base_offset, 0u);
  EXPECT_EQ(f.layout, 1u) << "1 = SWIZZLE_128B";
  // Bits 14-15, 30-31, 46-48 and 52-61 are reserved: zero.
  EXPECT_EQ(d & ((uint64_t{3} << 14) | (uint64_t{3} << 30) | (uint64_t{7} << 46) | (uint64_t{0x3ff} << 52)), 0u);
}

TEST(WgmmaLayout, SwizzlePermutesChunksWithinEachAtom) {
  for (uint32_t atom = 0; atom < 4 * kAtomBytes; atom += kAtomBytes) {
    std::set<uint32_t> seen;
    for (uint32_t a = atom; a < atom + kAtomBytes; a += 16) {
      const uint32_t s = swizzle128(a);
      EXPECT_EQ(s / kAtomBytes, atom / kAtomBytes);
      EXPECT_EQ(s / kRowBytes, a / kRowBytes) << "a chunk stays in its 128-byte row";
      EXPECT_EQ(s % 16, 0u);
      seen.insert(s);
    }
    EXPECT_EQ(seen.size(), kAtomBytes / 16);
  }
  EXPECT_EQ(swizzle128(3 * 128 + 5 * 16 + 6), 3 * 128 + (5 ^ 3) * 16 + 6u);
}

TEST(WgmmaLayout, TileElementsHaveDistinctOffsetsInsideTheTile) {
  for (const int rows : {16, 64, 128}) {
    for (const int cols : {64, 128}) {
      std::set<uint32_t> seen;
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) {
          const uint32_t o = tile_offset(rows, r, c);
          ASSERT_LT(o, static_cast<uint32_t>(rows * cols * 2));
          ASSERT_EQ(o % 2, 0u);
          seen.insert(o);
        }
      EXPECT_EQ(seen.size(), static_cast<size_t>(rows * cols)) << rows << " x " << cols;
    }
  }
}

// The canonical layouts, read back from a descriptor (the emulator's reading).
uint32_t k_major_at(uint64_t desc, int row, int k) {
  const Fields f = fields(desc);
  return swizzle128(f.start + static_cast<uint32_t>(row % 8) * 128 + static_cast<uint32_t>(row / 8) * f.sbo +
                    static_cast<uint32_t>(k) * 2);
}
uint32_t mn_major_at(uint64_t desc, int mn, int k) {
  const Fields f = fields(desc);
  return swizzle128(f.start + static_cast<uint32_t>(mn % 64) * 2 + static_cast<uint32_t>(mn / 64) * f.lbo +
                    static_cast<uint32_t>(k % 8) * 128 + static_cast<uint32_t>(k / 8) * f.sbo);
}

TEST(WgmmaLayout, DescriptorsAddressTheTileElementsTheInstructionReads) {
  const uint32_t tile = 3 * kAtomBytes;  // any 1,024-aligned start
  for (const int rows : {64, 128}) {
    for (const int cols : {64, 128, 192}) {
      // K-major: rows [row0, row0 + 64) × k [k0, k0 + 16).
      for (int row0 = 0; row0 + 64 <= rows; row0 += 64)
        for (int k0 = 0; k0 < cols; k0 += 16) {
          const uint64_t d = k_major_desc(tile, rows, row0, k0);
          EXPECT_EQ((fields(d).start >> 7) & 7, 0u) << "the start's bits 7-9 stay 0";
          for (int r = 0; r < 64; ++r)
            for (int k = 0; k < 16; ++k)
              ASSERT_EQ(k_major_at(d, r, k), tile + tile_offset(rows, row0 + r, k0 + k))
                  << rows << "x" << cols << " row " << row0 + r << " col " << k0 + k;
        }
      // MN-major: k rows [k0, k0 + 16) × N = cols columns from 0 (and 64 further when 128 remain).
      for (int k0 = 0; k0 < rows; k0 += 16)
        for (int n0 = 0; n0 + 64 <= cols; n0 += 64) {
          const uint64_t d = mn_major_desc(tile, rows, k0, n0);
          EXPECT_EQ((fields(d).start >> 7) & 7, 0u);
          for (int k = 0; k < 16; ++k)
            for (int n = 0; n + n0 < cols; ++n)
              ASSERT_EQ(mn_major_at(d, n, k), tile + tile_offset(rows, k0 + k, n0 + n))
                  << rows << "x" << cols << " k " << k0 + k << " n " << n0 + n;
        }
    }
  }
}

TEST(WgmmaLayout, DescriptorStepsAreTheDescriptorsOfTheMovedOperand) {
  for (const uint32_t tile : {0u, 8u * kAtomBytes, 160u * kAtomBytes})  // + 64 KB of tile: < 2^18
    for (const int rows : {64, 128})
      for (int col = 0; col < 256; col += 16) {
        for (int row0 = 0; row0 < rows; row0 += 64) {
          EXPECT_EQ(k_major_desc(tile, rows, 0, 0) + k_major_step(rows, row0, col), k_major_desc(tile, rows, row0, col));
        }
        if (col % 64 != 0) continue;
        for (int k0 = 0; k0 < rows; k0 += 16) {
          EXPECT_EQ(mn_major_desc(tile, rows, 0, 0) + mn_major_step(rows, k0, col), mn_major_desc(tile, rows, k0, col));
        }
      }
}

}  // namespace
