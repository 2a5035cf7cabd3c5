// The span ops of kernels/retention_spans.h (context parallelism's pieces) against the
// whole-sequence ops: a sequence cut into uneven chunks, every query chunk against every key
// chunk (in a scrambled order, as a ring delivers them), parts merged by log-sum-exp and
// gradients added, equals gated_attention / capacity_* on the whole sequence — with documents
// crossing the cuts, padding, blocks of 64 split by the cuts, and chunks after the queries
// (which must add nothing).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/ops.h"
#include "kernels/retention.h"
#include "kernels/retention_spans.h"
#include "tests/retention/random_inputs.h"

using namespace retain;
using namespace retain::test;

namespace {

// Rows [a, b) of dimension `dim` (0 or 1) of t, copied.
Tensor rows(const Tensor& t, int64_t dim, int64_t a, int64_t b) {
  Shape shape = t.shape();
  const int64_t outer = dim == 0 ? 1 : shape[0], n = shape[static_cast<size_t>(dim)];
  int64_t inner = 1;
  for (size_t x = static_cast<size_t>(dim) + 1; x < shape.size(); ++x) inner *= shape[x];
  shape[static_cast<size_t>(dim)] = b - a;
  Tensor out = Tensor::empty(shape, t.dtype());
  const size_t es = dtype_size(t.dtype());
  for (int64_t o = 0; o < outer; ++o)
    std::memcpy(static_cast<char*>(out.raw()) + o * (b - a) * inner * es,
                static_cast<const char*>(t.raw()) + (o * n + a) * inner * es, static_cast<size_t>((b - a) * inner) * es);
  return out;
}

// max |a − b| over max |b| (a relative error for the whole tensor); a and b F32 or F64.
double rel_err(const Tensor& a, const Tensor& b) {
  auto at = [](const Tensor& t, int64_t x) {
    return t.dtype() == DType::F64 ? t.data<double>()[x] : static_cast<double>(t.data<float>()[x]);
  };
  EXPECT_EQ(a.numel(), b.numel());
  double diff = 0, scale = 1e-30;
  for (int64_t x = 0; x < a.numel(); ++x) {
    const double u = at(a, x), v = at(b, x);
    if (std::isinf(u) || std::isinf(v)) {
      EXPECT_EQ(u, v) << "at " << x;
      continue;
    }
    diff = std::max(diff, std::abs(u - v));
    scale = std::max(scale, std::abs(v));
  }
  return diff / scale;
}

// The chunks [cuts[c], cuts[c + 1]) and a scrambled visiting order of the key chunks.
struct Cut {
  std::vector<int64_t> at;
  int64_t n() const { return static_cast<int64_t>(at.size()) - 1; }
};

std::vector<int64_t> order_for(int64_t a, int64_t n) {  // a ring's order: own chunk, then a−1, a−2, ...
  std::vector<int64_t> o;
  for (int64_t s = 0; s < n; ++s) o.push_back(((a - s) % n + n) % n);
  return o;
}

struct Case {
  int64_t T, H, K, d;
  Cut cut;
  bool interleaved;  // documents interleaved token by token
};

void check_attention(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t T = c.T, H = c.H, K = c.K, d = c.d;
  Tensor q = random_normal({T, H, d}, rng), k = random_normal({T, K, d}, rng), v = random_normal({T, K, d}, rng);
  std::vector<int32_t> docs = packed_docs(T, rng, 90);
  if (c.interleaved) {
    std::uniform_int_distribution<int32_t> id(-1, 2);
    for (auto& x : docs) x = id(rng);
  }
  Tensor doc = Tensor::from_vector(docs, {T});
  Tensor log_beta = Tensor::from_vector(random_log_betas(1, T, K, rng), {T, K});
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));

  Tensor out = Tensor::empty({T, H, d}, DType::F32), lse = Tensor::empty({T, H}, DType::F32);
  ops::gated_attention(q, k, v, log_beta, doc, scale, out, lse);
  Tensor dout = random_normal({T, H, d}, rng);
  Tensor dq = Tensor::empty({T, H, d}, DType::F32), dk = Tensor::empty({T, K, d}, DType::F32),
         dv = Tensor::empty({T, K, d}, DType::F32), dlb = Tensor::empty({T, K}, DType::F32);
  ops::gated_attention_backward(q, k, v, log_beta, doc, scale, out, lse, dout, dq, dk, dv, dlb);

  const int64_t n = c.cut.n();
  std::vector<Tensor> dk_parts, dv_parts, dlb_parts;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t len = c.cut.at[b + 1] - c.cut.at[b];
    dk_parts.push_back(Tensor::zeros({len, K, d}, DType::F32));
    dv_parts.push_back(Tensor::zeros({len, K, d}, DType::F32));
    dlb_parts.push_back(Tensor::zeros({len, K}, DType::F32));
  }
  for (int64_t a = 0; a < n; ++a) {
    const int64_t a0 = c.cut.at[a], a1 = c.cut.at[a + 1];
    const Tensor qa = rows(q, 0, a0, a1), doc_a = rows(doc, 0, a0, a1);
    Tensor out_a = Tensor::zeros({a1 - a0, H, d}, DType::F32), lse_a = Tensor::empty({a1 - a0, H}, DType::F32);
    std::fill(lse_a.data<float>(), lse_a.data<float>() + lse_a.numel(), -INFINITY);
    Tensor part = Tensor::empty(out_a.shape(), DType::F32), part_lse = Tensor::empty(lse_a.shape(), DType::F32);
    for (int64_t b : order_for(a, n)) {
      const int64_t b0 = c.cut.at[b], b1 = c.cut.at[b + 1];
      ops::gated_attention_span(qa, doc_a, a0, rows(k, 0, b0, b1), rows(v, 0, b0, b1), rows(log_beta, 0, b0, b1),
                                rows(doc, 0, b0, b1), b0, scale, part, part_lse);
      ops::merge_attention(out_a, lse_a, part, part_lse);
    }
    EXPECT_LT(rel_err(out_a, rows(out, 0, a0, a1)), 2e-6) << "chunk " << a;
    EXPECT_LT(rel_err(lse_a, rows(lse, 0, a0, a1)), 2e-6) << "chunk " << a;

    // Backward with the whole sequence's out and lse (what the forward merged, up to rounding).
    const Tensor out_w = rows(out, 0, a0, a1), lse_w = rows(lse, 0, a0, a1), dout_a = rows(dout, 0, a0, a1);
    Tensor dq_a = Tensor::zeros({a1 - a0, H, d}, DType::F32);
    for (int64_t b : order_for(a, n)) {
      const int64_t b0 = c.cut.at[b], b1 = c.cut.at[b + 1];
      ops::gated_attention_span_backward(qa, doc_a, a0, rows(k, 0, b0, b1), rows(v, 0, b0, b1),
                                         rows(log_beta, 0, b0, b1), rows(doc, 0, b0, b1), b0, scale, out_w, lse_w,
                                         dout_a, dq_a, dk_parts[b], dv_parts[b], dlb_parts[b]);
    }
    EXPECT_LT(rel_err(dq_a, rows(dq, 0, a0, a1)), 2e-6) << "chunk " << a;
  }
  for (int64_t b = 0; b < n; ++b) {
    const int64_t b0 = c.cut.at[b], b1 = c.cut.at[b + 1];
    EXPECT_LT(rel_err(dk_parts[b], rows(dk, 0, b0, b1)), 2e-6) << "chunk " << b;
    EXPECT_LT(rel_err(dv_parts[b], rows(dv, 0, b0, b1)), 2e-6) << "chunk " << b;
    EXPECT_LT(rel_err(dlb_parts[b], rows(dlb, 0, b0, b1)), 2e-6) << "chunk " << b;
  }
}

