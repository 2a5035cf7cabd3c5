// The Qwen3 graph (DESIGN §3), composed from kernels/ops.h. The graph asks a
// WeightProvider for each layer and knows nothing about ranks or files. With retention
// gates it is the student of DESIGN §4: each layer's attention is retention-gated by
// logβ = gate_l(h), h the input-RMSNorm output.
#pragma once
#include <functional>

#include "kernels/tensor.h"
#include "model/gates/gates.h"
#include "model/rope_params.h"
#include "model/sequence_part.h"
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

// The final-RMSNorm output F32 [T, D] (what lm_head multiplies): the teacher keeps only this.
// qwen3_forward is ops::linear(qwen3_hidden(...), lm_head), bit for bit.
// With `part`, ids and doc_ids are this rank's part of a longer sequence (model/sequence_part.h):
// its positions and attention come from there, and the call is collective over the parts.
Tensor qwen3_hidden(WeightProvider& weights, const Tensor& ids, const Tensor& doc_ids,
                    const LayerProgress& on_layer = {}, const gates::RetentionGates* gates = nullptr,
                    const SequencePart* part = nullptr);

// ---- Building blocks shared with the student's backward (model/student.cpp) -------------

// ops::document_positions for doc on any device (formed on the host: T int32s), on doc's device.
Tensor positions_of(const Tensor& doc);

// Fails (one line) unless gates of `dims` fit a model of `config` (layers, hidden size, KV heads).
void check_gates_fit(const Qwen3Config& config, const gates::GateDims& dims);

// What one decoder layer's backward needs, beyond its input x: kept by qwen3_decoder_layer
// when asked (the student's backward recomputes one layer at a time from its checkpoint).
struct DecoderLayerSaved {
  Tensor q_raw, k_raw;           // projections before the per-head norm, [T, H·d], [T, K·d]
  Tensor q, k, v;                // attention inputs: q, k normed and rotated, [T, H, d], [T, K, d], [T, K, d]
                                 // (F32 on the CPU; BF16 on CUDA, what its attention kernels read)
  Tensor log_beta;               // gate output F32 [T, K] (gated layers only)
  gates::GateActivations gate;   // gate pre-activations (gated layers only)
  Tensor gate_input;             // what the gate read: h, or [k ‖ v] F32 [T, 2·K·d] (gated layers only)
  Tensor attn, lse;              // attention output [T, H, d] (dtype as q) and its log-sum-exp F32 [T, H]
                                 // (gated only)
  Tensor x_mid;                  // residual stream after attention F32 [T, D] (the post-norm input)
  // Set by the caller: stop after the attention block (x comes out as x_mid, and x_mid shares
  // x's storage: no copy of the residual stream, so the caller must not write x). The student's
  // backward does, and recomputes the MLP from x_mid chunk by chunk: its intermediates are
  // never held for the whole sequence.
  bool attention_only = false;
};

// Tokens per MLP chunk (forward and the student's backward): bounds the [tokens, I] buffers
// (8192 × 9728 F32 = 318 MB for Qwen3-4B) whatever the sequence length.
inline constexpr int64_t kMlpChunkTokens = 8192;

// The MLP chunk in use: kMlpChunkTokens unless set_mlp_chunk_tokens changed it. The chunk loop
// is the same whatever the value; the tools never change it, tests do (a chunk of 64 runs the
// multi-chunk loop, with a partial last chunk, at a few hundred tokens).
int64_t mlp_chunk_tokens();
// Sets the MLP chunk for the whole process (tokens ≥ 1) and returns the previous value.
int64_t set_mlp_chunk_tokens(int64_t tokens);

// The layer's MLP block in place on the residual stream x F32 [T, D]:
// x += down(silu(gate(h))·up(h)), h = post_norm(x), mlp_chunk_tokens() tokens at a time (its
// [tokens, I] intermediates would be the largest buffers of a long sequence: 128K × 9728 F32 is
// 5 GB each). Shared by qwen3_decoder_layer and the bounded-cache decoder (model/infer).
void qwen3_mlp(const Qwen3Config& config, const LayerWeights& w, Tensor& x);

// Decoder layer `layer`, in place on the residual stream x F32 [T, D]; retention-gated when
// `gates`. positions = ops::document_positions(doc). Runs on x's device: the weights,
// positions, doc (and the gates' mirror) must be there too; on CUDA, attention rounds q, k, v
// to bf16. With `log_beta_out` (F32 [T, K], gated only) the gate output is copied there; with
// `saved`, the intermediates above are kept.
// Neither changes the result: x comes out bit-identical either way (unless
// saved->attention_only, which stops at x_mid). With `part`, x holds a part of a longer sequence
// and the attention is part->gated_attention (positions: part->positions()).
void qwen3_decoder_layer(const Qwen3Config& config, const LayerWeights& w, const RopeParams& rope,
                         const Tensor& positions, const Tensor& doc, const gates::RetentionGates* gates,
                         int64_t layer, Tensor& x, Tensor* log_beta_out = nullptr,
                         DecoderLayerSaved* saved = nullptr, const SequencePart* part = nullptr);

}  // namespace retain
