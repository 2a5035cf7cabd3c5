// The row kernel of the CUDA fused KL + NTP loss (kernels/cuda/loss.cu) run on the CPU, in every
// build: kernels/cuda/loss_rows.h's functions called in the kernel's order — kLossThreads
// strided partials per row, the fixed pairwise tree over them, thread 0's losses, each thread's
// gradient writes over the student logits — on random logit rows (V from 1 to 40000, not
// multiples of the block; logits spread over 1e4 and offset by 5e3; targets at block edges).
// Checked, per row, against
//   - a long-double reference (softmax by definition), within the bound below;
//   - the CPU ops::kl_ntp_chunked (per-row KL and NTP, and the logit gradient itself,
//     read exactly out of d_student_hidden through one-hot lm_head columns), within the sum of
//     both orders' bounds — and bit for bit where every sum is exact.
// What the emulation cannot check is the CUDA plumbing (launches, barriers, shared memory, the
// gather/scatter and the GEMMs); tests/cuda/test_loss_cuda.cpp does, on a GPU.
//
// Bound (u = 2^-53, u_f = 2^-24; h roundings on a sum's longest path: ⌈V/kLossThreads⌉ +
// log2 kLossThreads for the kernel, min(V, 4096) + ⌈V/4096⌉ for the CPU; first order, doubled):
//   e_v = exp(x_v − m): (|x_v − m| + 2)u relative (the subtraction's rounding through exp, and
//     exp's 1 ulp);
//   Z: u·Σ e_v(|x_v − m| + 2 + h);  A = Σ e_t(t − s): u·Σ e_t|t − s|(|t − m_t| + 4 + h);
//   lse = m + log Z: δZ/Z + 2u|log Z| + u|lse|;  A/Z_t: δA/Z_t + |A/Z_t|(δZ_t/Z_t + u);
//   KL = A/Z_t − lse_t + lse_s: the three above + 2u(|A/Z_t| + |lse_t| + |lse_s|);
//   NTP = lse_s − s_y: δlse_s + u|NTP|;
//   g_v = q·(ê_s/Z_s) − kl·(ê_t/Z_t) [− ntp], ê = float(e): |q|q_v(u_f + δe_s + δZ_s/Z_s + 3u)
//     + |kl|p_v(same for t) + 2u(|q|q_v + |kl|p_v + |ntp|) + u_f|g_v| + 2^-150(|q|/Z_s + |kl|/Z_t + 1)
//     (the last for exponentials and gradients below float's normal range).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/cuda/loss_rows.h"
#include "tests/cuda/cuda_test.h"
#include "kernels/loss.h"

using namespace retain;
namespace lr = retain::cuda::loss_rows;

