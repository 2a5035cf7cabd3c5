// ops::kl_ntp_chunked on CUDA tensors (kernels/cuda/loss.cu, the GEMMs through ops::linear*)
// against the same function on CPU tensors, on fresh random problems per run (the seed is printed
// with every failure; RETAIN_TEST_SEED=n replays one): F32 and BF16 lm_head (BF16 against the CPU
// on the bf16-rounded lm_head and hidden rows), chunk sizes from 1 to past the position count,
// V up to Qwen3's 151936, sharp distributions. ΣKL, ΣNTP and d_student_hidden within the bounds
// below, rows without a loss position exactly 0, bitwise repeatable; mixed devices, device ids
// and bad targets as one-line errors. Skips (visibly) without a CUDA build or device.
// Not yet run: no GPU has been lent.
//
// Bounds (first order, doubled; u_f = 2^-24). The GEMMs dominate: a logit of either device is
// within (D + 1)u_f·Σ_d|h_d·W_vd| of the exact one (any summation order; for BF16 the bf16
// products are exact in float32), so the two devices' logits differ by Δ_v ≤ 2(D + 1)u_f·M_v;
// Δt, Δs are the row maxima of that for teacher and student. With x = t − s, x̄ = E_p x:
//   dKL = Cov_p(dt, x) + Σ(q − p)·ds   → |ΔKL| ≤ 2Δt·Σ p|x − x̄| + Δs·Σ|q − p|;
//   dNTP = E_q ds − ds_y               → |ΔNTP| ≤ 2Δs;
//   dq_v = q_v(ds_v − E_q ds)          → |Δg_v| ≤ |kl + ntp|·q_v(2Δs + 4u_f) + |kl|·p_v(2Δt + 4u_f)
//                                         + 2u_f|g_v| (the float exponentials and g, both sides);
//   d_student_hidden[d] = Σ_v g_v W_vd → Σ_v|Δg_v||W_vd| + 2(V + 1)u_f·Σ_v|g_v W_vd| (both GEMMs),
//     + 2^-9·Σ_v|g_v W_vd| with BF16 (the GPU rounds the logit gradient to bf16 for the GEMM);
// plus, for the sums, the float64 row reduction (a few 1e-13 relative) and the position sum.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/base/half.h"
#include "kernels/cuda/memory.h"
#include "tests/cuda/cuda_test.h"
#include "tests/error_helpers.h"
#include "kernels/loss.h"

using namespace retain;
using ops::QualitySums;

namespace {

constexpr double kUf = 0x1p-24, kU = 0x1p-53;

using Vec = std::vector<float>;

// A packed sequence as test_loss.cpp builds it: documents of 7 tokens, a padding run, every 5th
// token not a target, so the loss positions have gaps.
struct Problem {
  int64_t T = 0, D = 0, V = 0;
  Vec teacher, student, W;
  Tensor ids, mask;
};

Vec normal(int64_t n, float sd, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, sd);
  Vec v(static_cast<size_t>(n));
  for (float& x : v) x = nd(rng);
  return v;
}

Problem make_problem(int64_t T, int64_t D, int64_t V, double logit_scale, std::mt19937& rng) {
  Problem p;
  p.T = T, p.D = D, p.V = V;
  p.teacher = normal(T * D, 1.0f, rng);
  p.student = p.teacher;
  const Vec noise = normal(T * D, 0.6f, rng);
  for (size_t i = 0; i < noise.size(); ++i) p.student[i] += noise[i];
  p.W = normal(V * D, static_cast<float>(logit_scale / std::sqrt(double(D))), rng);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(V - 1));
  std::vector<int32_t> ids(static_cast<size_t>(T)), doc(static_cast<size_t>(T));
  std::vector<uint8_t> tm(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    ids[t] = tok(rng);
    doc[t] = (t >= 9 && t <= 11) ? -1 : static_cast<int32_t>(t / 7);
    tm[t] = t % 5 == 3 ? 0 : 1;
  }
  p.ids = Tensor::from_vector(ids, {T});
  p.mask = ops::loss_positions(Tensor::from_vector(doc, {T}), Tensor::from_vector(tm, {T}));
  return p;
}

