// The CUDA row/elementwise ops (kernels/cuda/ops.cu) through the ops:: functions on CUDA
// tensors, against the same ops on CPU tensors on fresh random inputs per run (the seed is
// printed with every failure; RETAIN_TEST_SEED=n replays one): embedding (F32/BF16/F16 tables,
// exact), rmsnorm and rmsnorm_backward (in place too), rope and rope_backward (default and
// YaRN-like inv_freq, attention factor), swiglu and swiglu_backward, add_inplace (exact), within
// the bounds of tests/cuda/ops_cases.h; bitwise repeatable; bad token ids and mixed devices as
// one-line errors. All shapes are small: compute-sanitizer runs the whole suite.
// Skips (visibly) without a CUDA build or device. Not yet run: no GPU has been lent.
#include <gtest/gtest.h>

#include "tests/cuda/cuda_test.h"
#include "tests/cuda/ops_cases.h"

using namespace retain;
using namespace retain::ops_test;

namespace {

Tensor gpu(const Tensor& t) { return t.to(Device::CUDA); }
Tensor gpu_empty(const Shape& s) { return Tensor::empty(s, DType::F32, Device::CUDA); }

class OpsCuda : public cuda_test::SeededTest {};

// Fails without a device: run_sanitizer.sh uses it to skip (exit 77) on machines without one.
TEST_F(OpsCuda, DISABLED_DevicePresent) { ASSERT_GT(cuda_device_count(), 0); }


TEST_F(OpsCuda, Embedding) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (int64_t D : {1, 7, 130}) {
      const int64_t V = 37, T = 300;
      const Tensor table = random_table(V, D, dt, rng_);
      const std::vector<int32_t> ids = random_ids(V, T, rng_);
      Tensor want = Tensor::empty({T, D}, DType::F32), got = gpu_empty({T, D});
      ops::embedding(table, i32(ids), want);
      ops::embedding(gpu(table), gpu(i32(ids)), got);
      expect_close(to_vec(got), to_vec(want), exact(T * D), fmt::format("embedding {} D {}", dtype_name(dt), D));
    }
}

TEST_F(OpsCuda, Rmsnorm) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  for (const RowShape s : row_shapes()) {
    const Shape sh{s.rows, s.D};
    const Vec x = random_rows(s.rows, s.D, rng_), w = random_rows(1, s.D, rng_, false),
              dy = random_rows(s.rows, s.D, rng_);
    const float eps = 1e-6f;
    Tensor want = Tensor::empty(sh, DType::F32), want_dx = Tensor::empty(sh, DType::F32);
    ops::rmsnorm(f32(x, sh), f32(w, {s.D}), eps, want);
    ops::rmsnorm_backward(f32(x, sh), f32(w, {s.D}), eps, f32(dy, sh), want_dx);
    const Tensor xd = gpu(f32(x, sh)), wd = gpu(f32(w, {s.D})), dyd = gpu(f32(dy, sh));
    Tensor got = gpu_empty(sh), got_dx = gpu_empty(sh);
    ops::rmsnorm(xd, wd, eps, got);
    ops::rmsnorm_backward(xd, wd, eps, dyd, got_dx);
    const Vec want_v = to_vec(want), got_v = to_vec(got), got_dx_v = to_vec(got_dx);
    const std::string where = fmt::format("{}x{}", s.rows, s.D);
    expect_close(got_v, want_v, rmsnorm_forward_tol(want_v, s.D), "rmsnorm " + where);
    expect_close(got_dx_v, to_vec(want_dx), rmsnorm_backward_tol(x, w, dy, eps, s.D), "rmsnorm_backward " + where);
    // Repeatable, and the same in place (out = x, dx = dy).
    Tensor again = gpu_empty(sh);
    ops::rmsnorm(xd, wd, eps, again);
    EXPECT_EQ(to_vec(again), got_v) << "not repeatable " << where;
    Tensor inplace = gpu(f32(x, sh));
    ops::rmsnorm(inplace, wd, eps, inplace);
    EXPECT_EQ(to_vec(inplace), got_v) << "in place " << where;
    Tensor dx_inplace = gpu(f32(dy, sh));
    ops::rmsnorm_backward(xd, wd, eps, dx_inplace, dx_inplace);
    EXPECT_EQ(to_vec(dx_inplace), got_dx_v) << "backward in place " << where;
    // accumulate: dx0 + the same element, added in float32 (as add_inplace).
    const Vec dx0 = random_rows(s.rows, s.D, rng_);
    Tensor acc = gpu(f32(dx0, sh));
    ops::rmsnorm_backward(xd, wd, eps, dyd, acc, /*accumulate=*/true);
    Vec want_acc(dx0.size());
    for (size_t i = 0; i < dx0.size(); ++i) want_acc[i] = dx0[i] + got_dx_v[i];
    EXPECT_EQ(to_vec(acc), want_acc) << "backward accumulate " << where;
  }
}

