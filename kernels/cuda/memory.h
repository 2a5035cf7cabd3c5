// Device memory for Tensor. Implemented in memory.cu in CUDA builds and in
// no_cuda.cpp otherwise (where every call fails with a clear "built without CUDA").
#pragma once
#include <cstddef>

namespace retain::cuda {

void* device_alloc(size_t bytes);
void device_free(void* p) noexcept;
void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* src, size_t bytes);
void copy_device_to_device(void* dst, const void* src, size_t bytes);
void memset_device(void* dst, int value, size_t bytes);
int device_count() noexcept;
bool built() noexcept;

}  // namespace retain::cuda
