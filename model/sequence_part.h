// A rank's part of a longer sequence (context parallelism, issue 39). The model knows nothing
// of ranks (DESIGN §2): it runs on the tokens it is given, and when those are only part of the
// sequence it asks a SequencePart for what reaches beyond them — the tokens' document
// positions in the whole sequence (RoPE), attention over the keys of every part, and KVPOP's
// future-attention target over the queries of every part.
// One rank holding the whole sequence passes none. The trainer's implementation passes keys
// around its context-parallel group (trainer/context_parallel.h).
#pragma once
#include <cstdint>

#include "kernels/tensor.h"

namespace retain {

class SequencePart {
 public:
  virtual ~SequencePart() = default;

  // The document positions I32 [T_local] of this rank's tokens in the whole sequence, on the
  // device the model runs on (what ops::document_positions gives for the whole sequence).
  virtual const Tensor& positions() const = 0;

  // kernels/retention.h's gated_attention and its backward for this rank's tokens over every key
  // of the sequence (collective over the ranks that hold the other parts). log_beta ≡ 0 is the
  // teacher's plain attention.
  virtual void gated_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& log_beta,
                               const Tensor& doc, float scale, Tensor& out, Tensor& lse) const = 0;
  virtual void gated_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& log_beta,
                                        const Tensor& doc, float scale, const Tensor& out, const Tensor& lse,
                                        const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                                        Tensor& dlog_beta) const = 0;

  // kernels/kvpop.h's future_attention_target for this rank's keys over the queries of every
  // part (each with its lse): log_m F32 [K, T_local]. Collective, like the attention.
  virtual Tensor future_attention_target(const Tensor& q, const Tensor& k, const Tensor& lse, const Tensor& doc,
                                         int64_t w, float scale) const = 0;

 protected:
  SequencePart() = default;
  SequencePart(const SequencePart&) = default;
  SequencePart& operator=(const SequencePart&) = default;
};

}  // namespace retain
