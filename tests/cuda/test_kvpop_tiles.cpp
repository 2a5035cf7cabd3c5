// The CUDA KVPOP kernels' tile code (kernels/cuda/kvpop_tiles.h) run on the CPU, in every build:
// each kernel of kernels/cuda/kvpop.cu emulated block by block, phase by phase (the barriers) and
// thread by thread, with the same helpers, loop bounds, shared-memory contents and padding
// values, against the CPU references (kernels/cpu/kvpop_target.cpp, kvpop_mlstm.cpp) on fresh
// random inputs (the seed is printed with every failure; RETAIN_TEST_SEED=n replays one):
// several documents with padding runs, T not a multiple of 64, windows 1, 5 and ≥ 64, gates at
// the ends of their soft cap, tolerances as tests/cuda/kvpop_cases.h derives them. Also the
// chunked scan against the plain sequential recurrence, and the target's query-tile stop against
// the CPU's query range. What the emulation cannot check is the CUDA plumbing (loads by thread
// index, barriers, launch geometry); tests/cuda/test_kvpop_cuda.cpp does, on a GPU.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "kernels/cuda/kvpop_tiles.h"
#include "kernels/kvpop.h"
#include "tests/cuda/cuda_test.h"
#include "tests/cuda/kvpop_cases.h"

using namespace retain;
using namespace retain::kvpop_cuda_test;
namespace kt = retain::cuda::kvpop_tiles;

namespace {

// ================================ target ================================

// target_kernel on the host; also counts the query tiles each block visits.
Vec emulate_target(const TargetInputs& in, std::vector<int64_t>* tiles_visited = nullptr) {
  const TargetCase& c = in.c;
  const int64_t T = c.T, H = c.H, K = c.K, hd = c.hd, G = H / K, nb = kt::key_tile_count(T);
  const std::vector<float> q(in.q.begin(), in.q.end()), k(in.k.begin(), in.k.end());
  const float* lse = in.lse.data<float>();
  const int32_t* doc = in.doc.data();
  Vec log_m(static_cast<size_t>(K * T));
  std::vector<float> s_k(static_cast<size_t>(hd * kt::kKeyStride)), s_q(static_cast<size_t>(kt::kQueryTile * hd));
  float s_lse[kt::kQueryTile], s[kt::kQueryTile];
  int32_t s_kdoc[kt::kKeyTile], s_qdoc[kt::kQueryTile];
  if (tiles_visited) tiles_visited->assign(static_cast<size_t>(nb), 0);
  for (int64_t kb = 0; kb < nb; ++kb)
    for (int64_t kv = 0; kv < K; ++kv) {  // a block
      const int64_t t0 = kb * kt::kKeyTile;
      for (int64_t idx = 0; idx < kt::kKeyTile * hd; ++idx) {
        const int64_t jj = idx / hd, x = idx % hd, tk = t0 + jj;
        s_k[x * kt::kKeyStride + jj] = tk < T ? k[(tk * K + kv) * hd + x] : 0.0f;
      }
      for (int j = 0; j < kt::kKeyTile; ++j) s_kdoc[j] = kt::token_doc(doc, T, t0 + j);
      // -- barrier --
      const int last = kt::last_real_key(s_kdoc);
      const int64_t last_key = last < 0 ? -1 : t0 + last;
      const int32_t last_doc = last < 0 ? kt::kNoDoc : s_kdoc[last];
      double best[kt::kKeyTile], M[kt::kKeyTile], S[kt::kKeyTile];
      std::fill(best, best + kt::kKeyTile, -INFINITY);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kv * G + g;
        std::fill(M, M + kt::kKeyTile, -INFINITY);
        std::fill(S, S + kt::kKeyTile, 0.0);
        for (int64_t q0 = t0 + c.w; kt::query_tile_needed(doc, T, q0, last_key, last_doc); q0 += kt::kQueryTile) {
          if (tiles_visited && kv == 0 && g == 0) ++(*tiles_visited)[static_cast<size_t>(kb)];
          for (int64_t idx = 0; idx < kt::kQueryTile * hd; ++idx) {
            const int64_t dq = q0 + idx / hd;
            s_q[idx] = dq < T ? q[(dq * H + h) * hd + idx % hd] : 0.0f;
          }
          for (int j = 0; j < kt::kQueryTile; ++j) {
            s_lse[j] = q0 + j < T ? lse[(q0 + j) * H + h] : 0.0f;
            s_qdoc[j] = kt::token_doc(doc, T, q0 + j);
          }
          // -- barrier --
          for (int j = 0; j < kt::kKeyTile; ++j) {  // the threads
            const float mx = kt::key_scores(s_q.data(), s_lse, s_qdoc, q0, s_k.data() + j, hd, t0 + j, s_kdoc[j], c.w,
                                            in.scale, s);
            kt::lse_add_tile(s, mx, M[j], S[j]);
          }
        }
        for (int j = 0; j < kt::kKeyTile; ++j) best[j] = std::max(best[j], kt::lse_value(M[j], S[j]));
      }
      for (int j = 0; j < kt::kKeyTile; ++j)
        if (t0 + j < T) log_m[kv * T + t0 + j] = static_cast<float>(best[j]);
    }
  return log_m;
}

