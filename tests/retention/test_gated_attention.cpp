// ops::gated_attention and its backward against the naive float64 reference of
// reference.h (whose gradients are in turn checked against central finite differences).
#include <gtest/gtest.h>
#include <omp.h>
#include <sys/resource.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/ops.h"
#include "kernels/retention.h"
#include "tests/retention/reference.h"

using namespace retain;
using namespace retain::test;

namespace {

enum class Decay { very_negative, near_zero, mixed, zero };

// Documents as contiguous runs of random lengths, with runs of padding (doc −1) between
// some of them and at the end.
std::vector<int32_t> contiguous_docs(int64_t T, std::mt19937& rng) {
  std::vector<int32_t> doc;
  int32_t id = 0;
  std::uniform_int_distribution<int64_t> len(1, std::max<int64_t>(1, T / 3));
  std::bernoulli_distribution pad(0.25);
  while (static_cast<int64_t>(doc.size()) < T) {
    const int32_t value = pad(rng) ? -1 : id++;
    for (int64_t n = len(rng); n > 0 && static_cast<int64_t>(doc.size()) < T; --n) doc.push_back(value);
  }
  return doc;
}

// Documents interleaved token by token (ids 0..2, some padding): not a packing the data
// pipeline makes, but the op's mask and block skipping must hold for any layout.
std::vector<int32_t> interleaved_docs(int64_t T, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> id(-1, 2);
  std::vector<int32_t> doc(static_cast<size_t>(T));
  for (auto& x : doc) x = id(rng);
  return doc;
}

std::vector<double> log_betas(int64_t n, Decay decay, std::mt19937& rng) {
  std::vector<double> lb(static_cast<size_t>(n));
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (double& x : lb) {
    const float r = u(rng);
    switch (decay) {
      case Decay::very_negative: x = -30.0f - r; break;      // β^(t−i) underflows past t − i ≈ 3
      case Decay::near_zero: x = -1e-6f * (1.0f + r); break;  // almost plain attention
      case Decay::zero: x = 0.0; break;
      case Decay::mixed: {  // 1 in 20 is −inf (β = 0: the key is seen only by its own query)
        const int pick = static_cast<int>(r * 3.0f);
        x = u(rng) < 0.05f ? -INFINITY : pick == 0 ? -30.0f : pick == 1 ? -1e-6f : -2.0f * u(rng);
      }
    }
  }
  return lb;
}

Attn random_problem(int64_t T, int64_t H, int64_t K, int64_t d, Decay decay, std::vector<int32_t> doc,
                    std::mt19937& rng) {
  Attn a{T, H, K, d, static_cast<double>(1.0f / std::sqrt(static_cast<float>(d))), {}, {}, {}, {}, std::move(doc)};
  // Query/key scale 1.5 gives peaked softmax rows (scores of a few units).
  a.q = randn(T * H * d, rng, 1.5);
  a.k = randn(T * K * d, rng, 1.5);
  a.v = randn(T * K * d, rng);
  a.lb = log_betas(T * K, decay, rng);
  return a;
}

struct Inputs {
  Tensor q, k, v, lb, doc;
};
Inputs tensors(const Attn& a) {
  return {f32(a.q, {a.T, a.H, a.d}), f32(a.k, {a.T, a.K, a.d}), f32(a.v, {a.T, a.K, a.d}), f32(a.lb, {a.T, a.K}),
          i32(a.doc)};
}

struct Forward {
  Tensor out, lse;
};
Forward run_forward(const Attn& a, const Inputs& in) {
  Forward f{Tensor::empty({a.T, a.H, a.d}, DType::F32), Tensor::empty({a.T, a.H}, DType::F32)};
  ops::gated_attention(in.q, in.k, in.v, in.lb, in.doc, static_cast<float>(a.scale), f.out, f.lse);
  return f;
}

struct Backward {
  Tensor dq, dk, dv, dlb;
};
Backward run_backward(const Attn& a, const Inputs& in, const Forward& f, const Tensor& dout) {
  Backward b{Tensor::empty({a.T, a.H, a.d}, DType::F32), Tensor::empty({a.T, a.K, a.d}, DType::F32),
             Tensor::empty({a.T, a.K, a.d}, DType::F32), Tensor::empty({a.T, a.K}, DType::F32)};
  ops::gated_attention_backward(in.q, in.k, in.v, in.lb, in.doc, static_cast<float>(a.scale), f.out, f.lse, dout,
                                b.dq, b.dk, b.dv, b.dlb);
  return b;
}

// lse of the op vs the reference: equal (−inf) on padding rows, else within `tol`.
void expect_lse_near(const Tensor& got, const std::vector<double>& want, double tol) {
  for (size_t x = 0; x < want.size(); ++x) {
    if (std::isinf(want[x])) {
      EXPECT_EQ(got.data<float>()[x], -std::numeric_limits<float>::infinity()) << "row " << x;
    } else {
      EXPECT_NEAR(got.data<float>()[x], want[x], tol) << "row " << x;
    }
  }
}

struct Case {
  int64_t T, H, K, d;
  Decay decay;
  bool interleaved;
};

// T not a multiple of the 64-token block, GQA groups 1/2/4, head_dim 16/64, every decay regime,
// contiguous and interleaved documents with padding.
const std::vector<Case> kCases = {
    {1, 2, 2, 16, Decay::mixed, false},          {5, 4, 1, 16, Decay::near_zero, false},
    {64, 4, 2, 16, Decay::very_negative, false}, {130, 2, 2, 64, Decay::mixed, false},
    {130, 4, 1, 16, Decay::near_zero, true},     {203, 4, 2, 64, Decay::very_negative, true},
    {203, 8, 2, 16, Decay::mixed, true},         {257, 4, 4, 16, Decay::mixed, false},
    {190, 4, 1, 64, Decay::mixed, false},        {150, 2, 1, 16, Decay::zero, false},
};

}  // namespace