TEST_F(OpsCuda, Rope) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  for (const RopeShape s : rope_shapes())
    for (bool yarn : {false, true}) {
      const float factor = yarn ? 1.1386f : 1.0f;
      const Shape sh{s.T, s.heads, s.d};
      const Vec x = random_rows(s.T * s.heads, s.d, rng_), f = make_inv_freq(s.d, yarn);
      const std::vector<int32_t> pos = random_positions(s.T, rng_);
      const Tensor pd = gpu(i32(pos)), fd = gpu(f32(f, {s.d / 2}));
      for (bool backward : {false, true}) {
        Tensor want = f32(x, sh), got = gpu(f32(x, sh));
        if (backward) {
          ops::rope_backward(want, i32(pos), f32(f, {s.d / 2}), factor);
          ops::rope_backward(got, pd, fd, factor);
        } else {
          ops::rope(want, i32(pos), f32(f, {s.d / 2}), factor);
          ops::rope(got, pd, fd, factor);
        }
        expect_close(to_vec(got), to_vec(want), rope_tol(x, s.heads, s.d, factor),
                     fmt::format("rope{} T {} heads {} d {} yarn {}", backward ? "_backward" : "", s.T, s.heads, s.d,
                                 yarn));
      }
    }
}

TEST_F(OpsCuda, SwigluAndAdd) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  for (int64_t n : elem_sizes()) {
    const Shape sh{n};
    const Vec g = random_elems(n, rng_), u = random_elems(n, rng_), o = random_elems(n, rng_);
    Tensor want = Tensor::empty(sh, DType::F32), dg = Tensor::empty(sh, DType::F32), du = Tensor::empty(sh, DType::F32);
    ops::swiglu(f32(g, sh), f32(u, sh), want);
    ops::swiglu_backward(f32(g, sh), f32(u, sh), f32(o, sh), dg, du);
    const Tensor gd = gpu(f32(g, sh)), ud = gpu(f32(u, sh)), od = gpu(f32(o, sh));
    Tensor got = gpu_empty(sh), got_dg = gpu_empty(sh), got_du = gpu_empty(sh);
    ops::swiglu(gd, ud, got);
    ops::swiglu_backward(gd, ud, od, got_dg, got_du);
    const Vec want_v = to_vec(want);
    expect_close(to_vec(got), want_v, swiglu_tol(want_v), fmt::format("swiglu n {}", n));
    expect_close(to_vec(got_dg), to_vec(dg), swiglu_dgate_tol(g, u, o), fmt::format("swiglu_backward dgate n {}", n));
    expect_close(to_vec(got_du), to_vec(du), swiglu_dup_tol(g, o), fmt::format("swiglu_backward dup n {}", n));
    // Aliasing as the contract allows: out = gate; dgate = dout, dup = up.
    Tensor g_inplace = gpu(f32(g, sh));
    ops::swiglu(g_inplace, ud, g_inplace);
    EXPECT_EQ(to_vec(g_inplace), to_vec(got)) << "swiglu in place n " << n;
    Tensor o2 = gpu(f32(o, sh)), u2 = gpu(f32(u, sh));
    ops::swiglu_backward(gd, u2, o2, o2, u2);
    EXPECT_EQ(to_vec(o2), to_vec(got_dg)) << "dgate in place n " << n;
    EXPECT_EQ(to_vec(u2), to_vec(got_du)) << "dup in place n " << n;
    // add_inplace: one float add per element on both sides, so exact.
    Tensor sum = f32(g, sh), sum_d = gpu(f32(g, sh));
    ops::add_inplace(sum, f32(u, sh));
    ops::add_inplace(sum_d, ud);
    expect_close(to_vec(sum_d), to_vec(sum), exact(static_cast<size_t>(n)), fmt::format("add_inplace n {}", n));
  }
}