Vec reference_target(const TargetInputs& in) {
  const TargetCase& c = in.c;
  return to_vec(kvpop::future_attention_target(f32(in.q, {c.T, c.H, c.hd}), f32(in.k, {c.T, c.K, c.hd}), in.lse,
                                               i32(in.doc), c.w, in.scale));
}

class KvpopTargetTiles : public ::testing::TestWithParam<TargetCase> {};

TEST_P(KvpopTargetTiles, EmulatedKernelMatchesTheCpuReference) {
  const TargetCase c = GetParam();
  const uint32_t seed = cuda_test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const TargetInputs in = make_target_inputs(c, rng);
  std::vector<int64_t> visited;
  const Vec got = emulate_target(in, &visited);
  const Vec want = reference_target(in);
  expect_target_close(in, got, want, "emulated target");

  // The query tiles visited are exactly those the CPU's range [t0 + w, d_end) needs, d_end the
  // end of the tile's last real key's document run.
  const int64_t T = c.T;
  for (int64_t kb = 0; kb < kt::key_tile_count(T); ++kb) {
    const int64_t t0 = kb * kt::kKeyTile;
    int64_t d_end = t0;
    for (int64_t t = t0; t < std::min(t0 + kt::kKeyTile, T); ++t) {
      if (in.doc[t] < 0) continue;
      int64_t e = t;
      while (e + 1 < T && in.doc[e + 1] == in.doc[t]) ++e;
      d_end = std::max(d_end, e + 1);
    }
    const int64_t span = d_end - (t0 + c.w);
    EXPECT_EQ(visited[kb], span > 0 ? (span + kt::kQueryTile - 1) / kt::kQueryTile : 0) << "key tile " << kb;
  }
}

// Windows 1, 5, 64 and beyond a tile; T not a multiple of 64; groups of 1–4 query heads; head
// dims 8–128; documents from a few tokens to longer than several tiles, with padding runs.
INSTANTIATE_TEST_SUITE_P(Shapes, KvpopTargetTiles,
                         ::testing::Values(TargetCase{1, 1, 1, 8, 1, 1}, TargetCase{63, 2, 1, 16, 1, 20},
                                           TargetCase{150, 4, 2, 16, 1, 60}, TargetCase{200, 4, 2, 32, 5, 90},
                                           TargetCase{257, 6, 3, 64, 64, 300}, TargetCase{300, 2, 1, 128, 70, 1000},
                                           TargetCase{333, 8, 2, 16, 130, 250}, TargetCase{129, 3, 3, 8, 5, 12}),
                         [](const ::testing::TestParamInfo<TargetCase>& info) {
                           const TargetCase& c = info.param;
                           return fmt::format("T{}_H{}_K{}_hd{}_w{}", c.T, c.H, c.K, c.hd, c.w);
                         });

