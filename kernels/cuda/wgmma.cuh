// Inline-PTX wrappers for Hopper's warpgroup matrix multiply (sm_90a): wgmma.mma_async with
// bf16 operands and fp32 accumulators, m64n64k16 and m64n128k16, A from shared memory (SS) or
// from registers (RS), B from shared memory K-major or MN-major (kTransB); and the fence,
// commit and wait that order them. Operand layouts and descriptors: kernels/cuda/wgmma_layout.h.
// Under RETAIN_CUDA_EMU the emulator runs them (kernels/cuda/emu/README.md), deferring each
// product to the wait that retires its group, as the hardware may. Unverified on a GPU so far:
// tests/cuda_emu checks emulator and hardware against the same definitions when one is lent.
//
// Register layouts (PTX ISA, "Register Fragments and Shared Memory Matrix Layouts" for wgmma
// .m64nNk16): the warpgroup's 4 warps own rows 16w..16w+15 of the 64-row D; within a warp,
// with g = lane/4 and c = lane%4, d[4j + e] holds row g + 8·(e/2), column 8j + 2c + e%2 — the
// mma.m16n8 accumulator repeated N/8 times. A in registers (RS) is the mma.m16n8k16 A fragment
// of the warp's 16 rows: (g, 2c..2c+1), (g+8, 2c..), (g, 2c+8..), (g+8, 2c+8..).
#pragma once
#include <cstdint>

#include "kernels/cuda/wgmma_layout.h"

namespace retain::cuda::wgmma {

#if defined(RETAIN_CUDA_EMU)
// The shared-memory window address of a pointer into the block's dynamic shared memory.
inline uint32_t smem_address(const void* p) { return cuda_emu::shared_window_address(p); }
inline void fence() { cuda_emu::wgmma_fence(); }
inline void commit_group() { cuda_emu::wgmma_commit_group(); }
template <int N>
inline void wait_group() {
  cuda_emu::wgmma_wait_group(N);
}
// Orders the compiler's accesses to accumulators around the asynchronous products (a no-op
// here: the emulator writes them only at the wait).
template <class T>
inline void fence_operand(T&) {}
// Makes this thread's ordinary shared-memory stores visible to wgmma's reads (the async proxy).
inline void fence_proxy_async() {}
template <bool kTransB, int R>
inline void mma_ss(float (&d)[R], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  static_assert(R == 32 || R == 64, "m64n64k16 or m64n128k16");
  cuda_emu::wgmma_bf16(d, 2 * R, /*a_regs=*/nullptr, desc_a, desc_b, accumulate, kTransB);
}
template <bool kTransB, int R>
inline void mma_rs(float (&d)[R], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
  static_assert(R == 32 || R == 64, "m64n64k16 or m64n128k16");
  cuda_emu::wgmma_bf16(d, 2 * R, a, 0, desc_b, accumulate, kTransB);
}
#else

// wgmma exists on sm_90a only: the compute_90 PTX that the build also embeds (for newer GPUs,
// which have no wgmma either) traps instead; kernels using these run on sm_90 devices only.
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define RETAIN_SM90A_ASM(...) __trap()
#else
#define RETAIN_SM90A_ASM(...) asm volatile(__VA_ARGS__)
#endif

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void fence() { RETAIN_SM90A_ASM("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit_group() { RETAIN_SM90A_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait_group() {
  RETAIN_SM90A_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins an accumulator register between the asynchronous products and the code that reads it,
// so the compiler moves no access across a fence or wait.
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
template <int R>
__device__ __forceinline__ void fence_operand(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) fence_operand(d[i]);
}
template <int NT>
__device__ __forceinline__ void fence_operand(float (&d)[NT][4]) {
#pragma unroll
  for (int i = 0; i < NT; ++i) fence_operand(d[i]);
}
// The same for a register A operand (mma_rs): FlashAttention-3 fences its register-sourced A
// fragments before the wgmma.fence and after the wait as it does the accumulators, so the
// compiler neither rewrites them while the asynchronous product may still read them nor moves
// their computation across the fence.
__device__ __forceinline__ void fence_operand(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
template <int KS>
__device__ __forceinline__ void fence_operand(uint32_t (&a)[KS][4]) {
#pragma unroll
  for (int i = 0; i < KS; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) fence_operand(a[i][j]);
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The accumulator operands of an m64nNk16 (N/2 fp32 registers, %0 .. %(N/2 − 1)) as the PTX
// string lists them and as asm operands, so each instruction below names only what differs.
#define RETAIN_WGMMA_D_REGS32                                                      \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define RETAIN_WGMMA_D_REGS64                                                      \
  RETAIN_WGMMA_D_REGS32 ", "                                                       \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define RETAIN_WGMMA_F8(d, i)                                                                             \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define RETAIN_WGMMA_D_OPERANDS32(d) \
  RETAIN_WGMMA_F8(d, 0), RETAIN_WGMMA_F8(d, 8), RETAIN_WGMMA_F8(d, 16), RETAIN_WGMMA_F8(d, 24)
#define RETAIN_WGMMA_D_OPERANDS64(d) \
  RETAIN_WGMMA_D_OPERANDS32(d), RETAIN_WGMMA_F8(d, 32), RETAIN_WGMMA_F8(d, 40), RETAIN_WGMMA_F8(d, 48), RETAIN_WGMMA_F8(d, 56)

template <bool kTransB>
__device__ __forceinline__ void mma_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  RETAIN_SM90A_ASM(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      RETAIN_WGMMA_D_REGS32
      "}, %32, %33, p, 1, 1, 0, %35;\n}\n"
      : RETAIN_WGMMA_D_OPERANDS32(d)
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(static_cast<int>(kTransB)));
}

template <bool kTransB>
__device__ __forceinline__ void mma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
  RETAIN_SM90A_ASM(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      RETAIN_WGMMA_D_REGS32
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : RETAIN_WGMMA_D_OPERANDS32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)),
        "n"(static_cast<int>(kTransB)));
}

template <bool kTransB>
__device__ __forceinline__ void mma_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  RETAIN_SM90A_ASM(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      RETAIN_WGMMA_D_REGS64
      "}, %64, %65, p, 1, 1, 0, %67;\n}\n"
      : RETAIN_WGMMA_D_OPERANDS64(d)
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(static_cast<int>(kTransB)));
}

template <bool kTransB>
__device__ __forceinline__ void mma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
  RETAIN_SM90A_ASM(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      RETAIN_WGMMA_D_REGS64
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
      : RETAIN_WGMMA_D_OPERANDS64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)),
        "n"(static_cast<int>(kTransB)));
}

#undef RETAIN_SM90A_ASM
#undef RETAIN_WGMMA_D_REGS32
#undef RETAIN_WGMMA_D_REGS64
#undef RETAIN_WGMMA_F8
#undef RETAIN_WGMMA_D_OPERANDS32
#undef RETAIN_WGMMA_D_OPERANDS64
#endif  // RETAIN_CUDA_EMU

// The accumulators as mma.sync fragments, [N/8][4] (the same registers in the same order).
template <bool kTransB, int NT>
__device__ __forceinline__ void mma_ss(float (&d)[NT][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  mma_ss<kTransB>(reinterpret_cast<float(&)[NT * 4]>(d), desc_a, desc_b, accumulate);
}
template <bool kTransB, int NT>
__device__ __forceinline__ void mma_rs(float (&d)[NT][4], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
  mma_rs<kTransB>(reinterpret_cast<float(&)[NT * 4]>(d), a, desc_b, accumulate);
}

}  // namespace retain::cuda::wgmma