Vec bf16_rounded(const Vec& v) {
  Vec out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_f32(f32_to_bf16(v[i]));
  return out;
}

Tensor bf16_tensor(const Vec& v, const Shape& s) {
  Tensor t = Tensor::empty(s, DType::BF16);
  auto* b = static_cast<uint16_t*>(t.raw());
  for (size_t i = 0; i < v.size(); ++i) b[i] = f32_to_bf16(v[i]);
  return t;
}

struct Result {
  QualitySums sums;
  Vec grad;
};

Result run_cpu(const Problem& p, const Vec& teacher, const Vec& student, const Vec& W, int64_t chunk, double kl_scale,
               double ntp_scale, ops::KlDirection kl = ops::KlDirection::forward) {
  Tensor grad = Tensor::empty({p.T, p.D}, DType::F32);
  Result r;
  r.sums = ops::kl_ntp_chunked(Tensor::from_vector(teacher, {p.T, p.D}), Tensor::from_vector(student, {p.T, p.D}),
                                   Tensor::from_vector(W, {p.V, p.D}), p.ids, p.mask, chunk, kl_scale, ntp_scale,
                                   &grad, kl);
  r.grad.assign(grad.data<float>(), grad.data<float>() + grad.numel());
  return r;
}

// The hidden rows stay F32 (the GPU rounds them to bf16 itself when lm_head is BF16); the
// gradient buffer starts as garbage, which the call must overwrite.
Result run_gpu(const Problem& p, bool bf16, int64_t chunk, double kl_scale, double ntp_scale,
               ops::KlDirection kl = ops::KlDirection::forward) {
  const Tensor th = Tensor::from_vector(p.teacher, {p.T, p.D}).to(Device::CUDA);
  const Tensor sh = Tensor::from_vector(p.student, {p.T, p.D}).to(Device::CUDA);
  const Tensor W = (bf16 ? bf16_tensor(p.W, {p.V, p.D}) : Tensor::from_vector(p.W, {p.V, p.D})).to(Device::CUDA);
  Tensor grad = Tensor::from_vector(Vec(static_cast<size_t>(p.T * p.D), 123.0f), {p.T, p.D}).to(Device::CUDA);
  Result r;
  r.sums = ops::kl_ntp_chunked(th, sh, W, p.ids, p.mask, chunk, kl_scale, ntp_scale, &grad, kl);
  const Tensor host = grad.to(Device::CPU);
  r.grad.assign(host.data<float>(), host.data<float>() + host.numel());
  return r;
}

struct Bounds {
  double kl = 0, ntp = 0;
  std::vector<double> grad;  // [T, D]
};