TEST(KvpopTargetTiles, TileHelpers) {
  EXPECT_EQ(kt::key_tile_count(0), 0);
  EXPECT_EQ(kt::key_tile_count(64), 1);
  EXPECT_EQ(kt::key_tile_count(65), 2);
  const int32_t doc[] = {0, 0, -1, 1};
  EXPECT_EQ(kt::token_doc(doc, 4, 1), 0);
  EXPECT_EQ(kt::token_doc(doc, 4, 2), kt::kNoDoc);
  EXPECT_EQ(kt::token_doc(doc, 4, 4), kt::kNoDoc);  // beyond T
  int32_t kdoc[kt::kKeyTile];
  std::fill(kdoc, kdoc + kt::kKeyTile, kt::kNoDoc);
  EXPECT_EQ(kt::last_real_key(kdoc), -1);
  kdoc[17] = 3;
  EXPECT_EQ(kt::last_real_key(kdoc), 17);
  // 48 KiB is the default dynamic shared memory; head_dim 128 needs the opt-in.
  EXPECT_LT(kt::target_shared_bytes(64), 48u * 1024);
  EXPECT_GT(kt::target_shared_bytes(128), 48u * 1024);
  EXPECT_LT(kt::target_shared_bytes(128), 227u * 1024);
}

// ================================ mLSTM ================================

// The plain sequential scan (the CPU reference's make_scan, restated) for the scan test.
struct SeqScan {
  std::vector<int64_t> start;
  Vec F, m;
  std::vector<uint8_t> branch, readout;
};
SeqScan sequential_scan(const kvpop::Projected& P, const std::vector<int32_t>& doc, int64_t w) {
  const int64_t T = static_cast<int64_t>(doc.size());
  SeqScan s{std::vector<int64_t>(T), Vec(T, 0.0), Vec(T, 0.0), std::vector<uint8_t>(T, 0), std::vector<uint8_t>(T, 0)};
  const float* lf = P.log_f.data<float>();
  const float* ig = P.igate.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    const bool first = t == 0 || doc[t] != doc[t - 1] || doc[t] < 0;
    s.start[t] = first ? t : s.start[t - 1];
    if (doc[t] < 0) continue;
    const double F_prev = first ? 0.0 : s.F[t - 1], m_prev = first ? 0.0 : s.m[t - 1];
    s.F[t] = F_prev + lf[t];
    s.branch[t] = lf[t] + m_prev >= ig[t];
    s.m[t] = std::max(lf[t] + m_prev, double(ig[t]));
    s.readout[t] = t - w + 1 >= 0 && t - w + 1 >= s.start[t];
  }
  return s;
}

// The device buffers of one call, on the host.
struct Emulation {
  int64_t T, d, r, w, nc, S;
  double inv_sqrt_d;
  const float *q, *k, *v, *ig, *lf, *w_o;
  const int32_t* doc;
  std::vector<int64_t> start;
  Vec F, m;
  std::vector<uint8_t> branch, readout;
  Vec state, factor;  // [nc, S], [nc]

  kt::ScanView view() const { return {doc, start.data(), F.data(), m.data(), branch.data(), readout.data()}; }

  Emulation(const MlstmInputs& in, int64_t w_) : w(w_) {
    const kvpop::Projected& P = in.P;
    T = P.q.dim(0);
    d = P.q.dim(1);
    r = P.v.dim(1);
    nc = kt::chunk_count(T);
    S = d * r + d;
    inv_sqrt_d = 1.0 / std::sqrt(double(d));
    q = P.q.data<float>();
    k = P.k.data<float>();
    v = P.v.data<float>();
    ig = P.igate.data<float>();
    lf = P.log_f.data<float>();
    w_o = in.w_o.data<float>();
    doc = in.doc.data();
    // scan_summary_kernel, scan_carry_kernel, scan_tokens_kernel
    std::vector<kt::ScanState> summary(static_cast<size_t>(nc)), carry(static_cast<size_t>(nc));
    for (int64_t c = 0; c < nc; ++c) summary[c] = kt::scan_summary(doc, lf, ig, c * kt::kChunk, kt::chunk_end(T, c) + 1, w);
    kt::scan_carries(summary.data(), nc, carry.data());
    start.assign(T, 0);
    F.assign(T, 0.0);
    m.assign(T, 0.0);
    branch.assign(T, 0);
    readout.assign(T, 0);
    const kt::ScanOut out{start.data(), F.data(), m.data(), branch.data(), readout.data()};
    for (int64_t c = 0; c < nc; ++c) kt::scan_tokens(doc, lf, ig, c * kt::kChunk, kt::chunk_end(T, c) + 1, w, carry[c], &out);
    // state_terms_kernel, chain_kernel
    state.assign(static_cast<size_t>(nc * S), 0.0);
    factor.assign(static_cast<size_t>(nc), 0.0);
    const kt::ScanView s = view();
    double aw[kt::kChunk];
    for (int64_t c = 0; c < nc; ++c) {
      const int64_t e = kt::chunk_end(T, c);
      const kt::Range src = kt::chunk_sources(s, T, c);
      for (int jj = 0; jj < kt::kChunk; ++jj) aw[jj] = src.lo + jj < src.hi ? kt::a_weight(s, ig, e, src.lo + jj) : 0.0;
      factor[c] = kt::chunk_factor(s, T, c);
      // -- barrier --
      for (int64_t idx = 0; idx < S; ++idx) state[c * S + idx] = kt::state_term(k, v, d, r, aw, src, idx);
    }
    for (int64_t idx = 0; idx < S; ++idx) kt::chain_entry(state.data(), factor.data(), nc, S, idx, false);
  }

