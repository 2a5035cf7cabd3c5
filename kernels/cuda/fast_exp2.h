// 2^x in one MUFU.EX2 for the kernels' hot loops (gated attention's probabilities, the capacity
// sums' decay terms). exp2f/expf without fast math wrap the same MUFU in range handling (four
// to eight instructions per call, kernels/cuda/sass_report.py); here results below the smallest
// normal float are flushed to 0 (ex2.approx.ftz), which none of those sums can tell from a
// subnormal. The host (tests, the CUDA emulator) flushes the same way. __host__ __device__.
#pragma once
#include <math.h>

#include "kernels/cuda/host_device.h"  // RETAIN_HD

namespace retain::cuda {

inline constexpr float kLog2e = 1.4426950408889634f;

RETAIN_HD float exp2_ftz(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  const float y = exp2f(x);
  return y < 1.17549435e-38f ? 0.0f : y;  // FLT_MIN
#endif
}

}  // namespace retain::cuda