// The header's bounds from float64 logits of the CPU's inputs.
Bounds bounds(const Problem& p, const Vec& teacher, const Vec& student, const Vec& W, bool bf16, double kl_scale,
              double ntp_scale) {
  const int64_t D = p.D, V = p.V;
  Bounds b;
  b.grad.assign(static_cast<size_t>(p.T * D), 0.0);
  std::vector<double> t(static_cast<size_t>(V)), s(static_cast<size_t>(V)), mt(static_cast<size_t>(V)),
      ms(static_cast<size_t>(V)), g(static_cast<size_t>(V)), dg(static_cast<size_t>(V));
  double abs_kl = 0;
  int64_t P = 0;
  for (int64_t r = 0; r < p.T; ++r) {
    if (!p.mask.data<uint8_t>()[r]) continue;
    ++P;
    const float* hr = teacher.data() + r * D;
    const float* sr = student.data() + r * D;
    double dt = 0, ds = 0;
    for (int64_t v = 0; v < V; ++v) {
      double a = 0, c = 0, ma = 0, mc = 0;
      for (int64_t d = 0; d < D; ++d) {
        const double w = W[v * D + d];
        a += hr[d] * w, c += sr[d] * w, ma += std::fabs(hr[d] * w), mc += std::fabs(sr[d] * w);
      }
      t[v] = a, s[v] = c;
      dt = std::max(dt, 2 * double(D + 1) * kUf * ma);
      ds = std::max(ds, 2 * double(D + 1) * kUf * mc);
    }
    const double max_t = *std::max_element(t.begin(), t.end()), max_s = *std::max_element(s.begin(), s.end());
    double zt = 0, zs = 0;
    for (int64_t v = 0; v < V; ++v) zt += std::exp(t[v] - max_t), zs += std::exp(s[v] - max_s);
    double xbar = 0, kl = 0;
    for (int64_t v = 0; v < V; ++v) {
      const double pv = std::exp(t[v] - max_t) / zt;
      xbar += pv * (t[v] - s[v]);
      kl += pv * ((t[v] - max_t - std::log(zt)) - (s[v] - max_s - std::log(zs)));
    }
    double cov = 0, l1 = 0;
    const double qs = kl_scale + ntp_scale;
    const int64_t y = p.ids.data<int32_t>()[r + 1];
    for (int64_t v = 0; v < V; ++v) {
      const double pv = std::exp(t[v] - max_t) / zt, qv = std::exp(s[v] - max_s) / zs;
      cov += pv * std::fabs(t[v] - s[v] - xbar);
      l1 += std::fabs(qv - pv);
      g[v] = qs * qv - kl_scale * pv - (v == y ? ntp_scale : 0.0);
      dg[v] = std::fabs(qs) * qv * (2 * ds + 4 * kUf) + std::fabs(kl_scale) * pv * (2 * dt + 4 * kUf) +
              2 * kUf * std::fabs(g[v]) + 0x1p-148;
    }
    // the float64 row reductions of both devices: ~(V + 10)u of the magnitudes involved
    const double lse_t = max_t + std::log(zt), lse_s = max_s + std::log(zs);
    const double rows64 = 4 * double(V + 10) * kU * (cov + std::fabs(xbar) + std::fabs(lse_t) + std::fabs(lse_s) + 1);
    b.kl += 2 * (2 * dt * cov + ds * l1) + rows64;
    b.ntp += 2 * (2 * ds) + rows64;
    abs_kl += std::fabs(kl) + std::fabs(lse_s - s[y]);
    const double gemm = 2 * double(V + 1) * kUf + (bf16 ? 0x1p-9 : 0.0);
    for (int64_t d = 0; d < D; ++d) {
      double e = 0, m = 0;
      for (int64_t v = 0; v < V; ++v) {
        const double w = std::fabs(W[v * D + d]);
        e += dg[v] * w, m += std::fabs(g[v]) * w;
      }
      b.grad[r * D + d] = 2 * (e + gemm * m) + 1e-30;
    }
  }
  // the position sums (same order, different addends)
  b.kl += 2 * double(P) * kU * abs_kl;
  b.ntp += 2 * double(P) * kU * abs_kl;
  return b;
}