// Float32 scores (d ≤ 64 products of values of size ~1.5) carry relative error ~1e-6 into
// each probability; the float64 cross-tile sums add nothing comparable. Observed relative
// errors are 1.2e-7 – 1.8e-7; 2e-5 leaves margin without admitting a wrong mask, decay or
// normalisation, any of which moves the output by O(1) relative.
TEST(GatedAttention, ForwardMatchesFloat64Reference) {
  std::mt19937 rng(11);
  for (const Case& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "T=" << c.T << " H=" << c.H << " K=" << c.K << " d=" << c.d
                                      << " decay=" << static_cast<int>(c.decay) << " interleaved=" << c.interleaved);
    std::vector<int32_t> doc = c.interleaved ? interleaved_docs(c.T, rng) : contiguous_docs(c.T, rng);
    const Attn a = random_problem(c.T, c.H, c.K, c.d, c.decay, doc, rng);
    const Forward f = run_forward(a, tensors(a));
    const AttnOut want = attention_forward(a);
    EXPECT_LT(rel_err(to_f64(f.out), want.out), 2e-5);
    expect_lse_near(f.lse, want.lse, 1e-4);
    for (int64_t t = 0; t < a.T; ++t) {  // padding rows are exactly 0
      if (a.doc[t] >= 0) continue;
      for (int64_t x = 0; x < a.H * a.d; ++x) ASSERT_EQ(f.out.data<float>()[t * a.H * a.d + x], 0.0f);
    }
  }
}

// logβ ≡ 0 is the teacher: the op must agree with the existing plain attention op.
TEST(GatedAttention, ZeroDecayEqualsPlainAttention) {
  std::mt19937 rng(12);
  const Attn a = random_problem(300, 4, 2, 16, Decay::zero, contiguous_docs(300, rng), rng);
  const Inputs in = tensors(a);
  const Forward f = run_forward(a, in);
  Tensor plain = Tensor::empty({a.T, a.H, a.d}, DType::F32);
  ops::attention(in.q, in.k, in.v, in.doc, static_cast<float>(a.scale), plain);
  EXPECT_LT(rel_err(to_f64(f.out), to_f64(plain)), 1e-5);
}

