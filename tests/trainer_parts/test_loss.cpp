// The chunked KL + NTP loss (kernels/loss.h) against a naive float64 implementation written
// here from DESIGN §4 (full [T, V] logits in double, softmax by definition), its gradient
// against that reference and against central finite differences of it, chunk-size and
// thread-count invariance, and the loss positions.
#include <gtest/gtest.h>
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/loss.h"

using namespace retain;
using namespace retain::ops;  // kernels/loss.h

namespace {

// ---- float64 reference ---------------------------------------------------------------
struct Ref {
  double kl = 0, ntp = 0;
  int64_t positions = 0;
  std::vector<double> grad;  // [T, D] of kl_scale·ΣKL + ntp_scale·ΣNTP w.r.t. the student hidden
};

std::vector<double> to64(const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = t.data<float>()[i];
  return v;
}

// Everything in double, the whole [T, V] logit matrices at once.
Ref reference(const std::vector<double>& th, const std::vector<double>& sh, const std::vector<double>& W, int64_t T,
              int64_t D, int64_t V, const Tensor& ids, const Tensor& mask, double kl_scale, double ntp_scale,
              bool reverse = false) {
  Ref r;
  r.grad.assign(static_cast<size_t>(T * D), 0.0);
  std::vector<double> lt(static_cast<size_t>(T * V)), ls(static_cast<size_t>(T * V));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t v = 0; v < V; ++v) {
      double a = 0, b = 0;
      for (int64_t d = 0; d < D; ++d) {
        a += th[static_cast<size_t>(t * D + d)] * W[static_cast<size_t>(v * D + d)];
        b += sh[static_cast<size_t>(t * D + d)] * W[static_cast<size_t>(v * D + d)];
      }
      lt[static_cast<size_t>(t * V + v)] = a;
      ls[static_cast<size_t>(t * V + v)] = b;
    }
  for (int64_t t = 0; t < T; ++t) {
    if (!mask.data<uint8_t>()[t]) continue;
    ++r.positions;
    const double* a = lt.data() + t * V;
    const double* b = ls.data() + t * V;
    double ma = a[0], mb = b[0];
    for (int64_t v = 1; v < V; ++v) ma = std::max(ma, a[v]), mb = std::max(mb, b[v]);
    double za = 0, zb = 0;
    for (int64_t v = 0; v < V; ++v) za += std::exp(a[v] - ma), zb += std::exp(b[v] - mb);
    const double lsea = ma + std::log(za), lseb = mb + std::log(zb);
    const int64_t y = ids.data<int32_t>()[t + 1];
    // Reverse: KL(q‖p) = Σ q(log q − log p); ∂/∂b_v = q_v(log q_v − log p_v − KL(q‖p)).
    double kl_rev = 0;
    for (int64_t v = 0; v < V; ++v) kl_rev += std::exp(b[v] - lseb) * ((b[v] - lseb) - (a[v] - lsea));
    for (int64_t v = 0; v < V; ++v) {
      const double logp = a[v] - lsea, logq = b[v] - lseb, p = std::exp(logp), q = std::exp(logq);
      if (!reverse) r.kl += p * (logp - logq);
      const double g_kl = reverse ? q * (logq - logp - kl_rev) : q - p;
      const double g = kl_scale * g_kl + ntp_scale * (q - (v == y ? 1.0 : 0.0));
      for (int64_t d = 0; d < D; ++d) r.grad[static_cast<size_t>(t * D + d)] += g * W[static_cast<size_t>(v * D + d)];
    }
    if (reverse) r.kl += kl_rev;
    r.ntp += -(b[y] - lseb);
  }
  return r;
}

