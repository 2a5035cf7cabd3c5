// Context parallelism (issue 39): one sequence split over the N ranks of a group, each rank
// holding T/N of its tokens through every layer, the ops that pair tokens across ranks done as
// a ring. What crosses ranks is only what pairs tokens: gated attention (keys, values and logβ
// of the other chunks pass around the ring, partial results merged by their log-sum-exp) and
// the capacity sums (logβ passes around); everything per token stays local.
//
// Layout (Megatron's load balancing for causal attention): the sequence is cut into 2N chunks
// and rank r holds chunk r (its front) and chunk 2N − 1 − r (its back), in that order, so that
// every rank has about the same share of the causal pairs. T need not divide by 2N: chunk c is
// [⌊c·T/2N⌋, ⌊(c+1)·T/2N⌋). Token indices are global: the decay (t − i)·logβ_i, the causal test
// and the document ids are those of the whole sequence.
//
// Each ring op takes the group's comm and this rank's local tokens ([T_local, ...] in the
// layout's order) and is collective over the group. The ring moves O(T/N) per rank per step
// (N steps), overlapped with the local tile work: the next step's keys are in flight while this
// step's spans are computed. The CPU path is the reference (over MPI); on CUDA the same rings
// run over device buffers (keys and values BF16, partials and sums F32/F64; NCCL, or MPI staged
// through the host) with the span kernels of kernels/cuda (unverified on a GPU, emulated);
// gather_to_owners moves host tensors.
#pragma once
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/dist/comm.h"
#include "kernels/retention.h"
#include "kernels/tensor.h"
#include "model/sequence_part.h"

namespace retain::trainer {

struct TokenSpan {
  int64_t start = 0, length = 0;  // global index of the first token, and the count
  int64_t end() const { return start + length; }
};

class ContextLayout {
 public:
  // T tokens over `ranks` ranks (T ≥ 2·ranks, so that no chunk is empty).
  ContextLayout(int64_t T, int ranks);

  int64_t tokens() const { return T_; }
  int ranks() const { return ranks_; }
  // Rank r's two chunks: front (chunk r) and back (chunk 2N − 1 − r), in local order.
  std::array<TokenSpan, 2> spans(int rank) const;
  int64_t local_tokens(int rank) const;
  int64_t max_local_tokens() const;  // the ring's message size, in tokens
  // Rank r's rows of a tensor whose dimension `dim` (0 or 1) runs over the whole sequence's T
  // tokens, copied in local order (on whole's device).
  Tensor local(const Tensor& whole, int rank, int64_t dim = 0) const;
  // The inverse: rank r's local rows written into `whole` (dimension `dim` of T).
  void put_local(const Tensor& local, int rank, Tensor& whole, int64_t dim = 0) const;

