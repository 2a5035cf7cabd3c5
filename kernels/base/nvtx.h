// NVTX ranges around the phases of a step, so that `nsys profile` shows the teacher, the
// student, the loss, the backward and the optimizer as named spans on the timeline. NVTX is
// header-only and costs a few nanoseconds when no profiler is attached; builds without the
// CUDA toolkit (RETAIN_NVTX undefined) compile the ranges away.
#pragma once

#ifdef RETAIN_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

namespace retain {

class NvtxRange {
 public:
  explicit NvtxRange([[maybe_unused]] const char* name) {
#ifdef RETAIN_NVTX
    nvtxRangePushA(name);
#endif
  }
  ~NvtxRange() {
#ifdef RETAIN_NVTX
    nvtxRangePop();
#endif
  }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace retain