// The reference's analytic gradients against central differences of its own loss
// L = Σ out·R, all in float64: step 1e-5 gives truncation error ~1e-10·|L'''| and rounding
// ~1e-16·|L|/1e-5 ≈ 1e-11, so agreement to 1e-7 relative proves the chain rule written in
// reference.h (which then judges the op).
TEST(GatedAttention, ReferenceGradientsMatchFiniteDifferences) {
  std::mt19937 rng(13);
  std::vector<int32_t> doc = {0, 0, 0, -1, 1, 1, 1, 1, 1, 0, 2, 2, 2, 2, 2, -1, 2, 2};
  Attn a = random_problem(static_cast<int64_t>(doc.size()), 4, 2, 4, Decay::mixed, doc, rng);
  for (size_t i = 0; i < a.lb.size(); ++i) a.lb[i] = -0.3 * (1 + (i % 3));  // decays that matter
  const std::vector<double> R = randn(a.T * a.H * a.d, rng);
  const AttnGrads g = attention_backward(a, R);
  const double h = 1e-5;
  auto check = [&](std::vector<double>& param, const std::vector<double>& grad, const char* name) {
    std::vector<double> fd(param.size());
    for (size_t x = 0; x < param.size(); ++x) {
      const double saved = param[x];
      param[x] = saved + h;
      const double up = attention_loss(a, R);
      param[x] = saved - h;
      const double down = attention_loss(a, R);
      param[x] = saved;
      fd[x] = (up - down) / (2 * h);
    }
    EXPECT_LT(rel_err(grad, fd), 1e-7) << name;
  };
  check(a.q, g.dq, "dq");
  check(a.k, g.dk, "dk");
  check(a.v, g.dv, "dv");
  check(a.lb, g.dlb, "dlog_beta");
}

// The op's float32 gradients against the float64 analytic ones. Recomputed probabilities
// carry relative error ~|lse|·6e-8 on top of the forward's ~1e-6, so errors are measured
// against ‖want‖ + ‖magnitude‖, the sums of absolute terms (see attention_backward): where a
// row's probability sits on one key (logβ = −30), dq and dk are ~1e-13 and float32 can only
// resolve them to ~1e-7·magnitude. In the other cases the magnitude is of the order of the
// gradient itself. Observed errors are 2e-8 – 6e-7; 1e-4 admits no wrong term (a missing
// (t − i) factor, scale, group sum or mask is O(1)).
TEST(GatedAttention, BackwardMatchesFloat64Gradients) {
  std::mt19937 rng(14);
  for (const Case& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "T=" << c.T << " H=" << c.H << " K=" << c.K << " d=" << c.d
                                      << " decay=" << static_cast<int>(c.decay) << " interleaved=" << c.interleaved);
    std::vector<int32_t> doc = c.interleaved ? interleaved_docs(c.T, rng) : contiguous_docs(c.T, rng);
    const Attn a = random_problem(c.T, c.H, c.K, c.d, c.decay, doc, rng);
    const Inputs in = tensors(a);
    const Forward f = run_forward(a, in);
    const std::vector<double> R = randn(a.T * a.H * a.d, rng);
    const Backward b = run_backward(a, in, f, f32(R, {a.T, a.H, a.d}));
    const AttnGrads want = attention_backward(a, R), mag = attention_backward(a, R, true);
    EXPECT_LT(rel_err(to_f64(b.dq), want.dq, mag.dq), 1e-4);
    EXPECT_LT(rel_err(to_f64(b.dk), want.dk, mag.dk), 1e-4);
    EXPECT_LT(rel_err(to_f64(b.dv), want.dv, mag.dv), 1e-4);
    EXPECT_LT(rel_err(to_f64(b.dlb), want.dlb, mag.dlb), 1e-4);
    if (c.decay != Decay::very_negative) {  // here the plain relative error is meaningful too
      EXPECT_LT(rel_err(to_f64(b.dq), want.dq), 1e-4);
      EXPECT_LT(rel_err(to_f64(b.dk), want.dk), 1e-4);
      EXPECT_LT(rel_err(to_f64(b.dlb), want.dlb), 1e-4);
    }
    EXPECT_LT(rel_err(to_f64(b.dv), want.dv), 1e-4);
    for (int64_t t = 0; t < a.T; ++t) {  // padding tokens get exactly zero gradients
      if (a.doc[t] >= 0) continue;
      for (int64_t x = 0; x < a.H * a.d; ++x) ASSERT_EQ(b.dq.data<float>()[t * a.H * a.d + x], 0.0f);
      for (int64_t x = 0; x < a.K * a.d; ++x) ASSERT_EQ(b.dk.data<float>()[t * a.K * a.d + x], 0.0f);
      for (int64_t x = 0; x < a.K * a.d; ++x) ASSERT_EQ(b.dv.data<float>()[t * a.K * a.d + x], 0.0f);
      for (int64_t x = 0; x < a.K; ++x) ASSERT_EQ(b.dlb.data<float>()[t * a.K + x], 0.0f);
    }
  }
}