TEST(Spans, AttentionChunksEqualWholeSequence) {
  // Cuts inside 64-token blocks, a chunk shorter than a block, a one-token chunk.
  check_attention({300, 4, 2, 16, {{0, 70, 128, 129, 200, 300}}, false}, 1);
  check_attention({256, 2, 1, 8, {{0, 64, 128, 192, 256}}, false}, 2);  // block-aligned
  check_attention({190, 4, 4, 8, {{0, 95, 190}}, true}, 3);               // interleaved documents
}

TEST(Spans, OneSpanIsTheWholeSequenceBitForBit) {
  std::mt19937 rng(4);
  const int64_t T = 150, H = 2, K = 1, d = 8;
  Tensor q = random_normal({T, H, d}, rng), k = random_normal({T, K, d}, rng), v = random_normal({T, K, d}, rng);
  Tensor doc = Tensor::from_vector(packed_docs(T, rng, 60), {T});
  Tensor lb = Tensor::from_vector(random_log_betas(1, T, K, rng), {T, K});
  Tensor o1 = Tensor::empty({T, H, d}, DType::F32), l1 = Tensor::empty({T, H}, DType::F32);
  Tensor o2 = Tensor::empty({T, H, d}, DType::F32), l2 = Tensor::empty({T, H}, DType::F32);
  ops::gated_attention(q, k, v, lb, doc, 0.3f, o1, l1);
  ops::gated_attention_span(q, doc, 0, k, v, lb, doc, 0, 0.3f, o2, l2);
  EXPECT_EQ(0, std::memcmp(o1.raw(), o2.raw(), sizeof(float) * o1.numel()));
  EXPECT_EQ(0, std::memcmp(l1.raw(), l2.raw(), sizeof(float) * l1.numel()));
}

