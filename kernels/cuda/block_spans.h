// Per-block spans of the blocks that may share a document with it, in O(log nb) per block
// instead of a walk over every block: the tile tables of the gated attention and capacity
// kernels (one CTA per query or key block looks its span up instead of scanning from 0 or
// to the end). Plain C++ (RETAIN_HD): tests/cuda/test_block_spans.cpp checks it on the CPU.
//
// A block's document range is [lo, hi] over its non-padding tokens (empty: lo = INT32_MAX,
// hi = INT32_MIN). Two blocks can hold a pair of one document only if their ranges meet:
// lo_q ≤ hi_k and lo_k ≤ hi_q. So, for a query block q, any such key block k satisfies
// hi_k ≥ lo_q, and with HiMax[b] = max_{b' ≤ b} hi_{b'} (nondecreasing) the first block whose
// HiMax reaches lo_q is a lower bound on k (HiMax first reaches x exactly at the first block
// whose own hi does). Likewise, for a key block k, any such query block q satisfies
// lo_q ≤ hi_k, and with LoMin[b] = min_{b' ≥ b} lo_{b'} (nondecreasing) the last block whose
// LoMin is ≤ hi_k is an upper bound on q. This holds for any layout of documents; when ids
// only grow along the sequence (packed documents, padding anywhere) the span holds exactly the
// blocks that meet, plus all-padding blocks, so a CTA's walk visits nothing it need not.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cuda/host_device.h"  // RETAIN_HD

namespace retain::cuda::spans {

// Key blocks [key_begin, q] for query block q; query blocks [k, query_end) for key block k.
struct BlockSpan {
  int32_t key_begin;  // q + 1 when block q holds no document (nothing to visit)
  int32_t query_end;  // k when block k holds no document
};

// The first b in [0, q] with hi_max[b] ≥ lo_q (hi_max nondecreasing), or q + 1 when none.
// Table: anything indexable by int32_t (a pointer, or the device's view of a scan result).
template <typename Table>
RETAIN_HD int32_t first_reaching(const Table& hi_max, int32_t q, int32_t lo_q) {
  int32_t a = 0, b = q + 1;  // the answer lies in [a, b]
  while (a < b) {
    const int32_t mid = a + (b - a) / 2;
    if (hi_max[mid] >= lo_q)
      b = mid;
    else
      a = mid + 1;
  }
  return a;
}

// One past the last b in [k, nb) with lo_min[b] ≤ hi_k (lo_min nondecreasing), or k when none.
template <typename Table>
RETAIN_HD int32_t end_reaching(const Table& lo_min, int32_t nb, int32_t k, int32_t hi_k) {
  int32_t a = k, b = nb;  // the answer lies in [a, b]
  while (a < b) {
    const int32_t mid = a + (b - a) / 2;
    if (lo_min[mid] <= hi_k)
      a = mid + 1;
    else
      b = mid;
  }
  return a;
}

// Block b's span; a block without documents (lo > hi) gets empty spans.
template <typename HiMax, typename LoMin>
RETAIN_HD BlockSpan block_span(const HiMax& hi_max, const LoMin& lo_min, int32_t nb, int32_t b, int32_t lo_b,
                               int32_t hi_b) {
  if (lo_b > hi_b) return {b + 1, b};
  return {first_reaching(hi_max, b, lo_b), end_reaching(lo_min, nb, b, hi_b)};
}

// The CPU form of the whole table (what the device computes with two scans and one lookup per
// block): lo[b·stride], hi[b·stride] are block b's range. Used by the tests and emulations.
inline std::vector<BlockSpan> host_block_spans(const int32_t* lo, const int32_t* hi, int64_t stride, int32_t nb) {
  std::vector<int32_t> hi_max(static_cast<size_t>(nb)), lo_min(static_cast<size_t>(nb));
  for (int32_t b = 0, run = INT32_MIN; b < nb; ++b) hi_max[static_cast<size_t>(b)] = run = std::max(run, hi[b * stride]);
  for (int32_t b = nb - 1, run = INT32_MAX; b >= 0; --b)
    lo_min[static_cast<size_t>(b)] = run = std::min(run, lo[b * stride]);
  std::vector<BlockSpan> out;
  for (int32_t b = 0; b < nb; ++b)
    out.push_back(block_span(hi_max.data(), lo_min.data(), nb, b, lo[b * stride], hi[b * stride]));
  return out;
}

}  // namespace retain::cuda::spans