namespace {

constexpr double kU = 0x1p-53, kUf = 0x1p-24;

struct Row {
  std::vector<float> t, s;  // teacher and student logits
  int32_t y = 0;            // target
  std::string what;
  int64_t V() const { return static_cast<int64_t>(t.size()); }
};

struct RowResult {
  double kl = 0, ntp = 0;
  std::vector<float> grad;  // [V]
};

// ---- the kernel, emulated --------------------------------------------------------------------

// kl_ntp_rows_kernel for one row (one block): thread 0 reads s_y before the first barrier; the
// max and the sums each as kLossThreads strided partials and the tree; then every thread
// rewrites the student logits it owns with their gradient.
RowResult kernel_emulated(const Row& row, double kl_scale, double ntp_scale, bool reverse = false) {
  const int64_t V = row.V();
  std::vector<float> s = row.s;
  const float* t = row.t.data();
  const double sy = s[static_cast<size_t>(row.y)];
  std::vector<lr::RowMax> maxes(lr::kLossThreads);
  for (int tid = 0; tid < lr::kLossThreads; ++tid) maxes[tid] = lr::row_max_partial(t, s.data(), V, tid);
  for (int st = lr::kLossThreads / 2; st > 0; st >>= 1)
    for (int tid = 0; tid < st; ++tid) lr::fold_max(maxes.data(), tid, st);
  const double mt = maxes[0].t, ms = maxes[0].s;
  std::vector<lr::RowSums> sums(lr::kLossThreads);
  for (int tid = 0; tid < lr::kLossThreads; ++tid) sums[tid] = lr::row_sums_partial(t, s.data(), V, mt, ms, tid);
  for (int st = lr::kLossThreads / 2; st > 0; st >>= 1)
    for (int tid = 0; tid < st; ++tid) lr::fold_sums(sums.data(), tid, st);
  const lr::RowLoss loss = lr::row_loss(sums[0], mt, ms, sy, reverse);
  const double inv_zt = 1.0 / sums[0].zt, inv_zs = 1.0 / sums[0].zs;
  const lr::GradScales c = lr::grad_scales(kl_scale, ntp_scale, reverse);
  for (int tid = 0; tid < lr::kLossThreads; ++tid)
    for (int64_t v = tid; v < V; v += lr::kLossThreads)
      s[static_cast<size_t>(v)] =
          lr::gradient_at(t[v], s[static_cast<size_t>(v)], mt, ms, inv_zt, inv_zs, v == row.y, c, loss.log_ratio);
  return {loss.kl, loss.ntp, std::move(s)};
}

// ---- the CPU loss on the same row --------------------------------------------------------------

// ops::kl_ntp_chunked on T = 2 tokens, one loss position, with lm_head [V, 2 + probes]:
// columns 0 and 1 are the teacher and student logits, selected by the hidden rows (1, 0, 0, ...)
// and (0, 1, 0, ...), so the GEMM reproduces them exactly (products with 1 and 0, sums with 0);
// column 2 + j is one-hot at probes[j], so d_student_hidden[0, 2 + j] = g[probes[j]] exactly.
struct CpuRow {
  double kl = 0, ntp = 0;
  std::vector<float> probed;  // g at the probes
};
CpuRow cpu_row(const Row& row, const std::vector<int64_t>& probes, double kl_scale, double ntp_scale,
               bool reverse = false) {
  const int64_t V = row.V(), D = 2 + static_cast<int64_t>(probes.size());
  Tensor W = Tensor::zeros({V, D}, DType::F32), th = Tensor::zeros({2, D}, DType::F32),
         sh = Tensor::zeros({2, D}, DType::F32), grad = Tensor::empty({2, D}, DType::F32);
  float* w = W.data<float>();
  for (int64_t v = 0; v < V; ++v) {
    w[v * D] = row.t[static_cast<size_t>(v)];
    w[v * D + 1] = row.s[static_cast<size_t>(v)];
  }
  for (size_t j = 0; j < probes.size(); ++j) w[probes[j] * D + 2 + static_cast<int64_t>(j)] = 1.0f;
  th.data<float>()[0] = 1.0f;
  sh.data<float>()[1] = 1.0f;
  const Tensor ids = Tensor::from_vector(std::vector<int32_t>{0, row.y}, {2});
  const Tensor mask = Tensor::from_vector(std::vector<uint8_t>{1, 0}, {2});
  const ops::QualitySums q = ops::kl_ntp_chunked(th, sh, W, ids, mask, 1, kl_scale, ntp_scale, &grad,
                                                 reverse ? ops::KlDirection::reverse : ops::KlDirection::forward);
  EXPECT_EQ(q.positions, 1);
  CpuRow out{q.kl, q.ntp, {}};
  for (size_t j = 0; j < probes.size(); ++j) out.probed.push_back(grad.data<float>()[2 + static_cast<int64_t>(j)]);
  return out;
}

// ---- reference and bound ---------------------------------------------------------------------

using LD = long double;

struct Reference {
  double kl = 0, ntp = 0;
  std::vector<double> grad, p, q;
};

Reference reference(const Row& row, double kl_scale, double ntp_scale) {
  const int64_t V = row.V();
  LD mt = row.t[0], ms = row.s[0];
  for (int64_t v = 1; v < V; ++v) mt = std::max<LD>(mt, row.t[v]), ms = std::max<LD>(ms, row.s[v]);
  LD zt = 0, zs = 0;
  for (int64_t v = 0; v < V; ++v) zt += std::exp(LD(row.t[v]) - mt), zs += std::exp(LD(row.s[v]) - ms);
  const LD lse_t = mt + std::log(zt), lse_s = ms + std::log(zs);
  Reference r;
  LD kl = 0, comp = 0;  // Neumaier: the terms have both signs
  for (int64_t v = 0; v < V; ++v) {
    const LD logp = LD(row.t[v]) - lse_t, logq = LD(row.s[v]) - lse_s, p = std::exp(logp), q = std::exp(logq);
    const LD term = p * (logp - logq), sum = kl + term;
    comp += std::fabs(kl) >= std::fabs(term) ? (kl - sum) + term : (term - sum) + kl;
    kl = sum;
    r.p.push_back(double(p));
    r.q.push_back(double(q));
    r.grad.push_back(double(LD(kl_scale) * (q - p) + LD(ntp_scale) * (q - (v == row.y ? 1 : 0))));
  }
  r.kl = double(kl + comp);
  r.ntp = double(lse_s - LD(row.s[static_cast<size_t>(row.y)]));
  return r;
}

// Roundings on a sum's longest path.
double kernel_depth(int64_t V) { return std::ceil(double(V) / lr::kLossThreads) + lr::kLossTreeLevels; }
double cpu_depth(int64_t V) { return double(std::min<int64_t>(V, 4096)) + std::ceil(double(V) / 4096); }

struct Bound {
  double kl = 0, ntp = 0;
  std::vector<double> grad;
};

// The header's bound for a reduction of depth h (doubled).
Bound bound(const Row& row, const Reference& ref, double h, double kl_scale, double ntp_scale) {
  const int64_t V = row.V();
  double mt = row.t[0], ms = row.s[0];
  for (int64_t v = 1; v < V; ++v) mt = std::max<double>(mt, row.t[v]), ms = std::max<double>(ms, row.s[v]);
  double zt = 0, zs = 0, ezt = 0, ezs = 0, ea = 0, a = 0;
  std::vector<double> dt(static_cast<size_t>(V)), ds(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v) {
    dt[v] = std::fabs(row.t[v] - mt), ds[v] = std::fabs(row.s[v] - ms);
    const double et = std::exp(-dt[v]), es = std::exp(-ds[v]), diff = double(row.t[v]) - double(row.s[v]);
    zt += et, zs += es, a += et * diff;
    ezt += et * (dt[v] + 2 + h), ezs += es * (ds[v] + 2 + h), ea += et * std::fabs(diff) * (dt[v] + 4 + h);
  }
  const double rzt = ezt * kU / zt, rzs = ezs * kU / zs, a_over = a / zt;
  const double lse_t = mt + std::log(zt), lse_s = ms + std::log(zs);
  const double e_lse_t = rzt + 2 * kU * std::fabs(std::log(zt)) + kU * std::fabs(lse_t);
  const double e_lse_s = rzs + 2 * kU * std::fabs(std::log(zs)) + kU * std::fabs(lse_s);
  const double e_a = ea * kU / zt + std::fabs(a_over) * (rzt + kU);
  Bound b;
  b.kl = 2 * (e_a + e_lse_t + e_lse_s + 2 * kU * (std::fabs(a_over) + std::fabs(lse_t) + std::fabs(lse_s))) + 1e-300;
  b.ntp = 2 * (e_lse_s + kU * std::fabs(ref.ntp)) + 1e-300;
  const double qs = kl_scale + ntp_scale;
  b.grad.resize(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v) {
    const double eq = kUf + (ds[v] + 2) * kU + rzs + 3 * kU, ep = kUf + (dt[v] + 2) * kU + rzt + 3 * kU;
    const double tq = std::fabs(qs) * ref.q[v], tp = std::fabs(kl_scale) * ref.p[v];
    b.grad[v] = 2 * (tq * eq + tp * ep + 2 * kU * (tq + tp + std::fabs(ntp_scale)) + kUf * std::fabs(ref.grad[v]) +
                     0x1p-150 * (std::fabs(qs) / zs + std::fabs(kl_scale) / zt + 1));
  }
  return b;
}

// ---- the rows ---------------------------------------------------------------------------------

enum class Kind { Normal, Huge, Offset, Same, Sharp };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Normal: return "normal";
    case Kind::Huge: return "huge range";
    case Kind::Offset: return "offset 5e3";
    case Kind::Same: return "teacher = student";
    default: return "sharp";
  }
}

