// What the CUDA span kernels (kernels/retention_spans.h's ops on the device) make of a pair of
// spans of one sequence: queries [q_start, q_start + Tq), keys [k_start, k_start + Tk). The
// rings of trainer/context_parallel.cpp pair whole chunks only, so the kernels take the three
// kinds that arise — nothing allowed (every key after every query, or a side empty), the
// queries' own tokens, a wholly earlier key span (a rectangle: every key before every query) —
// and a partial overlap is a caller's error (the CPU reference takes any pair). Host code only.
#pragma once
#include <cstdint>

#include "kernels/base/error.h"

namespace retain::cuda {

enum class SpanPair { none, self, earlier };

inline SpanPair span_pair(const char* op, int64_t q_start, int64_t Tq, int64_t k_start, int64_t Tk) {
  if (Tq == 0 || Tk == 0 || k_start >= q_start + Tq) return SpanPair::none;
  if (k_start == q_start && Tk == Tq) return SpanPair::self;
  if (k_start + Tk <= q_start) return SpanPair::earlier;
  fail("{}: on CUDA the keys [{}, {}) must be the queries' own tokens [{}, {}) or lie wholly before or after them",
       op, k_start, k_start + Tk, q_start, q_start + Tq);
}

}  // namespace retain::cuda