Tensor randn(const Shape& shape, std::mt19937_64& rng, double stddev) {
  std::normal_distribution<float> nd(0.0f, static_cast<float>(stddev));
  Tensor t = Tensor::empty(shape, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = nd(rng);
  return t;
}

// A problem: documents with a padding run and non-target tokens, so the loss positions have gaps.
struct Problem {
  int64_t T, D, V;
  Tensor teacher, student, lm_head, ids, doc, target_mask, mask;
};

Problem make_problem(int64_t T, int64_t D, int64_t V, double logit_scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Problem p{T, D, V, {}, {}, {}, {}, {}, {}, {}};
  p.teacher = randn({T, D}, rng, 1.0);
  p.student = Tensor::empty({T, D}, DType::F32);
  const Tensor noise = randn({T, D}, rng, 0.6);
  for (int64_t i = 0; i < T * D; ++i)
    p.student.data<float>()[i] = p.teacher.data<float>()[i] + noise.data<float>()[i];
  p.lm_head = randn({V, D}, rng, logit_scale / std::sqrt(double(D)));
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(V - 1));
  std::vector<int32_t> ids(static_cast<size_t>(T)), doc(static_cast<size_t>(T));
  std::vector<uint8_t> tm(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    ids[static_cast<size_t>(t)] = tok(rng);
    // documents of 7 tokens, tokens 9..11 padding, every 5th token not a target
    doc[static_cast<size_t>(t)] = (t >= 9 && t <= 11) ? -1 : static_cast<int32_t>(t / 7);
    tm[static_cast<size_t>(t)] = t % 5 == 3 ? 0 : 1;
  }
  p.ids = Tensor::from_vector(ids, {T});
  p.doc = Tensor::from_vector(doc, {T});
  p.target_mask = Tensor::from_vector(tm, {T});
  p.mask = loss_positions(p.doc, p.target_mask);
  return p;
}

struct Got {
  QualitySums sums;
  Tensor grad;
};

Got run(const Problem& p, int64_t chunk, double kl_scale, double ntp_scale, bool reverse = false) {
  Got g;
  g.grad = Tensor::empty({p.T, p.D}, DType::F32);
  for (int64_t i = 0; i < g.grad.numel(); ++i) g.grad.data<float>()[i] = 123.0f;  // must be overwritten
  g.sums = kl_ntp_chunked(p.teacher, p.student, p.lm_head, p.ids, p.mask, chunk, kl_scale, ntp_scale, &g.grad,
                          reverse ? KlDirection::reverse : KlDirection::forward);
  return g;
}

double rel(double got, double want) { return std::fabs(got - want) / std::max(std::fabs(want), 1e-300); }

// max |got − want| / max |want| over the whole gradient
double grad_err(const Tensor& got, const std::vector<double>& want) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::fabs(got.data<float>()[i] - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  return err / scale;
}

void expect_matches_reference(const Problem& p, double kl_scale, double ntp_scale, double tol,
                              bool reverse = false) {
  const Ref ref = reference(to64(p.teacher), to64(p.student), to64(p.lm_head), p.T, p.D, p.V, p.ids, p.mask,
                            kl_scale, ntp_scale, reverse);
  ASSERT_GT(ref.positions, 0);
  ASSERT_GT(ref.kl, 0.01 * static_cast<double>(ref.positions));  // the distributions really differ
  for (int64_t chunk : {int64_t{1}, int64_t{3}, p.T, p.T + 5}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    const Got g = run(p, chunk, kl_scale, ntp_scale, reverse);
    EXPECT_EQ(g.sums.positions, ref.positions);
    EXPECT_LT(rel(g.sums.kl, ref.kl), tol) << g.sums.kl << " vs " << ref.kl;
    EXPECT_LT(rel(g.sums.ntp, ref.ntp), tol) << g.sums.ntp << " vs " << ref.ntp;
    EXPECT_LT(grad_err(g.grad, ref.grad), tol);
    for (int64_t t = 0; t < p.T; ++t) {  // rows without a loss position are exactly 0
      if (p.mask.data<uint8_t>()[t]) continue;
      for (int64_t d = 0; d < p.D; ++d) ASSERT_EQ(g.grad.data<float>()[t * p.D + d], 0.0f) << "row " << t;
    }
  }
}

}  // namespace