// Results are bit-identical with 1, 2, 3 and 7 OpenMP threads (every output row is owned by
// one work item that visits its tiles in a fixed order).
TEST(GatedAttention, DeterministicAcrossThreadCounts) {
  std::mt19937 rng(15);
  const Attn a = random_problem(333, 4, 2, 16, Decay::mixed, contiguous_docs(333, rng), rng);
  const Inputs in = tensors(a);
  const Tensor dout = f32(randn(a.T * a.H * a.d, rng), {a.T, a.H, a.d});
  auto same = [](const Tensor& x, const Tensor& y) { return std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0; };
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const Forward f1 = run_forward(a, in);
  const Backward b1 = run_backward(a, in, f1, dout);
  for (int threads : {2, 3, 7}) {
    omp_set_num_threads(threads);
    const Forward f = run_forward(a, in);
    const Backward b = run_backward(a, in, f, dout);
    EXPECT_TRUE(same(f1.out, f.out) && same(f1.lse, f.lse)) << threads << " threads";
    EXPECT_TRUE(same(b1.dq, b.dq) && same(b1.dk, b.dk) && same(b1.dv, b.dv) && same(b1.dlb, b.dlb))
        << threads << " threads";
  }
  omp_set_num_threads(saved);
}

TEST(GatedAttention, RejectsBadShapesAndDtypes) {
  std::mt19937 rng(16);
  const Attn a = random_problem(10, 4, 2, 8, Decay::mixed, std::vector<int32_t>(10, 0), rng);
  const Inputs in = tensors(a);
  Forward f{Tensor::empty({10, 4, 8}, DType::F32), Tensor::empty({10, 4}, DType::F32)};
  const float s = 0.35f;
  EXPECT_NO_THROW(ops::gated_attention(in.q, in.k, in.v, in.lb, in.doc, s, f.out, f.lse));
  Tensor k3 = Tensor::zeros({10, 3, 8}, DType::F32);  // 4 heads over 3 KV heads
  EXPECT_THROW(ops::gated_attention(in.q, k3, k3, in.lb, in.doc, s, f.out, f.lse), Error);
  Tensor lb_bad = Tensor::zeros({10, 3}, DType::F32);
  EXPECT_THROW(ops::gated_attention(in.q, in.k, in.v, lb_bad, in.doc, s, f.out, f.lse), Error);
  Tensor doc_f = Tensor::zeros({10}, DType::F32);
  EXPECT_THROW(ops::gated_attention(in.q, in.k, in.v, in.lb, doc_f, s, f.out, f.lse), Error);
  Tensor v_short = Tensor::zeros({9, 2, 8}, DType::F32);
  EXPECT_THROW(ops::gated_attention(in.q, in.k, v_short, in.lb, in.doc, s, f.out, f.lse), Error);
  Tensor lse_bad = Tensor::empty({10, 2}, DType::F32);
  EXPECT_THROW(ops::gated_attention(in.q, in.k, in.v, in.lb, in.doc, s, f.out, lse_bad), Error);
  EXPECT_THROW(ops::gated_attention(in.q, in.k, in.v, in.lb, in.doc, NAN, f.out, f.lse), Error);
  std::vector<double> lb = a.lb;
  lb[7 * 2 + 1] = 0.5;  // a positive logβ at [7, 1]
  try {
    ops::gated_attention(in.q, in.k, in.v, f32(lb, {10, 2}), in.doc, s, f.out, f.lse);
    ADD_FAILURE() << "no error for log_beta > 0";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "gated_attention: log_beta[7, 1] = 0.5 is not ≤ 0 (it must be a logsigmoid output)");
  }
  lb[7 * 2 + 1] = NAN;
  EXPECT_THROW(ops::gated_attention(in.q, in.k, in.v, f32(lb, {10, 2}), in.doc, s, f.out, f.lse), Error);
  lb[7 * 2 + 1] = -INFINITY;  // allowed: β = 0 keeps only the i = t term of key 7
  EXPECT_NO_THROW(ops::gated_attention(in.q, in.k, in.v, f32(lb, {10, 2}), in.doc, s, f.out, f.lse));
  Tensor q_bf = in.q.to_dtype(DType::BF16);
  EXPECT_THROW(ops::gated_attention(q_bf, in.k, in.v, in.lb, in.doc, s, f.out, f.lse), Error);
  Backward b{Tensor::empty({10, 4, 8}, DType::F32), Tensor::empty({10, 2, 8}, DType::F32),
             Tensor::empty({10, 2, 8}, DType::F32), Tensor::empty({10, 1}, DType::F32)};
  EXPECT_THROW(ops::gated_attention_backward(in.q, in.k, in.v, in.lb, in.doc, s, f.out, f.lse, f.out, b.dq, b.dk,
                                             b.dv, b.dlb),
               Error);
  try {
    ops::gated_attention(in.q, in.k, in.v, lb_bad, in.doc, s, f.out, f.lse);
    ADD_FAILURE() << "no error for a log_beta of the wrong shape";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "gated_attention: log_beta must be F32 [T, K] = [10, 2], got F32 [10, 3]");
  }
}

