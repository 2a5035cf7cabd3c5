// CPU reference implementations behind kernels/retention.h (shapes, dtypes and log_beta
// values already checked by kernels/retention.cpp), and the block bookkeeping they share.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/retention.h"
#include "kernels/tensor.h"

namespace retain::cpu {

// e^x in float32: std::exp(x), except that a result below the smallest normal float (x below
// ln 2^-126 ≈ −87.3365) is 0. Trained gates put many scores and decay exponents there, and both
// tails are slow on the CPU: glibc reaches 0 (x < −104) through a branch that sets errno, and
// arithmetic on subnormal results is microcoded. Measured with retain-bench attention --logbeta
// trained-like (T 8192, 8 heads): the backward 25% and the capacity loss 2.8× slower without
// this. A dropped term is < 1.2e-38, far below the e^-60 the capacity tile skip already drops
// and below float rounding of any sum it joins. NaN and +inf go to std::exp; −inf gives 0.
inline float exp_or_zero(float x) { return x < -87.33654f ? 0.0f : std::exp(x); }

// Both ops tile the T×T pair space into kRetentionBlock × kRetentionBlock tiles (queries ×
// keys). 64 keeps a tile's scores (16 KiB) and a key block's k/v (2·64·d floats) in L1/L2.
inline constexpr int64_t kRetentionBlock = 64;

// The document ids that occur among the non-padding tokens of one block, as [lo, hi].
// Two blocks can hold an allowed pair only if their ranges intersect: allowed needs
// doc[i] == doc[t] >= 0, and equal ids lie in both ranges. This holds for any document
// layout (contiguous runs or not); the per-pair mask inside a tile does the rest.
struct DocRange {
  int32_t lo = std::numeric_limits<int32_t>::max();
  int32_t hi = std::numeric_limits<int32_t>::min();
  bool padded = false;  // some token of the block is padding (or the block is short)
  bool empty() const { return lo > hi; }
  // Every token of the block belongs to one document.
  bool single() const { return !padded && lo == hi; }
};

inline std::vector<DocRange> block_doc_ranges(const int32_t* doc, int64_t T) {
  std::vector<DocRange> ranges(static_cast<size_t>((T + kRetentionBlock - 1) / kRetentionBlock));
  if (T % kRetentionBlock != 0) ranges.back().padded = true;
  for (int64_t t = 0; t < T; ++t) {
    DocRange& r = ranges[static_cast<size_t>(t / kRetentionBlock)];
    if (doc[t] < 0) {
      r.padded = true;
      continue;
    }
    r.lo = std::min(r.lo, doc[t]);
    r.hi = std::max(r.hi, doc[t]);
  }
  return ranges;
}

inline bool blocks_may_meet(const DocRange& a, const DocRange& b) {
  return !a.empty() && !b.empty() && a.lo <= b.hi && b.lo <= a.hi;
}

// Every pair of tile (query block qb, key block kb) is allowed: the key block lies wholly
// below the diagonal and both blocks are full blocks of the same single document.
inline bool tile_all_allowed(const std::vector<DocRange>& ranges, int64_t qb, int64_t kb) {
  const DocRange &q = ranges[static_cast<size_t>(qb)], &k = ranges[static_cast<size_t>(kb)];
  return kb < qb && q.single() && k.single() && q.lo == k.lo;
}

void gated_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& log_beta,
                     const Tensor& doc, float scale, Tensor& out, Tensor& lse);
void gated_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& log_beta, const Tensor& doc, float scale,
                              const Tensor& out, const Tensor& lse, const Tensor& dout,
                              Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dlog_beta);

void gated_attention_span(const Tensor& q, const Tensor& q_doc, int64_t q_start, const Tensor& k, const Tensor& v,
                          const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, float scale, Tensor& out,
                          Tensor& lse);
void merge_attention(Tensor& out, Tensor& lse, const Tensor& part_out, const Tensor& part_lse);
void gated_attention_span_backward(const Tensor& q, const Tensor& q_doc, int64_t q_start, const Tensor& k,
                                   const Tensor& v, const Tensor& log_beta, const Tensor& k_doc, int64_t k_start,
                                   float scale, const Tensor& out, const Tensor& lse, const Tensor& dout, Tensor& dq,
                                   Tensor& dk, Tensor& dv, Tensor& dlog_beta);

void capacity_sums(const Tensor& log_beta, const Tensor& doc, Tensor& S, double skip_exponent);
ops::CapacityLoss capacity_loss(const Tensor& log_beta, const Tensor& doc, const Tensor& positions,
                                double memory, ops::CapacityMode mode, double skip_exponent);
void capacity_loss_backward(const Tensor& log_beta, const Tensor& doc, const Tensor& positions,
                            double memory, ops::CapacityMode mode, double scale, Tensor& dlog_beta,
                            double skip_exponent);
void capacity_sums_span(const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, const Tensor& q_doc,
                        int64_t q_start, Tensor& S, double skip_exponent);
void capacity_grad_span(const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, const Tensor& q_doc,
                        int64_t q_start, const Tensor& g, Tensor& dlog_beta, double skip_exponent);
ops::CapacityLoss capacity_hinge(const Tensor& S, const Tensor& doc, const Tensor& positions, double memory,
                                 ops::CapacityMode mode, Tensor* g);

}  // namespace retain::cpu
