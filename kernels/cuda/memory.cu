// Device memory from the current device's default memory pool, stream-ordered on the legacy
// default stream (every retain kernel and copy runs there). The pool keeps what is freed
// (release threshold: unlimited), so a step that allocates and frees the same layer-sized
// buffers 36 times pays the driver once; its statistics are what the trainer reports as peak.
#include <atomic>
#include <cstdint>

#include "kernels/cuda/check.h"
#include "kernels/cuda/memory.h"

namespace retain::cuda {

namespace {

cudaMemPool_t default_pool() {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  cudaMemPool_t pool = nullptr;
  CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
  return pool;
}

// Once per process (per device in use at the first allocation): keep freed memory pooled.
void keep_freed_memory() {
  static const bool done = [] {
    uint64_t unlimited = UINT64_MAX;
    CUDA_CHECK(cudaMemPoolSetAttribute(default_pool(), cudaMemPoolAttrReleaseThreshold, &unlimited));
    return true;
  }();
  (void)done;
}

std::atomic<bool> allocated_on_device{false};

}  // namespace

void* device_alloc(size_t bytes) {
  void* p = nullptr;
  if (bytes == 0) return nullptr;
  keep_freed_memory();
  allocated_on_device.store(true, std::memory_order_relaxed);
  CUDA_CHECK(cudaMallocAsync(&p, bytes, cudaStreamLegacy));
  return p;
}

void device_free(void* p) noexcept {
  if (p) cudaFreeAsync(p, cudaStreamLegacy);  // errors at teardown are not actionable
}

void copy_to_device(void* dst, const void* src, size_t bytes) {
  if (bytes) CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
void copy_to_host(void* dst, const void* src, size_t bytes) {
  if (bytes) CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
void copy_device_to_device(void* dst, const void* src, size_t bytes) {
  if (bytes) CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice));
}
void memset_device(void* dst, int value, size_t bytes) {
  if (bytes) CUDA_CHECK(cudaMemset(dst, value, bytes));
}

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

bool built() noexcept { return true; }

bool is_device_pointer(const void* p) noexcept {
  if (p == nullptr || !allocated_on_device.load(std::memory_order_relaxed)) return false;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // plain host memory on old drivers: not sticky, but cleared anyway
    return false;
  }
  return a.type == cudaMemoryTypeDevice;
}

void synchronize() { CUDA_CHECK(cudaDeviceSynchronize()); }

void set_device(int ordinal) { CUDA_CHECK(cudaSetDevice(ordinal)); }

std::string device_name() {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

DeviceMemoryStats device_memory_stats() {
  cudaMemPool_t pool = default_pool();
  uint64_t used = 0, high = 0, reserved = 0, reserved_high = 0;
  CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
  CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));
  CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved));
  CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &reserved_high));
  size_t free_bytes = 0, total = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  return {static_cast<size_t>(used), static_cast<size_t>(high), static_cast<size_t>(reserved),
          static_cast<size_t>(reserved_high), total - free_bytes};
}

void reset_device_memory_peak() {
  uint64_t zero = 0;  // the only value the driver accepts: the high-water mark restarts from now
  CUDA_CHECK(cudaMemPoolSetAttribute(default_pool(), cudaMemPoolAttrUsedMemHigh, &zero));
  CUDA_CHECK(cudaMemPoolSetAttribute(default_pool(), cudaMemPoolAttrReservedMemHigh, &zero));
}

}  // namespace retain::cuda
