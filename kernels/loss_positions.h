// The loss positions of one call of ops::kl_ntp_chunked (kernels/loss.h), listed on the host in
// order with the target id of each (checked to lie in the vocabulary), for both devices' loops.
#pragma once
#include <cstdint>
#include <vector>

namespace retain::ops {

struct LossPositions {
  std::vector<int64_t> pos;
  std::vector<int32_t> target;
};

}  // namespace retain::ops
