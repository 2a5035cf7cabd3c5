// Thin inline-PTX wrappers for the sm_80+ instructions the attention kernels use: cp.async
// (global → shared, 16 bytes, zero-filling), ldmatrix (shared → mma fragments) and
// mma.sync.m16n8k16 with bf16 inputs and fp32 accumulators. Fragment layouts are spelled out
// (and tested on the host) in kernels/cuda/attention_tiles.h.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace retain::cuda::ptx {

#if defined(RETAIN_CUDA_EMU)
// Compiled for the CUDA emulator (kernels/cuda/emu/README.md): the same instructions, executed
// by the emulator from the PTX ISA's definitions.
inline void cp_async_16(void* dst, const void* src, bool valid) { cuda_emu::cp_async_16(dst, src, valid); }
inline void cp_async_commit() { cuda_emu::cp_async_commit(); }
template <int N>
inline void cp_async_wait() {
  cuda_emu::cp_async_wait(N);
}
inline void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cuda_emu::mma_bf16_16816(d, a, b0, b1);
}
// A shared-memory tile as ldmatrix addresses it: here a pointer, on the device a 32-bit
// shared-window address (set once per tile, so a load is base + offset).
using SmemBase = const unsigned char*;
inline SmemBase smem_base(const void* tile) { return static_cast<SmemBase>(tile); }
inline void ldmatrix_x4_at(uint32_t (&r)[4], SmemBase base, uint32_t byte_offset) {
  cuda_emu::ldmatrix_x4(r, base + byte_offset, false);
}
inline void ldmatrix_x4_trans_at(uint32_t (&r)[4], SmemBase base, uint32_t byte_offset) {
  cuda_emu::ldmatrix_x4(r, base + byte_offset, true);
}
#else

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes from global `src` to shared `dst` when `valid`, else writes 16 zero bytes
// (src-size 0: nothing is read, but `src` must still be a valid address, so callers pass a
// clamped in-range row). Both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ldmatrix at a tile's shared-window address plus a byte offset (kernels/cuda/attention_tiles.h
// LdsmLane): one add per load, the tile's address converted once.
using SmemBase = uint32_t;
__device__ __forceinline__ SmemBase smem_base(const void* tile) { return smem_addr(tile); }
__device__ __forceinline__ void ldmatrix_x4_at(uint32_t (&r)[4], SmemBase base, uint32_t byte_offset) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(base + byte_offset));
}
__device__ __forceinline__ void ldmatrix_x4_trans_at(uint32_t (&r)[4], SmemBase base, uint32_t byte_offset) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(base + byte_offset));
}

// d += a · b for one 16×8 fp32 tile (a: 16×16 bf16, b: 16×8 bf16).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#endif  // RETAIN_CUDA_EMU

// ldmatrix at one row address (each lane's own), for code without a per-tile base.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row_addr) {
  ldmatrix_x4_at(r, smem_base(row_addr), 0);
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_addr) {
  ldmatrix_x4_trans_at(r, smem_base(row_addr), 0);
}

// Two floats as one register of two bf16 (round to nearest even): x in the low half, which
// is the lower column / k index in every fragment layout.
__device__ __forceinline__ uint32_t pack_bf16(float x, float y) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
#if defined(RETAIN_CUDA_EMU)  // the host compiler's strict aliasing: the same bits, copied
  uint32_t bits;
  memcpy(&bits, &v, sizeof bits);
  return bits;
#else
  return *reinterpret_cast<const uint32_t*>(&v);
#endif
}

}  // namespace retain::cuda::ptx
