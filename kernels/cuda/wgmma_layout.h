// Shared-memory layouts and matrix descriptors of Hopper's wgmma.mma_async (PTX ISA,
// "Asynchronous Warpgroup Level Matrix Multiply-Accumulate": "Matrix Descriptor Format",
// "Shared Memory Matrix Layout"), for bf16 operands in the 128-byte swizzle, the layout TMA's
// CU_TENSOR_MAP_SWIZZLE_128B writes. Host and device code: the CUDA emulator decodes the same
// descriptors (kernels/cuda/emu/scheduler.cpp) and tests/cuda_emu checks both against the
// hardware on a GPU. Unverified on a GPU so far.
//
// A tile of R rows × C bf16 columns (C a multiple of 64) is stored as C/64 panels of R rows ×
// 128 bytes; panel p holds columns 64p..64p+63, row r of it sits at byte 128·r, and each group
// of 8 rows (1,024 bytes) is one swizzle atom: the 16-byte chunk j of row r is stored at chunk
// j ^ (r % 8). The swizzle is a function of the shared-memory address (bits 4–6 ^= bits 7–9),
// so a tile must start 1,024-byte aligned.
//
// The two ways a wgmma operand reads such a tile:
//   K-major   (rows = M or N, columns = K; Q and K in Q·Kᵀ): one instruction reads 16 columns
//             (32 bytes) of up to 256 rows; its descriptor starts at the panel's row 0 plus
//             the 32-byte step inside the 128-byte row, 8-row groups 1,024 bytes apart (SBO).
//   MN-major  (rows = K, columns = N; V in P·V, read with the transpose bit): one instruction
//             reads 16 rows (K) of N columns; 8-row K groups are 1,024 bytes apart (SBO), 64-
//             column N groups one panel apart (LBO = 128·R).
#pragma once
#include <cstdint>

#include "kernels/cuda/host_device.h"

namespace retain::cuda::wgmma {

inline constexpr int kPanelCols = 64;       // bf16 columns per 128-byte swizzled row
inline constexpr uint32_t kRowBytes = 128;  // one swizzled row
inline constexpr uint32_t kAtomBytes = 1024;  // 8 rows: the swizzle's period (and SBO)

// The 128-byte swizzle of a shared-memory byte address: chunk bits 4–6 ^= row bits 7–9.
RETAIN_HD uint32_t swizzle128(uint32_t address) { return address ^ (((address >> 7) & 7u) << 4); }

// Byte offset of element (row, col) in a swizzled R-row tile starting at a 1,024-aligned
// address (the offset is then the address's low bits, so the swizzle applies to it as is).
RETAIN_HD uint32_t tile_offset(int rows, int row, int col) {
  const uint32_t logical = static_cast<uint32_t>(col / kPanelCols) * kRowBytes * static_cast<uint32_t>(rows) +
                           static_cast<uint32_t>(row) * kRowBytes + static_cast<uint32_t>(col % kPanelCols) * 2u;
  return swizzle128(logical);
}

// The 64-bit matrix descriptor: start address, LBO and SBO in 16-byte units (14 bits each, bits
// 0–13, 16–29, 32–45), base offset 0 (bits 49–51; the start's bits 7–9 must then be 0, which
// every descriptor below keeps), layout type 1 = 128-byte swizzle (bits 62–63).
RETAIN_HD uint64_t make_desc(uint32_t start, uint32_t lbo, uint32_t sbo) {
  return (uint64_t{(start >> 4) & 0x3fffu}) | (uint64_t{(lbo >> 4) & 0x3fffu} << 16) |
         (uint64_t{(sbo >> 4) & 0x3fffu} << 32) | (uint64_t{1} << 62);
}

// K-major operand: rows [row0, row0 + 64 or N) × columns [col0, col0 + 16) of an R-row tile at
// `tile` (a shared-memory address, 1,024-aligned); row0 a multiple of 8, col0 of 16.
RETAIN_HD uint64_t k_major_desc(uint32_t tile, int rows, int row0, int col0) {
  const uint32_t start = tile + static_cast<uint32_t>(col0 / kPanelCols) * kRowBytes * static_cast<uint32_t>(rows) +
                         static_cast<uint32_t>(row0) * kRowBytes + static_cast<uint32_t>(col0 % kPanelCols) * 2u;
  return make_desc(start, /*lbo: unused by swizzled K-major layouts*/ 16, kAtomBytes);
}

// MN-major operand: K rows [row0, row0 + 16) × N columns [col0, col0 + N) of an R-row tile;
// row0 a multiple of 16, col0 of 64.
RETAIN_HD uint64_t mn_major_desc(uint32_t tile, int rows, int row0, int col0) {
  const uint32_t panel = kRowBytes * static_cast<uint32_t>(rows);
  const uint32_t start = tile + static_cast<uint32_t>(col0 / kPanelCols) * panel + static_cast<uint32_t>(row0) * kRowBytes;
  return make_desc(start, panel, kAtomBytes);
}

// What k_major_desc / mn_major_desc add to the descriptor of the same tile at row0 = col0 = 0
// (only the start address moves, in 16-byte units, and stays below 2^18 bytes in shared
// memory, so no field overflows): compile-time constants in an unrolled k loop, so a kernel
// builds each tile's descriptor once instead of once per instruction.
RETAIN_HD constexpr uint64_t k_major_step(int rows, int row0, int col0) {
  return (static_cast<uint64_t>(col0 / kPanelCols) * kRowBytes * static_cast<uint64_t>(rows) +
          static_cast<uint64_t>(row0) * kRowBytes + static_cast<uint64_t>(col0 % kPanelCols) * 2u) >> 4;
}
RETAIN_HD constexpr uint64_t mn_major_step(int rows, int row0, int col0) {
  return (static_cast<uint64_t>(col0 / kPanelCols) * kRowBytes * static_cast<uint64_t>(rows) +
          static_cast<uint64_t>(row0) * kRowBytes) >> 4;
}

}  // namespace retain::cuda::wgmma
