// The retention ops of kernels/retention.h on spans of a longer sequence: what context
// parallelism (issue 39; trainer/context_parallel.h) composes when one rank holds some chunks
// of a sequence and sees the other chunks' keys in turn. A span is a run of consecutive tokens;
// `*_start` is the global index of its first token, so that the decay (t − i)·logβ_i and the
// causal test i ≤ t use the global indices while each span brings its own document ids.
// Called with q_start = k_start = 0 on the same tokens they are the whole-sequence ops.
//
// Devices: the attention ops (gated_attention_span, merge_attention, _span_backward) run on
// the CPU (F32) and on CUDA (kernels/cuda/retention_cuda.h: q, k, v, dout BF16, the rest F32;
// the keys the queries' own span or one wholly before or after them; unverified on a GPU,
// emulated), and so do the capacity ops (the same three kinds of pairs; S, g, dlog_beta F64).
#pragma once
#include <cstdint>

#include "kernels/retention.h"
#include "kernels/tensor.h"

namespace retain::ops {

// gated_attention of queries q [Tq, H, d] (doc ids q_doc [Tq], first global index q_start)
// over the keys k, v [Tk, K, d], log_beta [Tk, K] (k_doc [Tk], first index k_start) alone:
// out [Tq, H, d] and lse [Tq, H] as gated_attention's, restricted to these keys (a row with
// no allowed key among them: out 0, lse −inf). Merge the parts of a row with merge_attention.
// q_start + Tq and k_start + Tk must be below 2^24.
void gated_attention_span(const Tensor& q, const Tensor& q_doc, int64_t q_start, const Tensor& k, const Tensor& v,
                          const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, float scale, Tensor& out,
                          Tensor& lse);

// (out, lse) ← the attention over both key sets, given each one's (out, lse): by log-sum-exp,
// in float64. F32 [R, H, d] and [R, H]; a part with lse −inf adds nothing.
void merge_attention(Tensor& out, Tensor& lse, const Tensor& part_out, const Tensor& part_lse);

// The gradients through the span pair's share of the attention, ADDED to dq [Tq, H, d] and to
// dk, dv [Tk, K, d], dlog_beta [Tk, K]. out, lse are the rows' final (merged) forward results
// and dout their gradient: the probabilities are exp(s − lse) of the whole row, so the parts'
// gradients sum to gated_attention_backward's.
void gated_attention_span_backward(const Tensor& q, const Tensor& q_doc, int64_t q_start, const Tensor& k,
                                   const Tensor& v, const Tensor& log_beta, const Tensor& k_doc, int64_t k_start,
                                   float scale, const Tensor& out, const Tensor& lse, const Tensor& dout, Tensor& dq,
                                   Tensor& dk, Tensor& dv, Tensor& dlog_beta);

// S F64 [L, Tq, K] += the capacity-sum terms of the key span's tokens (log_beta F32 [L, Tk, K],
// k_doc [Tk], from k_start) for the query span's rows (q_doc [Tq], from q_start): Σ_{allowed i}
// exp((t − i)·logβ[l, i, κ]), the i = t term 1. Summed over every key span from an S of zeros,
// S is capacity_sums' (in float64, before its rounding to float32). skip_exponent as there.
void capacity_sums_span(const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, const Tensor& q_doc,
                        int64_t q_start, Tensor& S, double skip_exponent = kExactSkipExponent);

// The capacity hinge of capacity_loss from the rows' sums S F64 [L, T, K] (all of the rows'
// key spans added), doc and positions I32 [T]; with g, also g F64 [L, T, K] = ∂(Σℓ)/∂S.
CapacityLoss capacity_hinge(const Tensor& S, const Tensor& doc, const Tensor& positions, double memory,
                            CapacityMode mode, Tensor* g = nullptr);

// dlog_beta F64 [L, Tk, K] += Σ_{allowed t of the query span} g[l, t, κ]·(t − i)·exp((t − i)·logβ[l, i, κ])
// for the key span's tokens i, with g F64 [L, Tq, K] from capacity_hinge (times the caller's
// scale). Summed over every query span, scale·it is capacity_loss_backward's dlog_beta.
void capacity_grad_span(const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, const Tensor& q_doc,
                        int64_t q_start, const Tensor& g, Tensor& dlog_beta,
                        double skip_exponent = kExactSkipExponent);

}  // namespace retain::ops