Row make_row(Kind kind, int64_t V, int32_t y, std::mt19937& rng) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> scale(-1.0f, 1.3f);
  std::uniform_int_distribution<int64_t> pick(0, V - 1);
  Row r;
  r.t.resize(static_cast<size_t>(V));
  r.s.resize(static_cast<size_t>(V));
  const float sigma = std::pow(10.0f, scale(rng));  // 0.1 to 20
  for (int64_t v = 0; v < V; ++v) {
    r.t[v] = sigma * n(rng);
    r.s[v] = r.t[v] + 0.5f * sigma * n(rng);
  }
  switch (kind) {
    case Kind::Huge:  // a few logits at ±1e4 and ±3e4 among O(1) ones: most exponentials vanish
      for (int i = 0; i < 6; ++i) {
        const float big = (i % 2 ? 3e4f : 1e4f) * (i % 3 ? 1.0f : -1.0f);
        r.t[pick(rng)] = big;
        r.s[pick(rng)] = big * (0.5f + 0.1f * static_cast<float>(i));
      }
      break;
    case Kind::Offset:  // lse near 5e3: KL cancels between large numbers
      for (int64_t v = 0; v < V; ++v) r.t[v] += 5e3f, r.s[v] += 5e3f;
      break;
    case Kind::Same: r.s = r.t; break;
    case Kind::Sharp:  // one logit far above the rest in each distribution
      r.t[pick(rng)] += 80.0f;
      r.s[pick(rng)] += 60.0f;
      break;
    default: break;
  }
  r.y = y;
  r.what = fmt::format("V {} {} sigma {:.3g} target {}", V, kind_name(kind), sigma, y);
  return r;
}