  // readout_sums: Q, az, sums (num[0..r), den at r) of readout t; returns the carried state.
  const double* readout_sums(int64_t t, double* Q, double* az, double* sums, kt::Carry& cc, kt::Range& keys) const {
    const kt::ScanView s = view();
    for (int64_t x = 0; x < d; ++x) Q[x] = kt::query_entry(q, t - w + 1, d, inv_sqrt_d, x);
    // -- barrier --
    keys = kt::readout_keys(s, t);
    for (int64_t jj = 0; jj < keys.hi - keys.lo; ++jj) az[jj] = kt::readout_key_weight(s, k, ig, d, Q, t, keys.lo + jj);
    cc = kt::chunk_carry(s, t);
    const double* prev = cc.on ? state.data() + (t / kt::kChunk - 1) * S : nullptr;
    // -- barrier --
    for (int64_t y = 0; y <= r; ++y) sums[y] = kt::readout_sum(prev, cc.g, Q, az, v, keys, d, r, y);
    return prev;
  }

  // readout_kernel
  Vec scores(float b_o) const {
    Vec score(T, 0.0);
    Vec Q(d), az(kt::kChunk), sums(r + 1), terms(r);
    for (int64_t t = 0; t < T; ++t) {
      if (!readout[t]) continue;
      kt::Carry cc;
      kt::Range keys;
      readout_sums(t, Q.data(), az.data(), sums.data(), cc, keys);
      const kt::Norm nrm = kt::readout_norm(sums[r], m[t]);
      for (int64_t y = 0; y < r; ++y) terms[y] = kt::score_term(w_o[y], sums[y], nrm);
      score[t - w + 1] = static_cast<float>(kt::score_value(b_o, terms.data(), r));
    }
    return score;
  }