void expect_grad_close(const Vec& got, const Vec& want, const std::vector<double>& tol, const Problem& p,
                       const std::string& what) {
  int64_t bad = 0;
  std::string first;
  for (int64_t i = 0; i < p.T * p.D; ++i) {
    const int64_t r = i / p.D;
    if (!p.mask.data<uint8_t>()[r]) {  // rows without a loss position: exactly 0
      if (got[i] != 0.0f && bad++ < 3) first += fmt::format(" [{}] {} in a row without a loss position;", i, got[i]);
      continue;
    }
    if (!(std::fabs(double(got[i]) - want[i]) <= tol[i]) && bad++ < 3)
      first += fmt::format(" [{}, {}] got {:.9g} want {:.9g} tol {:.3g};", r, i % p.D, got[i], want[i], tol[i]);
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " gradient entries wrong:" << first;
}

class LossCuda : public cuda_test::SeededTest {
 protected:
  // Every chunk size against the CPU (chunk 1 on the CPU side: its own result is chunk-invariant
  // up to its GEMM rounding, which the bound covers).
  void check(const Problem& p, bool bf16, double kl_scale, double ntp_scale, const std::vector<int64_t>& chunks) {
    const Vec th = bf16 ? bf16_rounded(p.teacher) : p.teacher, sh = bf16 ? bf16_rounded(p.student) : p.student,
              W = bf16 ? bf16_rounded(p.W) : p.W;
    const Result want = run_cpu(p, th, sh, W, 7, kl_scale, ntp_scale);
    ASSERT_GT(want.sums.positions, 0);
    const Bounds b = bounds(p, th, sh, W, bf16, kl_scale, ntp_scale);
    for (int64_t chunk : chunks) {
      const std::string what = fmt::format("T {} D {} V {} {} chunk {} scales {} {}", p.T, p.D, p.V,
                                           bf16 ? "BF16" : "F32", chunk, kl_scale, ntp_scale);
      SCOPED_TRACE(what);
      const Result got = run_gpu(p, bf16, chunk, kl_scale, ntp_scale);
      EXPECT_EQ(got.sums.positions, want.sums.positions);
      EXPECT_NEAR(got.sums.kl, want.sums.kl, b.kl);
      EXPECT_NEAR(got.sums.ntp, want.sums.ntp, b.ntp);
      expect_grad_close(got.grad, want.grad, b.grad, p, what);
    }
  }
};

// Fails without a device: run_sanitizer.sh uses it to skip (exit 77) on machines without one.
TEST_F(LossCuda, DISABLED_DevicePresent) { ASSERT_GT(cuda_device_count(), 0); }

TEST_F(LossCuda, F32LmHeadMatchesCpu) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  const Problem p = make_problem(37, 24, 1000, 4.0, rng_);
  check(p, false, 0.5, 0.5, {1, 3, 16, 37, 50});
  check(p, false, 1.0, 0.0, {5});
  check(p, false, 0.0, 1.0, {5});
}

TEST_F(LossCuda, Bf16LmHeadMatchesCpuOnRoundedInputs) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  const Problem p = make_problem(37, 24, 1000, 4.0, rng_);
  check(p, true, 0.5, 0.5, {1, 4, 37});
  check(p, true, 0.7, 0.3, {8});
}

TEST_F(LossCuda, VocabularyNotAMultipleOfTheBlock) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  for (int64_t V : {1, 255, 257, 4097}) {
    const Problem p = make_problem(15, 8, V, 4.0, rng_);
    check(p, false, 0.6, 0.4, {4, 15});
  }
}

TEST_F(LossCuda, QwenVocabulary) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  const Problem p = make_problem(14, 16, 151936, 4.0, rng_);
  check(p, false, 0.5, 0.5, {3});
  check(p, true, 0.5, 0.5, {14});
}

TEST_F(LossCuda, SharpDistributions) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  const Problem p = make_problem(15, 8, 300, 120.0, rng_);
  check(p, false, 0.5, 0.5, {2, 15});
}

