// The Qwen3 graph (DESIGN §3), composed from kernels/ops.h. The graph asks a
// WeightProvider for each layer and knows nothing about ranks or files. With retention
// gates it is the student of DESIGN §4: each layer's attention is retention-gated by
// logβ = gate_l(h), h the input-RMSNorm output.
#pragma once
#include <functional>

#include "kernels/tensor.h"
#include "model/gates/gates.h"
#include "model/weights.h"

namespace retain {

// Logits F32 [T, V] for token ids I32 [T] with per-token document ids I32 [T]
// (attention stays inside a document and RoPE positions restart per document; a token
// with doc id < 0 is padding). Float32 throughout. `on_layer(done, total)`, if given, is
// called after each decoder layer (progress reporting). With `gates` (whose layers, hidden
// size and KV heads must match the model), attention is ops::gated_attention with the
// layer's logβ: the student; without, plain attention: the teacher.
using LayerProgress = std::function<void(int64_t done, int64_t total)>;
Tensor qwen3_forward(WeightProvider& weights, const Tensor& ids, const Tensor& doc_ids,
                     const LayerProgress& on_layer = {}, const gates::RetentionGates* gates = nullptr);

}  // namespace retain
