#include "kernels/cuda/check.h"
#include "kernels/cuda/memory.h"

namespace retain::cuda {

void* device_alloc(size_t bytes) {
  void* p = nullptr;
  if (bytes == 0) return nullptr;
  CUDA_CHECK(cudaMalloc(&p, bytes));
  return p;
}

void device_free(void* p) noexcept {
  if (p) cudaFree(p);  // errors at teardown are not actionable
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

}  // namespace retain::cuda