  // readout_backward_kernel, reverse_terms_kernel + chain_kernel, key_grads_kernel, the suffix
  // kernels, the column-sum kernels.
  void backward(const float* dscore, Vec& dq, Vec& dk_out, Vec& dv_out, Vec& d_igate, Vec& d_log_f, Vec& dw_o,
                Vec& db_o) const {
    const kt::ScanView s = view();
    Vec gnum(T * r, 0.0), gden(T, 0.0), gF(T, 0.0), gm(T, 0.0), parts(T * (r + 1), 0.0);
    dq.assign(T * d, 0.0);
    Vec Q(d), az(kt::kChunk), sums(r + 1), gn(r), gh_h(r), gn_num(r), coef(kt::kChunk);
    for (int64_t t = 0; t < T; ++t) {
      if (!readout[t]) continue;
      kt::Carry cc;
      kt::Range keys;
      const double* prev = readout_sums(t, Q.data(), az.data(), sums.data(), cc, keys);
      const int64_t u = t - w + 1;
      const double ds = dscore[u];
      const kt::Norm nrm = kt::readout_norm(sums[r], m[t]);
      for (int64_t y = 0; y < r; ++y) {
        const kt::ReadoutGradY g = kt::readout_grad_y(ds, w_o[y], sums[y], nrm);
        gn[y] = g.gnum;
        gh_h[y] = g.gh_h;
        gn_num[y] = g.gnum_num;
        gnum[t * r + y] = g.gnum;
        parts[t * (r + 1) + y] = g.dwo;
      }
      // -- barrier --
      const kt::ReadoutGrad g = kt::readout_grad(gh_h.data(), gn_num.data(), r, sums[r], nrm);
      gden[t] = g.gden;
      gF[t] = g.gF;
      gm[t] = g.gm;
      parts[t * (r + 1) + r] = ds;
      // -- barrier --
      for (int64_t jj = 0; jj < keys.hi - keys.lo; ++jj)
        coef[jj] = kt::readout_key_coef(s, v, ig, r, gn.data(), g.gden, t, keys.lo + jj);
      // -- barrier --
      for (int64_t x = 0; x < d; ++x)
        dq[u * d + x] = static_cast<float>(kt::readout_dq(prev, cc.g, gn.data(), g.gden, coef.data(), k, keys, d, r, x) * inv_sqrt_d);
    }
    // Pass 2.
    Vec dstate(nc * S, 0.0), rfactor(nc, 0.0);
    double wt[kt::kChunk];
    for (int64_t c = 0; c < nc; ++c) {
      const int64_t e = kt::chunk_end(T, c);
      const kt::Range readers = kt::chunk_readers(s, T, c);
      for (int tt = 0; tt < kt::kChunk; ++tt) {
        const int64_t t = readers.lo + tt;
        wt[tt] = t < readers.hi && readout[t] ? kt::carry_factor(s, e, t) : 0.0;
      }
      rfactor[c] = kt::reverse_factor(s, T, c);
      // -- barrier --
      for (int64_t idx = 0; idx < S; ++idx)
        dstate[c * S + idx] = kt::reverse_state_term(readout.data(), q, gnum.data(), gden.data(), d, r, w, inv_sqrt_d, wt,
                                                     readers, idx);
    }
    for (int64_t idx = 0; idx < S; ++idx) kt::chain_entry(dstate.data(), rfactor.data(), nc, S, idx, true);
    // Pass 3.
    dk_out.assign(T * d, 0.0);
    dv_out.assign(T * r, 0.0);
    Vec kdk(T, 0.0), ac(kt::kChunk), azr(kt::kChunk), dk(d);
    for (int64_t j = 0; j < T; ++j) {
      if (doc[j] < 0) continue;
      const kt::Range readers = kt::key_readers(s, T, j);
      for (int64_t tt = 0; tt < readers.hi - readers.lo; ++tt) {
        const kt::KeyReader kr =
            kt::key_reader(s, q, k, v, ig, gnum.data(), gden.data(), d, r, w, inv_sqrt_d, readers.lo + tt, j);
        ac[tt] = kr.ac;
        azr[tt] = kr.az;
      }
      // -- barrier --
      const int64_t c = j / kt::kChunk, e = kt::chunk_end(T, c);
      const bool to_end = kt::same_run(s, j, e);
      const double* dst = to_end ? dstate.data() + c * S : nullptr;
      const double b = to_end ? kt::a_weight(s, ig, e, j) : 0.0;
      for (int64_t x = 0; x < d; ++x) {
        dk[x] = kt::key_dk(readout.data(), q, v, ac.data(), readers, dst, b, d, r, w, inv_sqrt_d, j, x);
        dk_out[j * d + x] = static_cast<float>(dk[x]);
      }
      for (int64_t y = 0; y < r; ++y)
        dv_out[j * r + y] = static_cast<float>(kt::key_dv(readout.data(), k, gnum.data(), azr.data(), readers, dst, b, d, r, j, y));
      // -- barrier --
      kdk[j] = kt::key_dot(k, dk.data(), d, j);
    }
    // Pass 4.
    std::vector<kt::Suffix> summary(nc), carry(nc);
    for (int64_t c = 0; c < nc; ++c)
      summary[c] = kt::suffix_tokens(s, T, gm.data(), gF.data(), kdk.data(), c * kt::kChunk, kt::chunk_end(T, c) + 1,
                                     kt::Suffix{0.0, 0.0, 0, 0}, nullptr, nullptr);
    kt::suffix_carries(summary.data(), nc, carry.data());
    std::vector<float> di(T, 0.0f), dl(T, 0.0f);
    for (int64_t c = 0; c < nc; ++c)
      kt::suffix_tokens(s, T, gm.data(), gF.data(), kdk.data(), c * kt::kChunk, kt::chunk_end(T, c) + 1, carry[c], di.data(),
                        dl.data());
    d_igate.assign(di.begin(), di.end());
    d_log_f.assign(dl.begin(), dl.end());
    Vec partial(nc * (r + 1));
    for (int64_t c = 0; c < nc; ++c)
      for (int64_t col = 0; col <= r; ++col)
        partial[c * (r + 1) + col] = kt::column_sum(parts.data(), r + 1, c * kt::kChunk, kt::chunk_end(T, c) + 1, col);
    dw_o.assign(r, 0.0);
    db_o.assign(1, 0.0);
    for (int64_t col = 0; col <= r; ++col) {
      const float total = static_cast<float>(kt::column_sum(partial.data(), r + 1, 0, nc, col));
      (col < r ? dw_o[col] : db_o[0]) = total;
    }
  }
};

