// merge_attention on the device (kernels/retention_spans.h; the CPU reference is
// kernels/cpu/gated_attention.cpp's merge_attention): context parallelism's forward adds each
// visiting chunk's partial attention (out, lse) to a row's running one by their log-sum-exp.
// The same float64 arithmetic as the reference, one warp per (row, head): its lanes read the
// two lse first, then each scales its share of the d values; lane 0 writes the new lse after
// the warp's reads (__syncwarp), so no lane sees a half-updated row. Unverified on a GPU
// (emulated: tests/cuda/test_attention_span_cuda.cpp).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/check.h"
#include "kernels/cuda/retention_cuda.h"

namespace retain::cuda {

namespace {

__global__ void merge_attention_kernel(float* out, float* lse, const float* part_out, const float* part_lse,
                                       int64_t rows, int64_t d) {
  const int64_t x = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (x >= rows) return;  // whole warps leave together (x is warp-uniform)
  const float a = lse[x], b = part_lse[x];
  if (b == -INFINITY) return;  // the part has no allowed key for this row
  float* o = out + x * d;
  const float* po = part_out + x * d;
  if (a == -INFINITY) {  // the first part with a key: taken as it is
    for (int64_t j = lane; j < d; j += 32) o[j] = po[j];
  } else {
    // out·e^{lse} is the row's unnormalized sum: the merged row is their sum over e^{lse'}.
    const double m = a > b ? a : b;
    const double total = m + log(exp(a - m) + exp(b - m));
    const double wa = exp(a - total), wb = exp(b - total);
    for (int64_t j = lane; j < d; j += 32) o[j] = static_cast<float>(wa * o[j] + wb * po[j]);
    __syncwarp();
    if (lane == 0) lse[x] = static_cast<float>(total);
    return;
  }
  __syncwarp();
  if (lane == 0) lse[x] = b;
}

}  // namespace

void merge_attention(Tensor& out, Tensor& lse, const Tensor& part_out, const Tensor& part_lse) {
  const int64_t rows = lse.numel();
  if (rows == 0) return;
  const int64_t d = out.numel() / rows;
  const int warps = 8;
  merge_attention_kernel<<<static_cast<unsigned>((rows + warps - 1) / warps), 32 * warps>>>(
      out.data<float>(), lse.data<float>(), part_out.data<float>(), part_lse.data<float>(), rows, d);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace retain::cuda