// KL(q‖p) (retain-train --kl reverse) on the device against the CPU: the row kernel's formulas
// are tests/cuda/test_loss_rows.cpp's (against long double); here the plumbing, with a plain
// tolerance (both sides' float64 sums and float32 GEMMs: ~1e-6 of the largest entry).
TEST_F(LossCuda, ReverseKlMatchesCpu) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  for (int64_t V : {257, 4097}) {
    const Problem p = make_problem(23, 16, V, 4.0, rng_);
    for (int64_t chunk : {int64_t{1}, int64_t{5}, int64_t{23}}) {
      SCOPED_TRACE(fmt::format("V {} chunk {}", V, chunk));
      const Result want = run_cpu(p, p.teacher, p.student, p.W, 7, 0.6, 0.4, ops::KlDirection::reverse);
      const Result fwd = run_cpu(p, p.teacher, p.student, p.W, 7, 0.6, 0.4);
      const Result got = run_gpu(p, false, chunk, 0.6, 0.4, ops::KlDirection::reverse);
      ASSERT_GT(want.sums.positions, 0);
      EXPECT_GT(std::fabs(want.sums.kl - fwd.sums.kl), 1e-4 * fwd.sums.kl) << "reverse is another loss";
      EXPECT_NEAR(got.sums.kl, want.sums.kl, 1e-6 * (1 + std::fabs(want.sums.kl)));
      EXPECT_NEAR(got.sums.ntp, want.sums.ntp, 1e-6 * (1 + std::fabs(want.sums.ntp)));
      double scale = 0;
      for (float g : want.grad) scale = std::max(scale, double(std::fabs(g)));
      std::vector<double> tol(want.grad.size(), 1e-5 * scale);
      expect_grad_close(got.grad, want.grad, tol, p, "reverse KL");
    }
  }
}

// The loss never holds [T, V] (docs/memory-plan.md, item 4): what a call adds to the device
// pool's high-water mark is one chunk's buffers — teacher and student hidden rows and the
// gradient rows [C, D], teacher and student logits [C, V], all F32 — plus the position list
// (int32 [2, P]) and the per-row losses (float64 [2, P]): at most 64 KiB above (a driver may
// round allocations up), 16 KiB below. A warm-up call first: the GEMM staging (bf16 rows of
// the largest GEMM input) grows once and stays. With T = 512 and V = 5000, one [T, V] F32
// buffer (10 MB) would be 4× the whole budget.
TEST_F(LossCuda, HoldsOneChunkOfLogits) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  const Problem p = make_problem(512, 32, 5000, 4.0, rng_);
  for (bool bf16 : {false, true}) {
    const int64_t C = 64;
    const Tensor th = Tensor::from_vector(p.teacher, {p.T, p.D}).to(Device::CUDA);
    const Tensor sh = Tensor::from_vector(p.student, {p.T, p.D}).to(Device::CUDA);
    const Tensor W = (bf16 ? bf16_tensor(p.W, {p.V, p.D}) : Tensor::from_vector(p.W, {p.V, p.D})).to(Device::CUDA);
    Tensor grad = Tensor::empty({p.T, p.D}, DType::F32, Device::CUDA);
    const QualitySums warm = ops::kl_ntp_chunked(th, sh, W, p.ids, p.mask, C, 0.5, 0.5, &grad);
    cuda::synchronize();
    const size_t before = cuda::device_memory_stats().in_use;
    cuda::reset_device_memory_peak();
    const QualitySums got = ops::kl_ntp_chunked(th, sh, W, p.ids, p.mask, C, 0.5, 0.5, &grad);
    cuda::synchronize();
    const cuda::DeviceMemoryStats after = cuda::device_memory_stats();
    EXPECT_EQ(got.kl, warm.kl);
    EXPECT_EQ(after.in_use, before) << "the loss left device memory behind";
    const int64_t P = got.positions, added = static_cast<int64_t>(after.peak - before);
    const int64_t plan = 3 * C * p.D * 4 + 2 * C * p.V * 4 + 2 * P * 4 + 2 * P * 8;
    EXPECT_LE(added, plan + (64 << 10)) << (bf16 ? "BF16" : "F32") << " lm_head";
    EXPECT_GE(added, plan - (16 << 10)) << (bf16 ? "BF16" : "F32") << " lm_head";
    std::printf("%s lm_head: the loss adds %lld bytes (plan %lld; one [T, V] F32 is %lld)\n", bf16 ? "BF16" : "F32",
                static_cast<long long>(added), static_cast<long long>(plan), static_cast<long long>(p.T * p.V * 4));
  }
}