TEST(LossPositions, NextTokenInSameDocumentAndTarget) {
  //                          t: 0  1  2  3   4   5  6  7  8  9
  const Tensor doc = Tensor::from_vector(std::vector<int32_t>{0, 0, 0, 1, -1, -1, 2, 2, 2, 2}, {10});
  const Tensor tm = Tensor::from_vector(std::vector<uint8_t>{1, 1, 0, 1, 1, 1, 0, 1, 1, 0}, {10});
  const Tensor m = loss_positions(doc, tm);
  // 0: next (1) same doc, target → 1; 1: next (2) not a target → 0; 2: next in doc 1 → 0;
  // 3: next is padding → 0; 4, 5: padding → 0; 6, 7: → 1; 8: next not a target → 0; 9: last → 0.
  const std::vector<uint8_t> want{1, 0, 0, 0, 0, 0, 1, 1, 0, 0};
  for (int64_t t = 0; t < 10; ++t) EXPECT_EQ(m.data<uint8_t>()[t], want[static_cast<size_t>(t)]) << "t " << t;
  EXPECT_EQ(loss_positions(Tensor::zeros({0}, DType::I32), Tensor::zeros({0}, DType::U8)).numel(), 0);
}

TEST(KlNtpChunked, MatchesFloat64ReferenceForEveryChunkSize) {
  const Problem p = make_problem(29, 16, 300, 4.0, 11);
  expect_matches_reference(p, 0.5, 0.5, 5e-6);
  expect_matches_reference(p, 1.0, 0.0, 5e-6);  // each part alone
  expect_matches_reference(p, 0.0, 1.0, 5e-6);
  expect_matches_reference(p, 0.7, 0.3, 5e-6);
}

TEST(KlNtpChunked, VocabularyOfSeveralBlocks) {
  // V spans three 4096-logit reduction blocks, the last one partial.
  const Problem p = make_problem(17, 8, 9000, 4.0, 12);
  expect_matches_reference(p, 0.6, 0.4, 5e-6);
}

TEST(KlNtpChunked, SharpDistributionsStayFinite) {
  // Logits spread over hundreds: exp without the max subtraction would overflow.
  const Problem p = make_problem(15, 8, 200, 120.0, 13);
  expect_matches_reference(p, 0.5, 0.5, 1e-4);
}

TEST(KlNtpChunked, ReverseKlMatchesFloat64Reference) {
  const Problem p = make_problem(29, 16, 300, 4.0, 11);
  expect_matches_reference(p, 0.5, 0.5, 5e-6, true);
  expect_matches_reference(p, 1.0, 0.0, 5e-6, true);
  expect_matches_reference(p, 0.7, 0.3, 5e-6, true);
  expect_matches_reference(make_problem(17, 8, 9000, 4.0, 12), 0.6, 0.4, 5e-6, true);  // several vocabulary blocks
  expect_matches_reference(make_problem(15, 8, 200, 120.0, 13), 0.5, 0.5, 1e-4, true);  // sharp: e underflows
  // The two directions are different losses on the same problem.
  const Got fwd = run(p, 4, 1.0, 0.0), rev = run(p, 4, 1.0, 0.0, true);
  EXPECT_GT(std::fabs(fwd.sums.kl - rev.sums.kl), 1e-3 * fwd.sums.kl);
}

