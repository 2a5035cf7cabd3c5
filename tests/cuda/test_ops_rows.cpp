// The per-element and per-row math of the CUDA row/elementwise ops (kernels/cuda/ops_rows.h) run
// on the CPU, in every build: each kernel of kernels/cuda/ops.cu emulated thread by thread — the
// same index mapping, the same strided partials, the same pairwise tree over kRowThreads slots,
// the same in-place writes — against the CPU reference ops (kernels/ops.h on CPU tensors) on
// fresh random inputs within the bounds of tests/cuda/ops_cases.h (embedding and add exact).
// What the emulation cannot check is the CUDA plumbing (launch shapes, barriers, shared memory);
// tests/cuda/test_ops_cuda.cpp does, on a GPU.
#include <gtest/gtest.h>

#include "tests/cuda/cuda_test.h"
#include "tests/cuda/ops_cases.h"

using namespace retain;
using namespace retain::ops_test;
namespace rows = retain::cuda::ops_rows;

namespace {

// ---- the kernels, emulated -----------------------------------------------------------------

// rmsnorm_kernel / rmsnorm_backward_kernel: per row, kRowThreads threads' partials, the tree,
// then each thread's writes. dy empty: forward. out may be x (forward) or dy (backward).
void rmsnorm_emulated(const float* x, const Vec& w, const float* dy, float eps, int64_t rows_n, int64_t D,
                      float* out) {
  std::vector<rows::RowPartials> slots(rows::kRowThreads);
  for (int64_t r = 0; r < rows_n; ++r) {
    const float* xr = x + r * D;
    const float* gr = dy ? dy + r * D : nullptr;
    for (int tid = 0; tid < rows::kRowThreads; ++tid) slots[tid] = rows::row_partials(xr, w.data(), gr, D, tid);
    for (int s = rows::kRowThreads / 2; s > 0; s >>= 1)
      for (int tid = 0; tid < s; ++tid) rows::fold_pair(slots.data(), tid, s);
    const float inv = rows::rms_inverse(slots[0].ss, D, eps);
    const float c = rows::rmsnorm_backward_coef(slots[0].dot, inv, D);
    float* orow = out + r * D;
    for (int tid = 0; tid < rows::kRowThreads; ++tid)
      for (int64_t j = tid; j < D; j += rows::kRowThreads)
        orow[j] = gr ? rows::rmsnorm_backward_element(xr[j], w[j], gr[j], inv, c)
                     : rows::rmsnorm_element(xr[j], w[j], inv);
  }
}

Vec embedding_emulated(const Tensor& table, const std::vector<int32_t>& ids, int64_t* first_bad) {
  const int64_t T = static_cast<int64_t>(ids.size()), V = table.dim(0), D = table.dim(1);
  *first_bad = -1;
  for (int64_t t = T - 1; t >= 0; --t)  // any visiting order: the smallest index wins
    if (rows::bad_id(ids.data(), t, V)) *first_bad = t;
  Vec out(static_cast<size_t>(T * D));
  if (*first_bad >= 0) return out;
  const auto type = table.dtype() == DType::BF16  ? rows::TableType::BF16
                    : table.dtype() == DType::F16 ? rows::TableType::F16
                                                  : rows::TableType::F32;
  for (int64_t i = 0; i < T * D; ++i) out[i] = rows::embedding_element(table.raw(), type, ids.data(), D, i);
  return out;
}

class OpsRows : public cuda_test::SeededTest {};

TEST_F(OpsRows, EmbeddingIsExactForEveryTableType) {
  TRACE_SEED();
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (int64_t D : {1, 7, 130}) {
      const int64_t V = 37, T = 300;
      const Tensor table = random_table(V, D, dt, rng_);
      std::vector<int32_t> ids = random_ids(V, T, rng_);
      Tensor want = Tensor::empty({T, D}, DType::F32);
      ops::embedding(table, i32(ids), want);
      int64_t bad = 0;
      expect_close(embedding_emulated(table, ids, &bad), to_vec(want), exact(T * D),
                   fmt::format("embedding {} D {}", dtype_name(dt), D));
      EXPECT_EQ(bad, -1);
      ids[250] = V;  // the first bad id is the one the error names, as the CPU's
      ids[40] = -1;
      embedding_emulated(table, ids, &bad);
      EXPECT_EQ(bad, 40);
    }
}

TEST_F(OpsRows, RmsnormForwardWithinBound) {
  TRACE_SEED();
  for (const RowShape s : row_shapes()) {
    const Vec x = random_rows(s.rows, s.D, rng_), w = random_rows(1, s.D, rng_, false);
    const float eps = 1e-6f;
    Tensor want = Tensor::empty({s.rows, s.D}, DType::F32);
    ops::rmsnorm(f32(x, {s.rows, s.D}), f32(w, {s.D}), eps, want);
    const Vec want_v = to_vec(want);
    Vec got(x.size());
    rmsnorm_emulated(x.data(), w, nullptr, eps, s.rows, s.D, got.data());
    expect_close(got, want_v, rmsnorm_forward_tol(want_v, s.D), fmt::format("rmsnorm {}x{}", s.rows, s.D));
    Vec inplace = x;  // out aliasing x, as model/ calls it for q/k norm
    rmsnorm_emulated(inplace.data(), w, nullptr, eps, s.rows, s.D, inplace.data());
    EXPECT_EQ(inplace, got) << "in place";
  }
}

TEST_F(OpsRows, RmsnormBackwardWithinBound) {
  TRACE_SEED();
  for (const RowShape s : row_shapes()) {
    const Vec x = random_rows(s.rows, s.D, rng_), w = random_rows(1, s.D, rng_, false),
              dy = random_rows(s.rows, s.D, rng_);
    const float eps = 1e-6f;
    Tensor want = Tensor::empty({s.rows, s.D}, DType::F32);
    ops::rmsnorm_backward(f32(x, {s.rows, s.D}), f32(w, {s.D}), eps, f32(dy, {s.rows, s.D}), want);
    Vec got(x.size());
    rmsnorm_emulated(x.data(), w, dy.data(), eps, s.rows, s.D, got.data());
    expect_close(got, to_vec(want), rmsnorm_backward_tol(x, w, dy, eps, s.D),
                 fmt::format("rmsnorm_backward {}x{}", s.rows, s.D));
    Vec inplace = dy;  // dx aliasing dy
    rmsnorm_emulated(x.data(), w, inplace.data(), eps, s.rows, s.D, inplace.data());
    EXPECT_EQ(inplace, got) << "in place";
  }
}

TEST_F(OpsRows, RopeForwardAndBackwardWithinBound) {
  TRACE_SEED();
  for (const RopeShape s : rope_shapes())
    for (bool yarn : {false, true}) {
      const float factor = yarn ? 1.1386f : 1.0f;  // 0.1·ln(4) + 1, YaRN's default for factor 4
      const Vec x = random_rows(s.T * s.heads, s.d, rng_), f = make_inv_freq(s.d, yarn);
      const std::vector<int32_t> pos = random_positions(s.T, rng_);
      for (float sign : {1.0f, -1.0f}) {
        Tensor want = f32(x, {s.T, s.heads, s.d});
        if (sign > 0)
          ops::rope(want, i32(pos), f32(f, {s.d / 2}), factor);
        else
          ops::rope_backward(want, i32(pos), f32(f, {s.d / 2}), factor);
        Vec got = x;
        for (int64_t i = 0; i < s.T * (s.d / 2); ++i)
          rows::rope_pair(got.data(), pos.data(), f.data(), factor, sign, s.heads, s.d, i);
        expect_close(got, to_vec(want), rope_tol(x, s.heads, s.d, factor),
                     fmt::format("rope{} T {} heads {} d {} yarn {}", sign > 0 ? "" : "_backward", s.T, s.heads, s.d,
                                 yarn));
      }
    }
}

TEST_F(OpsRows, SwigluForwardAndBackwardWithinBound) {
  TRACE_SEED();
  for (int64_t n : elem_sizes()) {
    const Vec g = random_elems(n, rng_), u = random_elems(n, rng_), o = random_elems(n, rng_);
    Tensor want = Tensor::empty({n}, DType::F32), dg = Tensor::empty({n}, DType::F32),
           du = Tensor::empty({n}, DType::F32);
    ops::swiglu(f32(g, {n}), f32(u, {n}), want);
    ops::swiglu_backward(f32(g, {n}), f32(u, {n}), f32(o, {n}), dg, du);
    const Vec want_v = to_vec(want);
    Vec got(g.size()), got_dg(g.size()), got_du(g.size());
    for (int64_t i = 0; i < n; ++i) {
      got[i] = rows::swiglu_element(g[i], u[i]);
      const rows::SwigluGrad r = rows::swiglu_backward_element(g[i], u[i], o[i]);
      got_dg[i] = r.dgate;
      got_du[i] = r.dup;
    }
    expect_close(got, want_v, swiglu_tol(want_v), fmt::format("swiglu n {}", n));
    expect_close(got_dg, to_vec(dg), swiglu_dgate_tol(g, u, o), fmt::format("swiglu_backward dgate n {}", n));
    expect_close(got_du, to_vec(du), swiglu_dup_tol(g, o), fmt::format("swiglu_backward dup n {}", n));
  }
}

}  // namespace
