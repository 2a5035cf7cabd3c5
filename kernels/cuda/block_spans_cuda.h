// The block-span table of kernels/cuda/block_spans.h computed on the device (CUDA builds).
#pragma once
#include <cstdint>

#include "kernels/cuda/block_spans.h"

namespace retain::cuda::spans {

// out[b] = block b's span (spans::host_block_spans on the device): the ranges are read at
// lo[b·stride] and hi[b·stride] (device memory, written earlier on the same stream). Two
// small kernels around one CUB scan on the legacy default stream; the host never waits.
void device_block_spans(const int32_t* lo, const int32_t* hi, int64_t stride, int32_t nb, BlockSpan* out);

}  // namespace retain::cuda::spans