// Targets at the kernel's and the CPU's block edges, the ends, and the teacher's argmax.
std::vector<int32_t> targets_for(int64_t V, std::mt19937& rng) {
  const int64_t any = std::uniform_int_distribution<int64_t>(0, V - 1)(rng);
  std::set<int64_t> ys{0, V - 1, 255, 256, 257, 4095, 4096, 4097, any};
  std::vector<int32_t> out;
  for (int64_t y : ys)
    if (y < V) out.push_back(static_cast<int32_t>(y));
  return out;
}

// Every logit for small V; otherwise the block edges, the ends, the target, the argmaxes and
// 40 random ones.
std::vector<int64_t> probes_for(const Row& row, std::mt19937& rng) {
  const int64_t V = row.V();
  std::set<int64_t> p;
  if (V <= 600) {
    for (int64_t v = 0; v < V; ++v) p.insert(v);
  } else {
    for (int64_t v : {int64_t{0}, int64_t{1}, int64_t{255}, int64_t{256}, int64_t{257}, int64_t{4095}, int64_t{4096},
                      int64_t{4097}, V - 2, V - 1, int64_t{row.y} - 1, int64_t{row.y}, int64_t{row.y} + 1})
      if (v >= 0 && v < V) p.insert(v);
    p.insert(std::max_element(row.t.begin(), row.t.end()) - row.t.begin());
    p.insert(std::max_element(row.s.begin(), row.s.end()) - row.s.begin());
    std::uniform_int_distribution<int64_t> any(0, V - 1);
    for (int i = 0; i < 40; ++i) p.insert(any(rng));
  }
  return {p.begin(), p.end()};
}

struct Scales {
  double kl, ntp;
};
constexpr Scales kScales[] = {{0.5, 0.5}, {1.0, 0.0}, {0.0, 1.0}, {0.7, 0.3}};