void check_capacity(int64_t L, int64_t T, int64_t K, const Cut& cut, ops::CapacityMode mode, double M,
                    uint32_t seed) {
  std::mt19937 rng(seed);
  Tensor doc = Tensor::from_vector(packed_docs(T, rng, 120), {T});
  const Tensor positions = ops::document_positions(doc);
  Tensor lb = Tensor::from_vector(random_log_betas(L, T, K, rng), {L, T, K});
  Tensor S = Tensor::empty({L, T, K}, DType::F32);
  ops::capacity_sums(lb, doc, S);
  const ops::CapacityLoss whole = ops::capacity_loss(lb, doc, positions, M, mode);
  const double scale = 0.7;
  Tensor dlb = Tensor::empty({L, T, K}, DType::F32);
  ops::capacity_loss_backward(lb, doc, positions, M, mode, scale, dlb);

  const int64_t n = cut.n();
  ops::CapacityLoss sum;
  std::vector<Tensor> g(static_cast<size_t>(n)), dparts;
  for (int64_t b = 0; b < n; ++b) dparts.push_back(Tensor::zeros({L, cut.at[b + 1] - cut.at[b], K}, DType::F64));
  for (int64_t a = 0; a < n; ++a) {
    const int64_t a0 = cut.at[a], a1 = cut.at[a + 1];
    Tensor Sa = Tensor::zeros({L, a1 - a0, K}, DType::F64);
    for (int64_t b : order_for(a, n))
      ops::capacity_sums_span(rows(lb, 1, cut.at[b], cut.at[b + 1]), rows(doc, 0, cut.at[b], cut.at[b + 1]),
                              cut.at[b], rows(doc, 0, a0, a1), a0, Sa);
    EXPECT_LT(rel_err(Sa, rows(S, 1, a0, a1)), 1e-7) << "chunk " << a;
    g[a] = Tensor::empty(Sa.shape(), DType::F64);
    const ops::CapacityLoss part =
        ops::capacity_hinge(Sa, rows(doc, 0, a0, a1), rows(positions, 0, a0, a1), M, mode, &g[a]);
    sum.sum += part.sum;
    sum.positive += part.positive;
  }
  EXPECT_EQ(sum.positive, whole.positive);
  EXPECT_NEAR(sum.sum, whole.sum, 1e-12 * std::max(1.0, std::abs(whole.sum)));
  for (int64_t a = 0; a < n; ++a)
    for (int64_t b = 0; b < n; ++b)
      ops::capacity_grad_span(rows(lb, 1, cut.at[b], cut.at[b + 1]), rows(doc, 0, cut.at[b], cut.at[b + 1]),
                              cut.at[b], rows(doc, 0, cut.at[a], cut.at[a + 1]), cut.at[a], g[a], dparts[b]);
  for (int64_t b = 0; b < n; ++b) {
    Tensor scaled = dparts[b].to_dtype(DType::F64);
    for (int64_t x = 0; x < scaled.numel(); ++x) scaled.data<double>()[x] *= scale;
    EXPECT_LT(rel_err(scaled, rows(dlb, 1, cut.at[b], cut.at[b + 1])), 1e-6) << "chunk " << b;
  }
}

TEST(Spans, CapacityChunksEqualWholeSequence) {
  const Cut cut{{0, 70, 128, 129, 260, 333}};
  check_capacity(2, 333, 2, cut, ops::CapacityMode::local, 8.0, 5);
  check_capacity(2, 333, 2, cut, ops::CapacityMode::global, 8.0, 6);
  check_capacity(1, 256, 3, Cut{{0, 128, 256}}, ops::CapacityMode::local, 0.0, 7);
}

TEST(Spans, RefusesBadArguments) {
  Tensor q = Tensor::zeros({4, 2, 8}, DType::F32), k = Tensor::zeros({3, 1, 8}, DType::F32);
  Tensor lb = Tensor::zeros({3, 1}, DType::F32), dq = Tensor::zeros({4}, DType::I32), dk = Tensor::zeros({3}, DType::I32);
  Tensor out = Tensor::zeros({4, 2, 8}, DType::F32), lse = Tensor::zeros({4, 2}, DType::F32);
  EXPECT_THROW(ops::gated_attention_span(q, dq, -1, k, k, lb, dk, 0, 1.0f, out, lse), Error);
  EXPECT_THROW(ops::gated_attention_span(q, dq, 1 << 24, k, k, lb, dk, 0, 1.0f, out, lse), Error);
  EXPECT_THROW(ops::gated_attention_span(q, dk, 0, k, k, lb, dk, 0, 1.0f, out, lse), Error);  // q_doc [3]
  lb.data<float>()[1] = 0.5f;
  EXPECT_THROW(ops::gated_attention_span(q, dq, 0, k, k, lb, dk, 0, 1.0f, out, lse), Error);
  Tensor S = Tensor::zeros({1, 4, 1}, DType::F32);  // must be F64
  EXPECT_THROW(ops::capacity_sums_span(Tensor::zeros({1, 3, 1}, DType::F32), dk, 0, dq, 3, S), Error);
}

}  // namespace