class KvpopMlstmTiles : public ::testing::TestWithParam<MlstmCase> {};

TEST_P(KvpopMlstmTiles, ChunkedScanMatchesTheSequentialRecurrence) {
  const MlstmCase c = GetParam();
  const uint32_t seed = cuda_test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const MlstmInputs in = make_mlstm_inputs(c, rng);
  const Emulation em(in, c.w);
  const SeqScan want = sequential_scan(in.P, in.doc, c.w);
  double worst = 0;
  for (int64_t t = 0; t < c.T; ++t) {
    ASSERT_EQ(em.start[t], want.start[t]) << t;
    ASSERT_EQ(em.readout[t], want.readout[t]) << t;
    ASSERT_EQ(em.branch[t], want.branch[t]) << t;  // a flip needs an exact tie of two floats
    // F and m: sums of ≤ T float32 values in float64, associated differently at chunk ends.
    const double tol = 1e-12 * (1 + std::abs(want.F[t]) + std::abs(want.m[t]));
    EXPECT_NEAR(em.F[t], want.F[t], tol) << t;
    EXPECT_NEAR(em.m[t], want.m[t], tol) << t;
    worst = std::max({worst, std::abs(em.F[t] - want.F[t]), std::abs(em.m[t] - want.m[t])});
  }
  std::printf("chunked scan vs sequential: max |ΔF|, |Δm| %.3g\n", worst);
}

TEST_P(KvpopMlstmTiles, EmulatedKernelsMatchTheCpuReference) {
  const MlstmCase c = GetParam();
  const uint32_t seed = cuda_test::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const MlstmInputs in = make_mlstm_inputs(c, rng);
  const MlstmResult want = reference_mlstm(in, c.w);
  const Emulation em(in, c.w);
  Vec dq, dk, dv, di, dl, dwo, dbo;
  em.backward(in.dscore.data<float>(), dq, dk, dv, di, dl, dwo, dbo);
  std::printf("mlstm emulation vs CPU reference (%s):\n", ::testing::PrintToString(c).c_str());
  const Vec score = em.scores(in.b_o.data<float>()[0]);
  int64_t scored = 0;
  for (int64_t u = 0; u < c.T; ++u) scored += kvpop::has_score(in.doc.data(), c.T, c.w, u);
  if (c.T > c.w) {
    EXPECT_GT(scored, 0) << "a case without readouts tests nothing";
  }
  const int64_t d = 2 * c.r;
  const MlstmResult got{f32(score, {c.T}),
                        {f32(dq, {c.T, d}), f32(dk, {c.T, d}), f32(dv, {c.T, c.r}), f32(di, {c.T}), f32(dl, {c.T})},
                        f32(dwo, {c.r}),
                        f32(dbo, {1})};
  expect_mlstm_result(got, want);
}

