// The emulator's wgmma.mma_async (kernels/cuda/wgmma.cuh): the product one warp of a warpgroup
// computes, from its 32 lanes' copies of the instruction and the block's shared memory. The
// scheduler (scheduler.cpp) queues each thread's products and runs them here at the
// wgmma.wait_group that retires their group.
#pragma once
#include <cstddef>
#include <cstdint>

namespace retain::cuda_emu {

// One thread's wgmma.mma_async.m64nNk16.f32.bf16.bf16, as issued.
struct WgmmaOp {
  float* d = nullptr;   // the thread's N/2 accumulator registers
  int n = 0;            // N: 64 or 128
  bool a_in_registers = false;
  uint32_t a[4] = {};   // A's fragment when a_in_registers
  uint64_t desc_a = 0;  // else A's descriptor (K-major)
  uint64_t desc_b = 0;
  bool accumulate = false;  // scale-d: D = A·B + D, else D = A·B
  bool trans_b = false;     // B MN-major
};

// Runs warp `warp_in_group` (0–3: rows 16w..16w+15 of D) of one wgmma: lanes[l] is lane l's
// copy (all must agree but for a and d). `shared` is the block's shared-memory window (address 0
// at shared[0]), its dynamic shared memory the addresses [lo, hi). A descriptor the emulator
// cannot read faithfully, or an operand outside [lo, hi), stops it.
void run_wgmma_warp(const WgmmaOp* const (&lanes)[32], int warp_in_group, const unsigned char* shared, size_t lo,
                    size_t hi);

}  // namespace retain::cuda_emu
