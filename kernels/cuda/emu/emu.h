// The CUDA emulator's interface to emulated device code (kernels/cuda/emu/README.md): the
// launch of a kernel over its grid, each CUDA thread a fiber, blocks one at a time; block
// barriers; warp collectives (shuffles, votes, ldmatrix, mma.sync) computed once all lanes of
// the warp have arrived; cp.async copies that land only when their group is waited on; and
// wgmma products computed only when their group is waited on.
// Everything here runs on the calling host thread; results are deterministic.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <tuple>
#include <utility>

namespace retain::cuda_emu {

// ---- launch -------------------------------------------------------------------------------

struct LaunchConfig {
  dim3 grid, block;
  size_t dynamic_shared = 0;
  cudaStream_t stream = nullptr;
  LaunchConfig(dim3 g, dim3 b, size_t smem = 0, cudaStream_t s = nullptr)
      : grid(g), block(b), dynamic_shared(smem), stream(s) {}
};

// Runs `body` once per CUDA thread of the grid (what `kernel<<<...>>>(args)` becomes); a bad
// configuration sets the launch error that cudaGetLastError reports, as the runtime does.
void run_grid(const LaunchConfig& config, const void* kernel, const char* name, const std::function<void()>& body);

template <class... Params, class... Args>
void launch(void (*kernel)(Params...), const char* name, const LaunchConfig& config, Args&&... args) {
  // Evaluated once in the caller, as kernel arguments are; each thread gets its own copies.
  std::tuple<std::decay_t<Args>...> values(std::forward<Args>(args)...);
  run_grid(config, reinterpret_cast<const void*>(kernel), name,
           [&] { std::apply([&](const auto&... v) { kernel(v...); }, values); });
}

// ---- inside a kernel ----------------------------------------------------------------------

// Stops the emulation with a message naming the running kernel, block and thread.
[[noreturn]] void device_fault(const char* what);

struct ThreadPosition {
  uint3 thread, block;
  dim3 block_dim, grid_dim;
};
const ThreadPosition& position();  // the running CUDA thread's indices
void* dynamic_shared();            // the block's dynamic shared memory (128-byte aligned)

void syncthreads();
int syncthreads_or(int predicate);
int syncthreads_and(int predicate);
int syncthreads_count(int predicate);
void syncwarp(unsigned mask);

// Warp collectives. Every lane named in `mask` must reach the same collective (the emulator
// stops with a message naming the kernel and block otherwise); all are the full warp here.

// __shfl_xor_sync (xor_lanes) or __shfl_sync of a value of `bytes` ≤ 8 bytes; each lane names
// its own source lane (or xor mask) in lane_arg.
void shuffle(bool xor_lanes, unsigned mask, const void* in, void* out, size_t bytes, int lane_arg);
template <class T>
T shuffle(bool xor_lanes, unsigned mask, T v, int lane_arg, int width) {
  static_assert(sizeof(T) <= 8, "the emulator shuffles values of up to 8 bytes");
  if (width != 32) device_fault("a shuffle of width other than 32 is not emulated");
  T r;
  shuffle(xor_lanes, mask, &v, &r, sizeof(T), lane_arg);
  return r;
}
int any(unsigned mask, int predicate);
int all(unsigned mask, int predicate);
unsigned ballot(unsigned mask, int predicate);

// PTX: ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 (lane i gives the address of row i % 8
// of matrix i / 8) and mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32.
void ldmatrix_x4(uint32_t (&r)[4], const void* row_address, bool transpose);
void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

// PTX: cp.async.cg.shared.global 16 bytes (zero-fill when !valid), commit_group, wait_group N.
void cp_async_16(void* dst, const void* src, bool valid);
void cp_async_commit();
void cp_async_wait(int pending);

// The shared-window address of a pointer into the block's dynamic shared memory (what
// cvta.to.shared gives on the device; dynamic shared memory starts at window address 128).
uint32_t shared_window_address(const void* p);

// PTX: wgmma.fence, wgmma.commit_group, wgmma.wait_group N and wgmma.mma_async.sync.aligned
// .m64nNk16.f32.bf16.bf16 with A from registers (a_registers) or a descriptor (kernels/cuda/
// wgmma.cuh). Each product runs at the wait that retires its group (emu/wgmma_emu.h).
void wgmma_fence();
void wgmma_commit_group();
void wgmma_wait_group(int pending);
void wgmma_bf16(float* d, int n, const uint32_t* a_registers, uint64_t desc_a, uint64_t desc_b, bool accumulate,
                bool trans_b);

}  // namespace retain::cuda_emu