 private:
  int64_t chunk_begin(int64_t c) const { return T_ * c / (2 * ranks_); }
  int64_t T_;
  int ranks_;
};

// Gated attention of this rank's queries over every key of the sequence (kernels/retention.h's
// gated_attention, split): q F32 [T_local, H, d]; k, v [T_local, K, d]; log_beta [T_local, K];
// doc I32 [T_local] (global document ids); out [T_local, H, d], lse [T_local, H] overwritten.
// Collective over `group` (its size is the layout's ranks).
void ring_gated_attention(dist::Comm& group, const ContextLayout& layout, const Tensor& q, const Tensor& k,
                          const Tensor& v, const Tensor& log_beta, const Tensor& doc, float scale, Tensor& out,
                          Tensor& lse);

// Its backward (gated_attention_backward, split): dq [T_local, H, d], dk, dv [T_local, K, d],
// dlog_beta [T_local, K] overwritten with this rank's tokens' gradients. The keys travel with
// their gradient accumulators; after N ring steps each rank holds its own keys' sums.
void ring_gated_attention_backward(dist::Comm& group, const ContextLayout& layout, const Tensor& q,
                                   const Tensor& k, const Tensor& v, const Tensor& log_beta, const Tensor& doc,
                                   float scale, const Tensor& out, const Tensor& lse, const Tensor& dout,
                                   Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dlog_beta);

// The capacity loss of this rank's tokens (capacity_loss, split): log_beta F32 [L, T_local, K],
// doc and positions I32 [T_local] (the whole sequence's document ids and positions). Returns
// this rank's part (the caller sums over the group, as over data-parallel ranks).
ops::CapacityLoss ring_capacity_loss(dist::Comm& group, const ContextLayout& layout, const Tensor& log_beta,
                                     const Tensor& doc, const Tensor& positions, double memory,
                                     ops::CapacityMode mode, double skip_exponent = ops::kExactSkipExponent);

// capacity_loss_backward, split: dlog_beta F32 [L, T_local, K] = scale · ∂(Σℓ over the whole
// sequence)/∂log_beta of this rank's tokens (overwritten).
void ring_capacity_loss_backward(dist::Comm& group, const ContextLayout& layout, const Tensor& log_beta,
                                 const Tensor& doc, const Tensor& positions, double memory, ops::CapacityMode mode,
                                 double scale, Tensor& dlog_beta, double skip_exponent = ops::kExactSkipExponent);

// The capacity sums S F32 [L, T_local, K] of this rank's tokens over every key of the sequence
// (capacity_sums, split: the retention statistics of a logged step).
Tensor ring_capacity_sums(dist::Comm& group, const ContextLayout& layout, const Tensor& log_beta, const Tensor& doc,
                          double skip_exponent = ops::kExactSkipExponent);

// KVPOP's future-attention target of this rank's keys (kernels/kvpop.h future_attention_target,
// split): q F32 [T_local, H, d], k [T_local, K, d], lse [T_local, H] (the teacher attention's),
// doc I32 [T_local]. The transposed pass: the keys stay, each rank's queries, lse and document
// ids travel the ring, and every key keeps its running log-sum-exp (F64) over them. Returns
// log_m F32 [K, T_local]. Equal to the whole-sequence target up to the order in which the
// query chunks are summed (float64 rounding, ~1e-16 relative, before the float32 result).
Tensor ring_future_attention_target(dist::Comm& group, const ContextLayout& layout, const Tensor& q, const Tensor& k,
                                    const Tensor& lse, const Tensor& doc, int64_t w, float scale);

// From sequence-sharded to item-sharded (DeepSpeed-Ulysses' switch; KVPOP's scorers run their
// recurrent mLSTM over a whole sequence, one (layer, KV head) per rank): item i of `local`
// (F32 [T_local, C_i], C_i the same on every rank) goes whole, [T, C_i] in sequence order, to
// the group rank owner[i]; the result holds those items and an empty Tensor for the others.
// Collective: N − 1 pairwise exchanges (ring shifts by distance s = 1 … N − 1), each carrying
// only what its receiver owns, so every rank receives (its items' columns)·(T − T_local) floats.
std::vector<Tensor> gather_to_owners(dist::Comm& group, const ContextLayout& layout, const std::vector<Tensor>& local,
                                     const std::vector<int>& owner);

// What the model asks of a rank's part of the sequence (model/sequence_part.h), over the ring:
// the tokens' global document positions, and ring_gated_attention (and its backward) over the
// group. Holds references: the group and the layout must outlive it.
class ContextPart final : public SequencePart {
 public:
  ContextPart(dist::Comm& group, const ContextLayout& layout, Tensor positions)
      : group_(group), layout_(layout), positions_(std::move(positions)) {}
  const Tensor& positions() const override { return positions_; }
  void gated_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& log_beta, const Tensor& doc,
                       float scale, Tensor& out, Tensor& lse) const override {
    ring_gated_attention(group_, layout_, q, k, v, log_beta, doc, scale, out, lse);
  }
  void gated_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& log_beta,
                                const Tensor& doc, float scale, const Tensor& out, const Tensor& lse,
                                const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                                Tensor& dlog_beta) const override {
    ring_gated_attention_backward(group_, layout_, q, k, v, log_beta, doc, scale, out, lse, dout, dq, dk, dv,
                                  dlog_beta);
  }
  Tensor future_attention_target(const Tensor& q, const Tensor& k, const Tensor& lse, const Tensor& doc, int64_t w,
                                 float scale) const override {
    return ring_future_attention_target(group_, layout_, q, k, lse, doc, w, scale);
  }

 private:
  dist::Comm& group_;
  const ContextLayout& layout_;
  Tensor positions_;
};

}  // namespace retain::trainer