// concat_columns and split_columns_add: copies and one float add per element, so exact.
TEST_F(OpsCuda, ConcatAndSplitColumns) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  for (auto [T, A, B] : {std::tuple<int64_t, int64_t, int64_t>{300, 128, 128}, {7, 3, 5}, {0, 4, 4}, {65, 1, 200}}) {
    const Vec a = random_elems(T * A, rng_), b = random_elems(T * B, rng_), g = random_elems(T * (A + B), rng_);
    Tensor want = Tensor::empty({T, A + B}, DType::F32);
    ops::concat_columns(f32(a, {T, A}), f32(b, {T, B}), want);
    Tensor got = gpu_empty({T, A + B});
    ops::concat_columns(gpu(f32(a, {T, A})), gpu(f32(b, {T, B})), got);
    EXPECT_EQ(to_vec(got), to_vec(want)) << "concat_columns " << T << " " << A << " " << B;
    Tensor da = f32(a, {T, A}), db = f32(b, {T, B}), dad = gpu(f32(a, {T, A})), dbd = gpu(f32(b, {T, B}));
    ops::split_columns_add(f32(g, {T, A + B}), da, db);
    ops::split_columns_add(gpu(f32(g, {T, A + B})), dad, dbd);
    EXPECT_EQ(to_vec(dad), to_vec(da)) << "split_columns_add a " << T << " " << A << " " << B;
    EXPECT_EQ(to_vec(dbd), to_vec(db)) << "split_columns_add b " << T << " " << A << " " << B;
  }
}

// The ring sums' helpers on F64 (add, fill) and the scaled F64 → F32 rounding: one operation per
// element on both devices, so exact.
TEST_F(OpsCuda, F64AddFillAndScaleToF32) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  std::normal_distribution<double> n(0.0, 1e3);
  for (int64_t count : {0, 1, 1000, 70001}) {
    std::vector<double> x(static_cast<size_t>(count)), y(static_cast<size_t>(count));
    for (size_t i = 0; i < x.size(); ++i) x[i] = n(rng_), y[i] = n(rng_);
    Tensor a = Tensor::from_vector<double>(x, {count}), ad = gpu(a);
    const Tensor b = Tensor::from_vector<double>(y, {count});
    ops::add_inplace(a, b);
    ops::add_inplace(ad, gpu(b));
    const Tensor back = ad.to(Device::CPU);
    for (int64_t i = 0; i < count; ++i) ASSERT_EQ(back.data<double>()[i], a.data<double>()[i]) << "add " << i;
    Tensor f = Tensor::empty({count}, DType::F32), fd = gpu_empty({count});
    ops::scale_to_f32(a, 1.0 / 3.0, f);
    ops::scale_to_f32(ad, 1.0 / 3.0, fd);
    EXPECT_EQ(to_vec(fd), to_vec(f)) << "scale_to_f32 " << count;
    ops::fill(fd, -INFINITY);
    ops::fill(ad, 0.1);
    for (float v : to_vec(fd)) ASSERT_EQ(v, -INFINITY);
    const Tensor filled = ad.to(Device::CPU);
    for (int64_t i = 0; i < count; ++i) ASSERT_EQ(filled.data<double>()[i], 0.1);
  }
}

TEST_F(OpsCuda, BadInputs) {
  SKIP_WITHOUT_GPU();
  const Tensor table = gpu(random_table(5, 3, DType::BF16, rng_));
  Tensor out = gpu_empty({4, 3});
  const auto message = [](auto&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message([&] { ops::embedding(table, gpu(i32({0, 7, 4, -1})), out); }),
            "embedding: token id 7 at position 1 is outside [0, 5)");
  EXPECT_NE(message([&] { ops::embedding(table, i32({0, 1, 2, 3}), out); }).find("all tensors must be on one device"),
            std::string::npos);
  Tensor x = gpu(f32(Vec(6, 1.0f), {2, 3}));
  EXPECT_NE(message([&] { ops::rmsnorm(x, f32(Vec(3, 1.0f), {3}), 1e-6f, x); }).find("one device"), std::string::npos);
  EXPECT_NE(message([&] { ops::add_inplace(x, f32(Vec(6, 1.0f), {2, 3})); }).find("one device"), std::string::npos);
}

}  // namespace