// Windows 1, 5 and beyond a chunk; documents shorter and longer than a chunk with padding runs;
// one long document over many chunks with extreme gates; r from 4 to the real model's 64.
INSTANTIATE_TEST_SUITE_P(Cases, KvpopMlstmTiles,
                         ::testing::Values(MlstmCase{1, 4, 1, 1, false}, MlstmCase{63, 4, 1, 90, false},
                                           MlstmCase{200, 4, 5, 90, false}, MlstmCase{260, 4, 40, 150, false},
                                           MlstmCase{300, 4, 70, 400, false}, MlstmCase{150, 8, 3, 30, false},
                                           MlstmCase{777, 8, 64, 700, false}, MlstmCase{1000, 4, 130, 100000, true},
                                           MlstmCase{1500, 4, 1, 100000, true}, MlstmCase{300, 64, 5, 200, false}),
                         [](const ::testing::TestParamInfo<MlstmCase>& info) {
                           const MlstmCase& c = info.param;
                           return fmt::format("T{}_r{}_w{}{}", c.T, c.r, c.w, c.extreme ? "_extreme" : "");
                         });

TEST(KvpopMlstmTiles, ChunkRanges) {
  // Two runs (0 .. 99, 100 .. 139), padding 140 .. 149, a run 150 .. 199.
  const int64_t T = 200;
  std::vector<int32_t> doc(T, 0);
  for (int64_t t = 100; t < T; ++t) doc[t] = t < 140 ? 1 : t < 150 ? -1 : 2;
  std::vector<float> zero(T, 0.0f);
  const int64_t nc = kt::chunk_count(T);
  EXPECT_EQ(nc, 4);
  EXPECT_EQ(kt::chunk_end(T, 3), 199);
  std::vector<kt::ScanState> summary(nc), carry(nc);
  for (int64_t c = 0; c < nc; ++c) summary[c] = kt::scan_summary(doc.data(), zero.data(), zero.data(), c * 64, kt::chunk_end(T, c) + 1, 1);
  kt::scan_carries(summary.data(), nc, carry.data());
  std::vector<int64_t> start(T);
  Vec F(T), m(T);
  std::vector<uint8_t> branch(T), readout(T);
  const kt::ScanOut out{start.data(), F.data(), m.data(), branch.data(), readout.data()};
  for (int64_t c = 0; c < nc; ++c) kt::scan_tokens(doc.data(), zero.data(), zero.data(), c * 64, kt::chunk_end(T, c) + 1, 1, carry[c], &out);
  EXPECT_EQ(start[99], 0);
  EXPECT_EQ(start[139], 100);
  EXPECT_EQ(start[199], 150);
  const kt::ScanView s{doc.data(), start.data(), F.data(), m.data(), branch.data(), readout.data()};
  EXPECT_EQ(kt::chunk_sources(s, T, 0).lo, 0);    // chunk 0 ends in run 0
  EXPECT_EQ(kt::chunk_sources(s, T, 1).lo, 100);  // chunk 1 (64 .. 127) ends in run 1
  EXPECT_EQ(kt::chunk_sources(s, T, 2).lo, 150);  // chunk 2 (128 .. 191) ends in run 2
  EXPECT_EQ(kt::chunk_readers(s, T, 0).hi, 100);  // run 0 goes on to 99
  EXPECT_EQ(kt::chunk_readers(s, T, 3).hi, 200);  // nothing after the last chunk
  EXPECT_EQ(kt::chunk_readers(s, T, 3).lo, 200);
  EXPECT_EQ(kt::key_readers(s, T, 120).hi, 128);
  EXPECT_EQ(kt::key_readers(s, T, 130).hi, 140);
  EXPECT_EQ(kt::readout_keys(s, 110).lo, 100);
  EXPECT_EQ(kt::readout_keys(s, 70).lo, 64);
  EXPECT_FALSE(kt::chunk_carry(s, 110).on);  // its run starts in its chunk
  EXPECT_TRUE(kt::chunk_carry(s, 70).on);
  EXPECT_EQ(kt::reverse_factor(s, T, 1), 0.0);  // 127 and 191 are in different runs
  EXPECT_EQ(kt::reverse_factor(s, T, 3), 0.0);
}

}  // namespace
