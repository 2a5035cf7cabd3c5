// The optimizer's view of the gates: every trainable scalar in one flat F32 vector, in
// gates.parameters() order (layer by layer, then dbtrimkv's shared tensors, each once), each
// tensor row-major. The trainer flattens gradients to reduce-scatter them, runs AdamW on its
// shard and unflattens the all-gathered values back into the gates.
#pragma once
#include <cstdint>

#include "model/gates/gates.h"

namespace retain::trainer {

// Total scalars over gates.parameters() (shared ones once), in parameters() order.
int64_t flat_size(const gates::RetentionGates& gates);
// out[flat_size(gates)] = the parameter values / their gradients, concatenated.
void flatten_values(const gates::RetentionGates& gates, float* out);
void flatten_grads(const gates::RetentionGates& gates, float* out);
// The inverses: in[flat_size(gates)] into the parameter values / their gradients.
void unflatten_values(gates::RetentionGates& gates, const float* in);
void unflatten_grads(gates::RetentionGates& gates, const float* in);

}  // namespace retain::trainer