void check_row(const Row& row, Scales sc, std::mt19937& rng) {
  SCOPED_TRACE(fmt::format("{} kl_scale {} ntp_scale {}", row.what, sc.kl, sc.ntp));
  const int64_t V = row.V();
  const RowResult got = kernel_emulated(row, sc.kl, sc.ntp);
  const Reference ref = reference(row, sc.kl, sc.ntp);
  const Bound mine = bound(row, ref, kernel_depth(V), sc.kl, sc.ntp);
  const Bound cpus = bound(row, ref, cpu_depth(V), sc.kl, sc.ntp);
  EXPECT_NEAR(got.kl, ref.kl, mine.kl) << "KL against the reference";
  EXPECT_NEAR(got.ntp, ref.ntp, mine.ntp) << "NTP against the reference";
  int64_t bad = 0;
  for (int64_t v = 0; v < V; ++v)
    if (!(std::fabs(double(got.grad[v]) - ref.grad[v]) <= mine.grad[v]) && bad++ < 3)
      ADD_FAILURE() << "gradient at " << v << ": " << got.grad[v] << " vs reference " << ref.grad[v] << " bound "
                    << mine.grad[v];
  EXPECT_EQ(bad, 0) << "gradient entries outside the bound";

  const std::vector<int64_t> probes = probes_for(row, rng);
  const CpuRow cpu = cpu_row(row, probes, sc.kl, sc.ntp);
  EXPECT_NEAR(got.kl, cpu.kl, mine.kl + cpus.kl) << "KL against the CPU";
  EXPECT_NEAR(got.ntp, cpu.ntp, mine.ntp + cpus.ntp) << "NTP against the CPU";
  for (size_t j = 0; j < probes.size(); ++j) {
    const int64_t v = probes[j];
    EXPECT_NEAR(got.grad[v], cpu.probed[j], mine.grad[v] + cpus.grad[v]) << "gradient at " << v << " against the CPU";
  }
}

class LossRows : public cuda_test::SeededTest {};

TEST_F(LossRows, RandomRowsWithinBounds) {
  TRACE_SEED();
  int rows = 0;
  for (int64_t V : {1, 2, 3, 255, 256, 257, 1000, 4095, 4096, 4097, 9000, 40000})
    for (Kind kind : {Kind::Normal, Kind::Huge, Kind::Offset, Kind::Same, Kind::Sharp})
      for (int32_t y : targets_for(V, rng_)) {
        const Row row = make_row(kind, V, y, rng_);
        check_row(row, kScales[rows % 4], rng_);
        ++rows;
        if (HasFailure()) return;  // one row's report is enough
      }
  EXPECT_GT(rows, 250);
}

// Where every sum is exact (exponentials 1 or 0, integer logit differences), the kernel's order
// and the CPU's agree, so the formulas must agree bit for bit: KL, NTP and every gradient entry.
TEST_F(LossRows, ExactSumsMatchTheCpuBitForBit) {
  TRACE_SEED();
  std::uniform_int_distribution<int> level(0, 3);
  std::uniform_int_distribution<int> small(-3, 3);
  for (int64_t V : {1, 2, 3, 257, 5000}) {
    Row row;
    row.what = fmt::format("V {}", V);
    for (int64_t v = 0; v < V; ++v) {
      // at the maximum 7 (e = 1) or thousands below it (e = 0 exactly), integers throughout
      const int lt = level(rng_), ls = level(rng_);
      row.t.push_back(lt == 0 ? 7.0f : -3000.0f + float(small(rng_)));
      row.s.push_back(ls == 0 ? 7.0f : -2500.0f + float(small(rng_)));
    }
    row.t[0] = 7.0f;
    row.s[V - 1] = 7.0f;
    for (Scales sc : kScales)
      for (int32_t y : {0, static_cast<int32_t>(V - 1), static_cast<int32_t>(V / 2)})
        for (bool reverse : {false, true}) {
          row.y = y;
          SCOPED_TRACE(fmt::format("{} target {} scales {} {} {} KL", row.what, y, sc.kl, sc.ntp,
                                   reverse ? "reverse" : "forward"));
          const RowResult got = kernel_emulated(row, sc.kl, sc.ntp, reverse);
          std::vector<int64_t> probes;
          for (int64_t v = 0; v < std::min<int64_t>(V, 300); ++v) probes.push_back(v);
          if (V > 300) probes.push_back(V - 1);
          const CpuRow cpu = cpu_row(row, probes, sc.kl, sc.ntp, reverse);
          EXPECT_EQ(got.kl, cpu.kl);
          EXPECT_EQ(got.ntp, cpu.ntp);
          for (size_t j = 0; j < probes.size(); ++j) ASSERT_EQ(got.grad[probes[j]], cpu.probed[j]) << "v " << probes[j];
        }
  }
}

