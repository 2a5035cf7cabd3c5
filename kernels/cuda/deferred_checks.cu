// The CUDA side of kernels/deferred_checks.h: per check, a reset of its device slot, a
// grid-stride scan recording the smallest failing index with atomicMin, and a one-thread
// kernel copying that element's bits into the slot — all on the legacy default stream, in
// order with the op that follows, so nothing waits until the verdicts are read.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/check.h"
#include "kernels/cuda/grid.cuh"
#include "kernels/cuda/memory.h"
#include "kernels/cuda/retention_cuda.h"
#include "kernels/deferred_checks.h"

namespace retain::cuda {

namespace {

static_assert(sizeof(ops::DeferredSlot) == 16 && sizeof(unsigned long long) == sizeof(uint64_t));

__global__ void scan_kernel(const uint32_t* x, int64_t n, ops::ValueRule rule, ops::DeferredSlot* slot) {
  auto* first = reinterpret_cast<unsigned long long*>(&slot->first);
  for (int64_t i = first_index(); i < n; i += grid_stride())
    if (ops::value_breaks_rule(rule, x[i])) atomicMin(first, static_cast<unsigned long long>(i));
}

__global__ void fetch_kernel(const uint32_t* x, ops::DeferredSlot* slot) {
  if (slot->first != ops::kNoFailure) slot->bits = x[slot->first];
}

class CudaDeferredChecks final : public ops::DeferredCheckDevice {
 public:
  void enqueue(int slot, const void* data, int64_t n, ops::ValueRule rule) override {
    // The slots live as long as the process: allocated at the first check, never freed (a
    // free at static destruction could run after the CUDA context is gone).
    if (!slots_) slots_ = static_cast<ops::DeferredSlot*>(device_alloc(sizeof(ops::DeferredSlot) * ops::kDeferredSlots));
    ops::DeferredSlot* s = slots_ + slot;
    static_assert(ops::kNoFailure == ~uint64_t{0}, "the reset writes all-ones bytes");
    CUDA_CHECK(cudaMemsetAsync(&s->first, 0xff, sizeof s->first, cudaStreamLegacy));
    const auto* x = static_cast<const uint32_t*>(data);
    scan_kernel<<<elem_blocks(n), kElemThreads>>>(x, n, rule, s);
    CUDA_CHECK(cudaGetLastError());
    fetch_kernel<<<1, 1>>>(x, s);
    CUDA_CHECK(cudaGetLastError());
  }
  void read(ops::DeferredSlot* out, int count) override {
    if (count > 0) CUDA_CHECK(cudaMemcpy(out, slots_, sizeof(ops::DeferredSlot) * count, cudaMemcpyDeviceToHost));
  }

 private:
  ops::DeferredSlot* slots_ = nullptr;
};

}  // namespace

ops::DeferredCheckDevice& deferred_check_device() {
  static CudaDeferredChecks device;
  return device;
}

}  // namespace retain::cuda
