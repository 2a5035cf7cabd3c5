// NVTX ranges around the phases of a step, so that `nsys profile` shows the teacher, the
// student, the loss, the backward and the optimizer as named spans on the timeline. NVTX is
// header-only and costs a few nanoseconds when no profiler is attached; builds without the
// CUDA toolkit (RETAIN_NVTX undefined) compile the ranges away.
#pragma once
#include <cstdint>

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

// A range opened and closed by different calls (nvtxRangeStart/End: process-wide, so it need not
// nest with the caller's push/pop scopes): a weight provider's "layer l", from layer(l) to the
// next request. start() closes the open one first; the destructor closes it too.
class NvtxSpan {
 public:
  NvtxSpan() = default;
  NvtxSpan(const NvtxSpan&) = delete;
  NvtxSpan& operator=(const NvtxSpan&) = delete;
  ~NvtxSpan() { end(); }
  void start([[maybe_unused]] const char* name) {
    end();
#ifdef RETAIN_NVTX
    id_ = nvtxRangeStartA(name);
#endif
  }
  void end() {
#ifdef RETAIN_NVTX
    if (id_ != 0) nvtxRangeEnd(id_);
#endif
    id_ = 0;
  }

 private:
  uint64_t id_ = 0;  // nvtxRangeId_t; 0: none open
};

}  // namespace retain
