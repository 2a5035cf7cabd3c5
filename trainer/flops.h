// The floating-point work of one training step, counted from the shapes (not measured), and
// the peak it is compared with for MFU. Convention (stated in every report that uses it):
// a multiply-add is 2 FLOPs; matmuls only (norms, RoPE, softmax and elementwise work are not
// counted); attention counts the pairs it computes exactly: Σ over documents n(n+1)/2 per head.
//   forward of a layer      2·D·(H·d + 2·K·d) + 2·H·d·D + 6·D·I per token  (projections + MLP)
//                           + 4·d·H per attention pair                      (q·k and p·v)
//   gate forward            2·(D·G + G·K) per token (dbtrimkv: + 2·G·G)
//   activation-only bwd     the projections' and MLP's forward again (input gradients only, the
//                           weights are frozen); attention 2.5× its forward (FlashAttention's
//                           five matmuls: S, dP, dV, dQ, dK); the gate twice its forward (dx, dW)
//   loss                    2·D·V per loss position each for the teacher logits, the student
//                           logits and the hidden-state gradient
// A step is: teacher forward + student forward (+ gate) + recompute (the student forward again,
// layer by layer, for the backward) + backward + loss, and with gradient accumulation one more
// student forward per micro-batch (the capacity count, trainer/step.h).
#pragma once
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "model/config.h"
#include "model/gates/gates.h"

namespace retain::trainer {

struct StepFlops {
  double teacher = 0, student = 0, recompute = 0, backward = 0, loss = 0, count_pass = 0;
  double total() const { return teacher + student + recompute + backward + loss + count_pass; }
};

// One micro-batch: its tokens (non-padding), documents' lengths and loss positions.
struct MicroBatchShape {
  std::vector<int64_t> doc_lengths;
  int64_t loss_positions = 0;
};

// The FLOPs of compute_gradients over `micro_batches` on one rank.
StepFlops step_flops(const Qwen3Config& model, const gates::GateDims& gates,
                     const std::vector<MicroBatchShape>& micro_batches);

// Dense bf16 tensor-core peak in TFLOP/s (fp32 accumulation, no sparsity) of a GPU named as
// the driver names it, from NVIDIA's datasheets; nullopt for any GPU not in the table (MFU is
// then reported as n/a rather than against a guessed peak).
std::optional<double> bf16_peak_tflops(std::string_view device_name);

}  // namespace retain::trainer
