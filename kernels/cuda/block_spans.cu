// Device form of the block-span table (kernels/cuda/block_spans.h): one max-scan over the
// pairs (hi_b, −lo_{nb−1−b}) gives both nondecreasing tables at once (max of hi from the
// front, min of lo from the back as a max of negatives over the reversed sequence), then one
// thread per block binary-searches them. O(nb log nb) work, a few microseconds at nb = 2048.
#include <cub/device/device_scan.cuh>

#include "kernels/cuda/block_spans_cuda.h"
#include "kernels/cuda/check.h"
#include "kernels/tensor.h"

namespace retain::cuda::spans {

namespace {

constexpr int kThreads = 256;

struct MaxBoth {
  __device__ int2 operator()(const int2& a, const int2& b) const { return make_int2(max(a.x, b.x), max(a.y, b.y)); }
};

// The scan's two tables read in place: hi_max[b] = x of element b; lo_min[b] = −y of
// element nb − 1 − b (lo ≥ 0 or INT32_MAX, so the negation never overflows).
struct HiMaxView {
  const int2* s;
  __device__ int32_t operator[](int32_t b) const { return s[b].x; }
};
struct LoMinView {
  const int2* s;
  int32_t nb;
  __device__ int32_t operator[](int32_t b) const { return -s[nb - 1 - b].y; }
};

__global__ void gather_kernel(const int32_t* lo, const int32_t* hi, int64_t stride, int32_t nb, int2* keys) {
  const int32_t b = static_cast<int32_t>(blockIdx.x) * kThreads + static_cast<int32_t>(threadIdx.x);
  if (b < nb) keys[b] = make_int2(hi[b * stride], -lo[(nb - 1 - b) * stride]);
}

__global__ void span_kernel(const int32_t* lo, const int32_t* hi, int64_t stride, int32_t nb, const int2* scanned,
                            BlockSpan* out) {
  const int32_t b = static_cast<int32_t>(blockIdx.x) * kThreads + static_cast<int32_t>(threadIdx.x);
  if (b < nb) out[b] = block_span(HiMaxView{scanned}, LoMinView{scanned, nb}, nb, b, lo[b * stride], hi[b * stride]);
}

}  // namespace

void device_block_spans(const int32_t* lo, const int32_t* hi, int64_t stride, int32_t nb, BlockSpan* out) {
  if (nb <= 0) return;
  const unsigned grid = static_cast<unsigned>((nb + kThreads - 1) / kThreads);
  static_assert(sizeof(int2) == 2 * sizeof(int32_t));
  Tensor keys = Tensor::empty({nb, 2}, DType::I32, Device::CUDA);
  Tensor scanned = Tensor::empty({nb, 2}, DType::I32, Device::CUDA);
  int2* k = static_cast<int2*>(keys.raw());
  int2* s = static_cast<int2*>(scanned.raw());
  gather_kernel<<<grid, kThreads>>>(lo, hi, stride, nb, k);
  CUDA_CHECK(cudaGetLastError());
  size_t bytes = 0;
  CUDA_CHECK(cub::DeviceScan::InclusiveScan(nullptr, bytes, k, s, MaxBoth{}, nb, cudaStreamLegacy));
  Tensor temp = Tensor::empty({static_cast<int64_t>(bytes > 0 ? bytes : 1)}, DType::U8, Device::CUDA);
  CUDA_CHECK(cub::DeviceScan::InclusiveScan(temp.raw(), bytes, k, s, MaxBoth{}, nb, cudaStreamLegacy));
  span_kernel<<<grid, kThreads>>>(lo, hi, stride, nb, s, out);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace retain::cuda::spans