namespace {

// Peak resident memory of this process in bytes.
int64_t peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

}  // namespace

// T = 32768 in four documents (up to 12700 tokens) and padding: sampled rows of the output and of dq
// against the float64 reference (each an O(t·d) row), key gradients on columns near document
// ends (where a column has few queries and its reference is cheap), and two identities that
// involve every column: Σ_i dv_i = Σ_{t, h in group} dout_t (probability rows sum to 1) and
// Σ_i dk_i = 0 (dS rows sum to 0). The process's peak memory stays far below one T×T buffer
// (1 GiB even at one byte per pair).
TEST(GatedAttention, LongSequenceInLinearMemory) {
  const int64_t T = 32768, H = 1, K = 1, d = 8;
  std::vector<int32_t> doc(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t)
    doc[t] = t < 10000 ? 0 : t < 10100 ? -1 : t < 20000 ? 1 : t < 32700 ? 2 : 3;
  std::mt19937 rng(17);
  Attn a = random_problem(T, H, K, d, Decay::near_zero, doc, rng);
  // Realistic gates: most keys barely decay (their mass reaches across the whole document),
  // some decay fast.
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (double& x : a.lb) x = u(rng) < 0.7f ? -1e-5f * u(rng) : -0.5f * u(rng);
  const Inputs in = tensors(a);
  const std::vector<double> R = randn(T * H * d, rng);
  const Tensor dout = f32(R, {T, H, d});

  const Forward f = run_forward(a, in);
  const Backward b = run_backward(a, in, f, dout);
  EXPECT_LT(peak_rss_bytes(), int64_t{256} << 20);

  const std::vector<double> out = to_f64(f.out), dq = to_f64(b.dq), dk = to_f64(b.dk), dv = to_f64(b.dv),
                            dlb = to_f64(b.dlb);
  // Reference rows: output, lse, and the row's dq.
  for (int64_t t : {0, 777, 9999, 10050, 10100, 19999, 20000, 32699, 32700, 32767}) {
    for (int64_t h = 0; h < H; ++h) {
      SCOPED_TRACE(::testing::Message() << "t=" << t << " h=" << h);
      const AttnRow row = attention_row(a, t, h);
      std::vector<double> got(out.begin() + (t * H + h) * d, out.begin() + (t * H + h + 1) * d);
      EXPECT_LT(rel_err(got, row.out), 2e-5);
      if (doc[t] < 0) continue;
      EXPECT_NEAR(f.lse.data<float>()[t * H + h], row.lse, 1e-4);
      // dq_t = scale Σ_i P_ti (R_t·v_i − D_t) k_i; its magnitude floor as in attention_backward.
      std::vector<double> want(d, 0.0), mag(d, 0.0), dP(static_cast<size_t>(t + 1), 0.0);
      double D = 0;
      for (int64_t i = 0; i <= t; ++i) {
        if (row.p[i] == 0) continue;
        for (int64_t j = 0; j < d; ++j) dP[i] += R[(t * H + h) * d + j] * a.v[i * d + j];
        D += row.p[i] * dP[i];
      }
      for (int64_t i = 0; i <= t; ++i)
        for (int64_t j = 0; j < d; ++j) {
          want[j] += a.scale * row.p[i] * (dP[i] - D) * a.k[i * d + j];
          mag[j] += a.scale * row.p[i] * (std::abs(dP[i]) + std::abs(D)) * std::abs(a.k[i * d + j]);
        }
      std::vector<double> got_dq(dq.begin() + (t * H + h) * d, dq.begin() + (t * H + h + 1) * d);
      EXPECT_LT(rel_err(got_dq, want, mag), 1e-4);
    }
  }
  // Key columns near the ends of documents: the reference sums over their few queries.
  for (int64_t i : {9990, 9999, 19995, 32690, 32699, 32750, 32767}) {
    SCOPED_TRACE(::testing::Message() << "i=" << i);
    std::vector<double> want_dk(d, 0.0), want_dv(d, 0.0), mag_dk(d, 0.0);
    double want_dlb = 0, mag_dlb = 0;
    for (int64_t t = i; t < T && doc[t] == doc[i]; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const AttnRow row = attention_row(a, t, h);
        double D = 0, dPi = 0;
        for (int64_t x = 0; x <= t; ++x) {
          if (row.p[x] == 0) continue;
          double dP = 0;
          for (int64_t j = 0; j < d; ++j) dP += R[(t * H + h) * d + j] * a.v[x * d + j];
          D += row.p[x] * dP;
          if (x == i) dPi = dP;
        }
        const double dS = row.p[i] * (dPi - D), dS_mag = row.p[i] * (std::abs(dPi) + std::abs(D));
        for (int64_t j = 0; j < d; ++j) {
          want_dk[j] += a.scale * dS * a.q[(t * H + h) * d + j];
          mag_dk[j] += a.scale * dS_mag * std::abs(a.q[(t * H + h) * d + j]);
          want_dv[j] += row.p[i] * R[(t * H + h) * d + j];
        }
        want_dlb += static_cast<double>(t - i) * dS;
        mag_dlb += static_cast<double>(t - i) * dS_mag;
      }
    EXPECT_LT(rel_err(std::vector<double>(dk.begin() + i * d, dk.begin() + (i + 1) * d), want_dk, mag_dk), 1e-4);
    EXPECT_LT(rel_err(std::vector<double>(dv.begin() + i * d, dv.begin() + (i + 1) * d), want_dv), 1e-4);
    EXPECT_LE(std::abs(dlb[i] - want_dlb), 1e-4 * (std::abs(want_dlb) + mag_dlb));
  }
  // Identities over all columns (K = 1): Σ_i dv_i = Σ_{t non-padding, h} R_t and Σ_i dk_i = 0,
  // both relative to Σ_i |dv_i|, Σ_i |dk_i| (the scale of their float32 terms).
  for (int64_t j = 0; j < d; ++j) {
    double sum_dv = 0, abs_dv = 0, sum_dk = 0, abs_dk = 0, sum_R = 0;
    for (int64_t i = 0; i < T; ++i) {
      sum_dv += dv[i * d + j], abs_dv += std::abs(dv[i * d + j]);
      sum_dk += dk[i * d + j], abs_dk += std::abs(dk[i * d + j]);
    }
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        if (doc[t] >= 0) sum_R += R[(t * H + h) * d + j];
    EXPECT_NEAR(sum_dv, sum_R, 1e-5 * abs_dv) << "j=" << j;
    EXPECT_NEAR(sum_dk, 0.0, 1e-5 * abs_dk) << "j=" << j;
  }
}
