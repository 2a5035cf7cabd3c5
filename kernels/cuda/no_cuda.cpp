// Device memory entry points for builds without nvcc: each fails with one clear line.
#include "kernels/base/error.h"
#include "kernels/cuda/memory.h"

namespace retain::cuda {

namespace {
[[noreturn]] void no_cuda() { fail("this build of retain has no CUDA support (nvcc was not found at configure time)"); }
}  // namespace

void* device_alloc(size_t) { no_cuda(); }
void device_free(void*) noexcept {}
void copy_to_device(void*, const void*, size_t) { no_cuda(); }
void copy_to_host(void*, const void*, size_t) { no_cuda(); }
void copy_device_to_device(void*, const void*, size_t) { no_cuda(); }
void memset_device(void*, int, size_t) { no_cuda(); }
int device_count() noexcept { return 0; }
void synchronize() { no_cuda(); }
void set_device(int) { no_cuda(); }
std::string device_name() { no_cuda(); }
DeviceMemoryStats device_memory_stats() { no_cuda(); }
void reset_device_memory_peak() { no_cuda(); }
bool built() noexcept { return false; }
bool is_device_pointer(const void*) noexcept { return false; }

}  // namespace retain::cuda
