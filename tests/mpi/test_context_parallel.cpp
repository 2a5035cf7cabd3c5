// Context parallelism's ring ops (trainer/context_parallel.h) on 1, 2 and 4 ranks against the
// whole-sequence ops on one rank: every rank makes the same random sequence, runs the ring on
// its chunks, and compares its rows of the result with its rows of gated_attention /
// capacity_loss(_backward) / kvpop::future_attention_target on the whole sequence, and
// gather_to_owners' items against the whole tensors. T not divisible by 2N, documents that cross
// chunk edges, padding, trimkv-like and dbtrimkv (global) capacity.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/kvpop.h"
#include "kernels/ops.h"
#include "kernels/retention.h"
#include "tests/mpi/mpi_test_main.h"
#include "tests/retention/random_inputs.h"
#include "trainer/context_parallel.h"

using namespace retain;
using retain::dist::mpi_test::world;
using retain::trainer::ContextLayout;

namespace {

// max |a − b| / max |b|, both F32 of the same shape; infinities must match exactly.
double rel_err(const Tensor& a, const Tensor& b) {
  double diff = 0, scale = 1e-30;
  for (int64_t x = 0; x < a.numel(); ++x) {
    const double u = a.data<float>()[x], v = b.data<float>()[x];
    if (std::isinf(u) || std::isinf(v)) {
      if (u != v) return INFINITY;
      continue;
    }
    diff = std::max(diff, std::abs(u - v));
    scale = std::max(scale, std::abs(v));
  }
  return diff / scale;
}

TEST(ContextLayout, ChunksCoverTheSequenceOnce) {
  for (int N : {1, 2, 3, 4, 8})
    for (int64_t T : {int64_t{2} * N, int64_t{301}, int64_t{4096}}) {
      if (T < 2 * N) continue;
      const ContextLayout layout(T, N);
      std::vector<int> owner(static_cast<size_t>(T), -1);
      int64_t most = 0, least = T;
      for (int r = 0; r < N; ++r) {
        for (const auto& s : layout.spans(r))
          for (int64_t t = s.start; t < s.end(); ++t) {
            EXPECT_EQ(owner[static_cast<size_t>(t)], -1) << "token " << t << " twice";
            owner[static_cast<size_t>(t)] = r;
          }
        most = std::max(most, layout.local_tokens(r));
        least = std::min(least, layout.local_tokens(r));
      }
      for (int64_t t = 0; t < T; ++t) EXPECT_GE(owner[static_cast<size_t>(t)], 0) << "token " << t;
      EXPECT_LE(most - least, 2) << "T " << T << " N " << N;  // balanced
      EXPECT_EQ(layout.max_local_tokens(), most);
    }
  EXPECT_THROW(ContextLayout(3, 2), Error);
  EXPECT_THROW(ContextLayout(10, 0), Error);
}

TEST(ContextLayout, LocalAndPutLocalAreInverse) {
  const ContextLayout layout(37, 3);
  std::mt19937 rng(1);
  const Tensor whole = test::random_normal({2, 37, 3}, rng);
  Tensor back = Tensor::zeros({2, 37, 3}, DType::F32);
  for (int r = 0; r < 3; ++r) layout.put_local(layout.local(whole, r, 1), r, back, 1);
  EXPECT_EQ(rel_err(back, whole), 0.0);
}

struct Inputs {
  Tensor q, k, v, log_beta, doc, dout;
};

Inputs make_inputs(int64_t T, int64_t H, int64_t K, int64_t d, uint32_t seed) {
  std::mt19937 rng(seed);
  Inputs in;
  in.q = test::random_normal({T, H, d}, rng);
  in.k = test::random_normal({T, K, d}, rng);
  in.v = test::random_normal({T, K, d}, rng);
  in.doc = Tensor::from_vector(test::packed_docs(T, rng, 160), {T});  // long documents cross the chunk edges
  in.log_beta = Tensor::from_vector(test::random_log_betas(1, T, K, rng), {T, K});
  in.dout = test::random_normal({T, H, d}, rng);
  return in;
}

TEST(RingAttention, EqualsTheWholeSequence) {
  const int N = world().size(), r = world().rank();
  for (int64_t T : {int64_t{301}, int64_t{520}}) {
    SCOPED_TRACE("T " + std::to_string(T));
    const int64_t H = 4, K = 2, d = 16;
    const Inputs in = make_inputs(T, H, K, d, static_cast<uint32_t>(T));
    const float scale = 0.25f;
    Tensor out = Tensor::empty({T, H, d}, DType::F32), lse = Tensor::empty({T, H}, DType::F32);
    ops::gated_attention(in.q, in.k, in.v, in.log_beta, in.doc, scale, out, lse);
    Tensor dq = Tensor::empty({T, H, d}, DType::F32), dk = Tensor::empty({T, K, d}, DType::F32),
           dv = Tensor::empty({T, K, d}, DType::F32), dlb = Tensor::empty({T, K}, DType::F32);
    ops::gated_attention_backward(in.q, in.k, in.v, in.log_beta, in.doc, scale, out, lse, in.dout, dq, dk, dv, dlb);

    const ContextLayout layout(T, N);
    const int64_t Tl = layout.local_tokens(r);
    auto mine = [&](const Tensor& t) { return layout.local(t, r); };
    Tensor o = Tensor::empty({Tl, H, d}, DType::F32), l = Tensor::empty({Tl, H}, DType::F32);
    trainer::ring_gated_attention(world(), layout, mine(in.q), mine(in.k), mine(in.v), mine(in.log_beta),
                                  mine(in.doc), scale, o, l);
    EXPECT_LT(rel_err(o, mine(out)), 2e-6);
    EXPECT_LT(rel_err(l, mine(lse)), 2e-6);

    Tensor gq = Tensor::empty({Tl, H, d}, DType::F32), gk = Tensor::empty({Tl, K, d}, DType::F32),
           gv = Tensor::empty({Tl, K, d}, DType::F32), gl = Tensor::empty({Tl, K}, DType::F32);
    trainer::ring_gated_attention_backward(world(), layout, mine(in.q), mine(in.k), mine(in.v), mine(in.log_beta),
                                           mine(in.doc), scale, o, l, mine(in.dout), gq, gk, gv, gl);
    EXPECT_LT(rel_err(gq, mine(dq)), 5e-6);
    EXPECT_LT(rel_err(gk, mine(dk)), 5e-6);
    EXPECT_LT(rel_err(gv, mine(dv)), 5e-6);
    EXPECT_LT(rel_err(gl, mine(dlb)), 5e-6);
  }
}

TEST(RingCapacity, EqualsTheWholeSequence) {
  const int N = world().size(), r = world().rank();
  const int64_t T = 333, L = 2, K = 2;
  std::mt19937 rng(7);
  const Tensor doc = Tensor::from_vector(test::packed_docs(T, rng, 200), {T});
  const Tensor positions = ops::document_positions(doc);
  const Tensor lb = Tensor::from_vector(test::random_log_betas(L, T, K, rng), {L, T, K});
  const ContextLayout layout(T, N);
  for (auto mode : {ops::CapacityMode::local, ops::CapacityMode::global}) {
    SCOPED_TRACE(mode == ops::CapacityMode::local ? "local" : "global");
    const double M = 6.0, scale = 0.3;
    const ops::CapacityLoss whole = ops::capacity_loss(lb, doc, positions, M, mode);
    Tensor dlb = Tensor::empty({L, T, K}, DType::F32);
    ops::capacity_loss_backward(lb, doc, positions, M, mode, scale, dlb);

    const ops::CapacityLoss part = trainer::ring_capacity_loss(world(), layout, layout.local(lb, r, 1),
                                                               layout.local(doc, r), layout.local(positions, r), M, mode);
    double sums[2] = {part.sum, static_cast<double>(part.positive)};
    world().all_reduce(sums, 2);
    EXPECT_NEAR(sums[0], whole.sum, 1e-12 * std::max(1.0, whole.sum));
    EXPECT_EQ(static_cast<int64_t>(sums[1]), whole.positive);
    EXPECT_GT(whole.positive, 0);

    Tensor g = Tensor::empty({L, layout.local_tokens(r), K}, DType::F32);
    trainer::ring_capacity_loss_backward(world(), layout, layout.local(lb, r, 1), layout.local(doc, r),
                                         layout.local(positions, r), M, mode, scale, g);
    EXPECT_LT(rel_err(g, layout.local(dlb, r, 1)), 1e-6);
  }
}

TEST(RingTarget, EqualsTheWholeSequence) {
  // KVPOP's future-attention target: the keys stay, the queries and their lse travel.
  const int N = world().size(), r = world().rank();
  for (int64_t T : {int64_t{301}, int64_t{520}})
    for (int64_t w : {int64_t{1}, int64_t{7}, int64_t{90}}) {
      SCOPED_TRACE("T " + std::to_string(T) + " w " + std::to_string(w));
      const int64_t H = 4, K = 2, d = 16;
      const Inputs in = make_inputs(T, H, K, d, static_cast<uint32_t>(T + w));
      const float scale = 0.25f;
      Tensor out = Tensor::empty({T, H, d}, DType::F32), lse = Tensor::empty({T, H}, DType::F32);
      ops::gated_attention(in.q, in.k, in.v, Tensor::zeros({T, K}, DType::F32), in.doc, scale, out, lse);
      const Tensor whole = kvpop::future_attention_target(in.q, in.k, lse, in.doc, w, scale);  // [K, T]

      const ContextLayout layout(T, N);
      auto mine = [&](const Tensor& t) { return layout.local(t, r); };
      const Tensor log_m =
          trainer::ring_future_attention_target(world(), layout, mine(in.q), mine(in.k), mine(lse), mine(in.doc), w,
                                                scale);
      ASSERT_EQ(log_m.shape(), (Shape{K, layout.local_tokens(r)}));
      EXPECT_LT(rel_err(log_m, layout.local(whole, r, 1)), 1e-6);  // (−inf where no target: exactly)
    }
}

TEST(GatherToOwners, EachItemWholeOnItsOwner) {
  const int N = world().size(), r = world().rank();
  const int64_t T = 301;
  const ContextLayout layout(T, N);
  std::mt19937 rng(5);
  std::vector<Tensor> whole, local;
  std::vector<int> owner;
  for (int64_t i = 0; i < 7; ++i) {  // widths 1–4; owners unbalanced (rank 0 gets the most)
    whole.push_back(test::random_normal({T, 1 + i % 4}, rng));
    local.push_back(layout.local(whole.back(), r));
    owner.push_back(static_cast<int>((i * i) % N));
  }
  const std::vector<Tensor> got = trainer::gather_to_owners(world(), layout, local, owner);
  ASSERT_EQ(got.size(), whole.size());
  for (size_t i = 0; i < whole.size(); ++i) {
    SCOPED_TRACE("item " + std::to_string(i));
    if (owner[i] != r) {
      EXPECT_EQ(got[i].numel(), 0);
      continue;
    }
    ASSERT_EQ(got[i].shape(), whole[i].shape());
    EXPECT_EQ(rel_err(got[i], whole[i]), 0.0);
  }
  // Nothing owned anywhere, a bad owner, a count mismatch.
  EXPECT_TRUE(trainer::gather_to_owners(world(), layout, {}, {}).empty());
  EXPECT_THROW(trainer::gather_to_owners(world(), layout, {local[0]}, {N}), Error);
  EXPECT_THROW(trainer::gather_to_owners(world(), layout, {local[0]}, {}), Error);
}

TEST(RingAttention, RefusesAMismatchedGroupOrShape) {
  const int N = world().size(), r = world().rank();
  const ContextLayout wrong(64, N + 1);
  Tensor q = Tensor::zeros({wrong.local_tokens(0), 2, 8}, DType::F32);
  Tensor k = Tensor::zeros({wrong.local_tokens(0), 1, 8}, DType::F32), lb = Tensor::zeros({wrong.local_tokens(0), 1}, DType::F32);
  Tensor doc = Tensor::zeros({wrong.local_tokens(0)}, DType::I32), lse = Tensor::zeros({wrong.local_tokens(0), 2}, DType::F32);
  EXPECT_THROW(trainer::ring_gated_attention(world(), wrong, q, k, k, lb, doc, 1.0f, q, lse), Error);
  const ContextLayout right(64, N);
  if (right.local_tokens(r) != q.dim(0)) {  // (a shape that is not this rank's share)
    EXPECT_THROW(trainer::ring_gated_attention(world(), right, q, k, k, lb, doc, 1.0f, q, lse), Error);
  }
}

}  // namespace
