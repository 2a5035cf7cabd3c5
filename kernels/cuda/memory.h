// Device memory for Tensor. Implemented in memory.cu in CUDA builds and in
// no_cuda.cpp otherwise (where every call fails with a clear "built without CUDA").
#pragma once
#include <cstddef>
#include <string>

namespace retain::cuda {

void* device_alloc(size_t bytes);
void device_free(void* p) noexcept;
void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* src, size_t bytes);
void copy_device_to_device(void* dst, const void* src, size_t bytes);
void memset_device(void* dst, int value, size_t bytes);
int device_count() noexcept;
// True when `p` points into device memory (cudaMalloc/cudaMallocAsync, managed memory
// excluded): what a communicator must stage through the host for a host-only transport.
// False for host memory, for null, always in a build without CUDA, and before this process's
// first device_alloc (so a CPU-only process never creates a CUDA context just to ask).
bool is_device_pointer(const void* p) noexcept;
bool built() noexcept;
// Waits for all work queued on the current device.
void synchronize();
// Makes `ordinal` the calling thread's device (before its first allocation there).
void set_device(int ordinal);
// The current device's name as the driver reports it ("NVIDIA H100 80GB HBM3").
std::string device_name();

// The device's default stream-ordered memory pool (cudaMallocAsync), which device_alloc uses:
// bytes handed out now, the most handed out at once since the last reset, and bytes the pool
// holds from the driver (it keeps freed memory for reuse instead of returning it, so tensors
// allocated and freed every layer cost no cudaMalloc/cudaFree synchronization), and the most it
// has held since the last reset; device_used: the whole device's memory in use now (total − free
// from cudaMemGetInfo), which also counts the CUDA context, library workspaces outside the pool
// and other processes: what "fits on the card" means when the card is shared.
struct DeviceMemoryStats {
  size_t in_use = 0, peak = 0, reserved = 0, reserved_peak = 0, device_used = 0;
};
DeviceMemoryStats device_memory_stats();
// Restarts both high-water marks (in use and reserved) from now.
void reset_device_memory_peak();

}  // namespace retain::cuda
