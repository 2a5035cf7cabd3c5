// The student (retention-gated Qwen3) for training: a forward that keeps only activation
// checkpoints (each layer's input), and the backward from ∂loss/∂hidden and ∂loss/∂logβ to
// the gate parameters, recomputing one layer at a time (DESIGN §3/§4). The Qwen3 weights
// are frozen: only activation gradients flow through them; the gates get parameter grads.
#pragma once
#include <vector>

#include "kernels/tensor.h"
#include "model/gates/gates.h"
#include "model/sequence_part.h"
#include "model/weights.h"

namespace retain {

// What the student's backward needs: activation checkpoints only.
struct StudentPass {
  Tensor ids, doc, positions;        // I32 [T]; positions = ops::document_positions(doc)
  std::vector<Tensor> layer_inputs;  // x_l [T, D], l = 0..L-1 (the residual stream entering layer l):
                                     // F32 on the CPU, BF16 on CUDA (the backward recomputes from it)
  Tensor final_input;                // x_L F32 [T, D] (before the final RMSNorm)
  Tensor hidden;                     // final-RMSNorm output F32 [T, D]
  Tensor log_beta;                   // F32 [L, T, K]: every layer's gate output
  const SequencePart* part = nullptr;  // set when ids are a part of a longer sequence (it must outlive the pass)
};

// Student forward (gated attention), asking `weights` for layers 0..L-1 in order. `hidden`
// equals qwen3_hidden(weights, ids, doc_ids, {}, &gates, part) bit for bit. With `part`, ids
// are this rank's part of a longer sequence (model/sequence_part.h): the forward and the
// backward are then collective over the parts.
StudentPass student_forward(WeightProvider& weights, const gates::RetentionGates& gates,
                            const Tensor& ids, const Tensor& doc_ids, const SequencePart* part = nullptr);

// Backward. d_hidden F32 [T, D] = ∂loss/∂hidden; d_log_beta F32 [L, T, K] = the extra ∂loss/∂logβ
// (the capacity loss), or an empty Tensor (numel 0, e.g. default-constructed) for none. Asks
// `weights` for the final norm, then layers L-1..0 (in that order; recomputing each layer's
// forward from pass.layer_inputs[l]) and ADDS ∂loss/∂θ into gates' parameter grads
// (RetentionGates::backward; a shared dbtrimkv tensor gets the sum over layers). Frozen
// weights get no grads. Holds one layer's intermediates at a time besides the checkpoints.
void student_backward(WeightProvider& weights, gates::RetentionGates& gates, const StudentPass& pass,
                      const Tensor& d_hidden, const Tensor& d_log_beta);

}  // namespace retain
