// Shared by the ops' dispatch (kernels/ops.cpp, kernels/retention.cpp).
#pragma once
#include <initializer_list>

#include "kernels/tensor.h"

namespace retain::ops {

// Every op has a CPU reference; CUDA kernels arrive op by op. Until an op has one, asking for
// it on a CUDA tensor is a clear error rather than a silent host copy.
inline void require_cpu(const char* op, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->device() != Device::CPU) fail("{}: no CUDA implementation of this op yet", op);
}

}  // namespace retain::ops