// The reverse KL, KL(q‖p), and its gradient q_v·(log q_v − log p_v − KL) (+ the NTP part): the
// kernel's order and the CPU's against a long-double reference by definition. Tolerance: the
// float32 rounding of e_s (u_f relative per q_v) and the float64 sums, far below a wrong formula
// (a sign or a missing −KL moves every entry by O(q_v)).
TEST_F(LossRows, ReverseKlMatchesALongDoubleReferenceAndTheCpu) {
  TRACE_SEED();
  int rows = 0;
  for (int64_t V : {1, 2, 3, 257, 1000, 4097, 9000})
    for (Kind kind : {Kind::Normal, Kind::Offset, Kind::Same, Kind::Sharp})
      for (Scales sc : kScales) {
        const int32_t y = static_cast<int32_t>(std::uniform_int_distribution<int64_t>(0, V - 1)(rng_));
        const Row row = make_row(kind, V, y, rng_);
        SCOPED_TRACE(fmt::format("{} kl_scale {} ntp_scale {}", row.what, sc.kl, sc.ntp));
        LD mt = row.t[0], ms = row.s[0];
        for (int64_t v = 1; v < V; ++v) mt = std::max<LD>(mt, row.t[v]), ms = std::max<LD>(ms, row.s[v]);
        LD zt = 0, zs = 0;
        for (int64_t v = 0; v < V; ++v) zt += std::exp(LD(row.t[v]) - mt), zs += std::exp(LD(row.s[v]) - ms);
        const LD lse_t = mt + std::log(zt), lse_s = ms + std::log(zs);
        LD kl = 0;
        std::vector<LD> logq(static_cast<size_t>(V)), logp(static_cast<size_t>(V));
        for (int64_t v = 0; v < V; ++v) {
          logq[v] = LD(row.s[v]) - lse_s, logp[v] = LD(row.t[v]) - lse_t;
          kl += std::exp(logq[v]) * (logq[v] - logp[v]);
        }
        std::vector<double> want(static_cast<size_t>(V));
        double scale = std::fabs(sc.ntp);
        for (int64_t v = 0; v < V; ++v) {
          const LD q = std::exp(logq[v]);
          want[v] = double(sc.kl * q * (logq[v] - logp[v] - kl) + sc.ntp * (q - (v == y ? 1 : 0)));
          scale = std::max(scale, std::fabs(want[v]));
        }
        const double kl_tol = 1e-12 * (1.0 + std::fabs(double(lse_s)) + std::fabs(double(lse_t))) * double(V);
        const double g_tol = 4 * kUf * scale + 1e-12 * (1.0 + std::fabs(double(lse_s)));
        const RowResult got = kernel_emulated(row, sc.kl, sc.ntp, true);
        EXPECT_NEAR(got.kl, double(kl), kl_tol) << "kernel's reverse KL";
        for (int64_t v = 0; v < V; ++v) ASSERT_NEAR(got.grad[v], want[v], g_tol) << "kernel's gradient at " << v;
        const std::vector<int64_t> probes = probes_for(row, rng_);
        const CpuRow cpu = cpu_row(row, probes, sc.kl, sc.ntp, true);
        EXPECT_NEAR(cpu.kl, double(kl), kl_tol) << "CPU's reverse KL";
        for (size_t j = 0; j < probes.size(); ++j)
          ASSERT_NEAR(cpu.probed[j], want[probes[j]], g_tol) << "CPU's gradient at " << probes[j];
        ++rows;
      }
  EXPECT_GT(rows, 100);
}

}  // namespace
