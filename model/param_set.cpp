#include "model/param_set.h"

#include <cstring>

namespace retain {

void ParameterSet::zero_grad() {
  for (Parameter& p : parameters()) std::memset(p.grad.raw(), 0, p.grad.nbytes());
}

int64_t ParameterSet::num_parameters() const {
  int64_t n = 0;
  for (const Parameter& p : parameters()) n += p.value.numel();
  return n;
}

}  // namespace retain
