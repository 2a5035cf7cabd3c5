// The optimizer's view of a parameter set (retention gates or kvpop scorers): every trainable
// scalar in one flat F32 vector, in parameters() order (for gates: layer by layer, then
// dbtrimkv's shared tensors, each once), each tensor row-major. The trainer flattens gradients
// to reduce-scatter them, runs AdamW on its shard and unflattens the all-gathered values back.
#pragma once
#include <cstdint>

#include "model/param_set.h"

namespace retain::trainer {

// Total scalars over gates.parameters() (shared ones once), in parameters() order.
int64_t flat_size(const ParameterSet& gates);
// out[flat_size(gates)] = the parameter values / their gradients, concatenated.
void flatten_values(const ParameterSet& gates, float* out);
void flatten_grads(const ParameterSet& gates, float* out);
// The inverses: in[flat_size(gates)] into the parameter values / their gradients.
void unflatten_values(ParameterSet& gates, const float* in);
void unflatten_grads(ParameterSet& gates, const float* in);

}  // namespace retain::trainer