TEST_F(LossCuda, BitwiseRepeatableAndNoGradientSameSums) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  const Problem p = make_problem(40, 32, 5000, 5.0, rng_);
  for (bool bf16 : {false, true}) {
    const Result a = run_gpu(p, bf16, 7, 0.5, 0.5), b = run_gpu(p, bf16, 7, 0.5, 0.5);
    EXPECT_EQ(a.sums.kl, b.sums.kl);
    EXPECT_EQ(a.sums.ntp, b.sums.ntp);
    EXPECT_EQ(std::memcmp(a.grad.data(), b.grad.data(), a.grad.size() * sizeof(float)), 0) << "bf16 " << bf16;
    // Without a gradient buffer: the same sums (the third pass is skipped, nothing else changes).
    const Tensor th = Tensor::from_vector(p.teacher, {p.T, p.D}).to(Device::CUDA);
    const Tensor sh = Tensor::from_vector(p.student, {p.T, p.D}).to(Device::CUDA);
    const Tensor W = (bf16 ? bf16_tensor(p.W, {p.V, p.D}) : Tensor::from_vector(p.W, {p.V, p.D})).to(Device::CUDA);
    const QualitySums c = ops::kl_ntp_chunked(th, sh, W, p.ids, p.mask, 7, 0.5, 0.5, nullptr);
    EXPECT_EQ(c.kl, a.sums.kl);
    EXPECT_EQ(c.ntp, a.sums.ntp);
    EXPECT_EQ(c.positions, a.sums.positions);
  }
}

TEST_F(LossCuda, NoLossPositions) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  Problem p = make_problem(12, 8, 64, 4.0, rng_);
  p.mask = Tensor::zeros({12}, DType::U8);
  const Result r = run_gpu(p, false, 4, 0.5, 0.5);
  EXPECT_EQ(r.sums.positions, 0);
  EXPECT_EQ(r.sums.kl, 0.0);
  EXPECT_EQ(r.sums.ntp, 0.0);
  for (float g : r.grad) ASSERT_EQ(g, 0.0f);
}

// One-line errors, before any launch.
TEST_F(LossCuda, BadInputs) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  const Problem p = make_problem(12, 8, 64, 4.0, rng_);
  const Tensor th = Tensor::from_vector(p.teacher, {p.T, p.D}), sh = Tensor::from_vector(p.student, {p.T, p.D});
  const Tensor W = Tensor::from_vector(p.W, {p.V, p.D});
  const Tensor thd = th.to(Device::CUDA), shd = sh.to(Device::CUDA), Wd = W.to(Device::CUDA);
  Tensor grad_cpu = Tensor::empty({p.T, p.D}, DType::F32);
  test_support::expect_one_line_error([&] { ops::kl_ntp_chunked(thd, shd, W, p.ids, p.mask, 4, 0.5, 0.5, nullptr); }, "one device");
  test_support::expect_one_line_error([&] { ops::kl_ntp_chunked(thd, sh, Wd, p.ids, p.mask, 4, 0.5, 0.5, nullptr); }, "one device");
  test_support::expect_one_line_error([&] { ops::kl_ntp_chunked(thd, shd, Wd, p.ids, p.mask, 4, 0.5, 0.5, &grad_cpu); }, "one device");
  test_support::expect_one_line_error([&] { ops::kl_ntp_chunked(thd, shd, Wd, p.ids.to(Device::CUDA), p.mask, 4, 0.5, 0.5, nullptr); },
               "CPU tensors");
  Tensor ids = p.ids.clone();
  int64_t t = 0;
  while (!p.mask.data<uint8_t>()[t]) ++t;
  ids.data<int32_t>()[t + 1] = 64;
  test_support::expect_one_line_error([&] { ops::kl_ntp_chunked(thd, shd, Wd, ids, p.mask, 4, 0.5, 0.5, nullptr); },
               fmt::format("target id 64 at position {}", t + 1));
}

}  // namespace