static void expect_gradient_matches_finite_differences(bool reverse) {
  SCOPED_TRACE(reverse ? "reverse KL" : "forward KL");
  const Problem p = make_problem(16, 6, 50, 3.0, 14);
  const double kl_scale = 0.8, ntp_scale = 0.35;
  const Got g = run(p, 4, kl_scale, ntp_scale, reverse);
  const std::vector<double> th = to64(p.teacher), W = to64(p.lm_head);
  std::vector<double> sh = to64(p.student);
  auto loss = [&](const std::vector<double>& s) {
    const Ref r = reference(th, s, W, p.T, p.D, p.V, p.ids, p.mask, kl_scale, ntp_scale, reverse);
    return kl_scale * r.kl + ntp_scale * r.ntp;
  };
  int checked = 0;
  for (int64_t t = 0; t < p.T; ++t) {
    if (!p.mask.data<uint8_t>()[t] && t % 4 != 0) continue;  // every loss row, a few zero rows
    for (int64_t d : {int64_t{0}, int64_t{3}, p.D - 1}) {
      const size_t i = static_cast<size_t>(t * p.D + d);
      const double h = 1e-5, x = sh[i];
      sh[i] = x + h;
      const double up = loss(sh);
      sh[i] = x - h;
      const double down = loss(sh);
      sh[i] = x;
      const double fd = (up - down) / (2 * h);
      EXPECT_NEAR(g.grad.data<float>()[i], fd, 1e-5 + 2e-5 * std::fabs(fd)) << "t " << t << " d " << d;
      ++checked;
    }
  }
  EXPECT_GE(checked, 20);
}

TEST(KlNtpChunked, GradientMatchesFiniteDifferences) {
  expect_gradient_matches_finite_differences(false);
  expect_gradient_matches_finite_differences(true);
}

TEST(KlNtpChunked, ChunkSizesAgreeAndThreadCountsAreBitIdentical) {
  const Problem p = make_problem(40, 32, 5000, 5.0, 15);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const Got one = run(p, 7, 0.5, 0.5);
  omp_set_num_threads(std::max(threads, 3));
  const Got many = run(p, 7, 0.5, 0.5);
  omp_set_num_threads(threads);
  EXPECT_EQ(one.sums.kl, many.sums.kl);
  EXPECT_EQ(one.sums.ntp, many.sums.ntp);
  EXPECT_EQ(std::memcmp(one.grad.raw(), many.grad.raw(), one.grad.nbytes()), 0);
  for (int64_t chunk : {int64_t{1}, int64_t{2}, int64_t{16}, int64_t{1000}}) {
    const Got g = run(p, chunk, 0.5, 0.5);
    EXPECT_LT(rel(g.sums.kl, one.sums.kl), 1e-6) << "chunk " << chunk;
    EXPECT_LT(rel(g.sums.ntp, one.sums.ntp), 1e-6) << "chunk " << chunk;
    std::vector<double> ref(static_cast<size_t>(one.grad.numel()));
    for (size_t i = 0; i < ref.size(); ++i) ref[i] = one.grad.data<float>()[i];
    // The GEMMs round differently for different row counts; through the cancellation in q − p
    // that reaches a few 1e-6 of the largest gradient entry.
    EXPECT_LT(grad_err(g.grad, ref), 1e-5) << "chunk " << chunk;
  }
}

TEST(KlNtpChunked, IdenticalModelsHaveZeroKl) {
  Problem p = make_problem(20, 8, 100, 4.0, 16);
  p.student = p.teacher;
  const Got g = run(p, 3, 1.0, 0.0);
  EXPECT_GT(g.sums.positions, 0);
  EXPECT_NEAR(g.sums.kl, 0.0, 1e-12);
  double worst = 0;
  for (int64_t i = 0; i < g.grad.numel(); ++i) worst = std::max(worst, double(std::fabs(g.grad.data<float>()[i])));
  EXPECT_LT(worst, 1e-6);  // q − p vanishes up to float rounding of p and q
  const Got r = run(p, 3, 1.0, 0.0, true);
  EXPECT_NEAR(r.sums.kl, 0.0, 1e-12);
  for (int64_t i = 0; i < r.grad.numel(); ++i) ASSERT_LT(std::fabs(r.grad.data<float>()[i]), 1e-6f);
}

TEST(KlNtpChunked, KlDirectionNames) {
  EXPECT_EQ(parse_kl_direction("forward"), KlDirection::forward);
  EXPECT_EQ(parse_kl_direction("reverse"), KlDirection::reverse);
  EXPECT_STREQ(kl_direction_name(KlDirection::reverse), "reverse");
  try {
    parse_kl_direction("backward");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "--kl: 'backward' must be forward or reverse");
  }
}

TEST(KlNtpChunked, NoLossPositionsAndNoGradient) {
  Problem p = make_problem(12, 8, 64, 4.0, 17);
  const Tensor none = Tensor::zeros({12}, DType::U8);
  Tensor grad = Tensor::empty({12, 8}, DType::F32);
  for (int64_t i = 0; i < grad.numel(); ++i) grad.data<float>()[i] = 5.0f;
  const QualitySums s = kl_ntp_chunked(p.teacher, p.student, p.lm_head, p.ids, none, 4, 0.5, 0.5, &grad);
  EXPECT_EQ(s.positions, 0);
  EXPECT_EQ(s.kl, 0.0);
  EXPECT_EQ(s.ntp, 0.0);
  for (int64_t i = 0; i < grad.numel(); ++i) ASSERT_EQ(grad.data<float>()[i], 0.0f);
  // Without a gradient buffer the sums are the same as with one.
  const QualitySums with = run(p, 5, 0.5, 0.5).sums;
  const QualitySums without = kl_ntp_chunked(p.teacher, p.student, p.lm_head, p.ids, p.mask, 5, 0.5, 0.5, nullptr);
  EXPECT_EQ(with.kl, without.kl);
  EXPECT_EQ(with.ntp, without.ntp);
  EXPECT_EQ(with.positions, without.positions);
}

TEST(KlNtpChunked, TargetOutsideVocabularyIsAnError) {
  Problem p = make_problem(12, 8, 64, 4.0, 18);
  p.ids = p.ids.clone();
  p.ids.data<int32_t>()[2] = 64;  // position 1 is a loss position (doc 0, target)
  ASSERT_EQ(p.mask.data<uint8_t>()[1], 1);
  try {
    kl_ntp_chunked(p.teacher, p.student, p.lm_head, p.ids, p.mask, 4, 0.5, 0.5, nullptr);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("target id 64 at position 2"), std::string::npos) << e.what();
  }
}

// Not a test: the timing the report quotes. Run with
//   test_trainer_parts --gtest_also_run_disabled_tests --gtest_filter='*Benchmark*'
TEST(KlNtpChunked, DISABLED_Benchmark) {
  const int64_t T = 1024, D = 256, V = 151936, chunk = 128;
  std::mt19937_64 rng(1);
  const Tensor th = randn({T, D}, rng, 1.0), sh = randn({T, D}, rng, 1.0), W = randn({V, D}, rng, 0.25);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) ids[static_cast<size_t>(t)] = static_cast<int32_t>((t * 7919) % V);
  std::vector<uint8_t> m(static_cast<size_t>(T), 1);
  m.back() = 0;
  const Tensor idt = Tensor::from_vector(ids, {T}), mask = Tensor::from_vector(m, {T});
  Tensor grad = Tensor::empty({T, D}, DType::F32);
  for (bool with_grad : {false, true}) {
    const auto t0 = std::chrono::steady_clock::now();
    const QualitySums s = kl_ntp_chunked(th, sh, W, idt, mask, chunk, 0.5, 0.5, with_grad ? &grad : nullptr);
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("kl_ntp_chunked T=%lld V=%lld D=%lld chunk=%lld threads=%d grad=%d: %.3f s (KL/pos %.4f NTP/pos %.4f)\n",
                static_cast<long long>(T), static_cast<long long>(V), static_cast<long long>(D),
                static_cast<long long>(chunk), omp_get_max_threads(), with_grad ? 1 : 0, sec,
                s.kl / double(s.positions), s.ntp / double(s.positions));
  }
}
