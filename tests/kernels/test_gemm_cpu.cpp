// The GEMM ops and the cast on the CPU (kernels/cpu/ops.cpp, ops_backward.cpp; checks in
// kernels/ops.cpp): linear and linear_backward_input with BF16 weights equal the F32 path on the
// widened weight bit for bit (and within float32 rounding when the weight is widened in several
// blocks); linear_backward_weight against a float64 product within the float32 summation bound
// (N + 2)·u·(Σ|terms| + |dw₀|), u = 2^-24, N the inner (token) dimension; accumulate; cast
// against kernels/base/half.h bit for bit; bad dtypes, shapes and aliasing as one-line errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/base/half.h"
#include "kernels/ops.h"
#include "tests/cuda/gemm_cases.h"

using namespace retain;
using retain::gemm_test::random_f32;

namespace {

constexpr double kU = 1.0 / (1 << 24);


Tensor random_bf16(const Shape& shape, std::mt19937& rng) {
  const Tensor f = random_f32(shape, rng);
  Tensor t = Tensor::empty(shape, DType::BF16);
  for (int64_t i = 0; i < t.numel(); ++i)
    static_cast<uint16_t*>(t.raw())[i] = f32_to_bf16(f.data<float>()[i]);
  return t;
}

Tensor widened(const Tensor& bf16) {
  Tensor t = Tensor::empty(bf16.shape(), DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = bf16_to_f32(static_cast<const uint16_t*>(bf16.raw())[i]);
  return t;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && (a.nbytes() == 0 || std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0);
}

double at(const Tensor& t, int64_t r, int64_t c) { return t.data<float>()[r * t.dim(1) + c]; }

// |got − C₀ − A·B| ≤ (k + 2)·u·(Σ|a·b| + |C₀|) elementwise, in float64, for got[m,n] with
// A(i, l) = a(i, l) and B(l, j) = b(l, j) given as accessors (so every layout fits one check).
void expect_product(const Tensor& got, const Tensor* c0, int64_t k, const std::function<double(int64_t, int64_t)>& a,
                    const std::function<double(int64_t, int64_t)>& b, const std::string& what) {
  const int64_t m = got.dim(0), n = got.dim(1);
  int bad = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double sum = c0 ? at(*c0, i, j) : 0.0, mag = c0 ? std::fabs(at(*c0, i, j)) : 0.0;
      for (int64_t l = 0; l < k; ++l) {
        const double p = a(i, l) * b(l, j);
        sum += p;
        mag += std::fabs(p);
      }
      const double err = std::fabs(at(got, i, j) - sum), bound = static_cast<double>(k + 2) * kU * mag;
      if (err > bound && bad++ < 5)
        ADD_FAILURE() << what << " [" << i << ", " << j << "]: got " << at(got, i, j) << " want " << sum
                      << " error " << err << " > bound " << bound;
    }
}

// A call that must fail with a one-line retain::Error containing `op` (the op's name, or the
// start of the specific message).
void expect_one_line_error(const std::function<void()>& call, const std::string& op) {
  try {
    call();
    ADD_FAILURE() << op << ": no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(op), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

using Shape3 = std::tuple<int64_t, int64_t, int64_t>;  // N, in, out
const std::vector<Shape3> kShapes = {{1, 1, 1},   {7, 13, 5},   {1, 257, 130}, {130, 7, 257},
                                     {33, 64, 1}, {2, 130, 96}, {257, 31, 7}};

TEST(GemmCpu, LinearWithBf16WeightIsTheF32PathOnTheWidenedWeightAndAccumulates) {
  std::mt19937 rng(11);
  for (auto [N, in, out] : kShapes)
    for (bool accumulate : {false, true}) {
      const Tensor x = random_f32({N, in}, rng), w = random_bf16({out, in}, rng), wf = widened(w);
      const Tensor y0 = random_f32({N, out}, rng);
      Tensor y = y0.clone(), want = y0.clone();
      ops::linear(x, w, y, accumulate);
      ops::linear(x, wf, want, accumulate);
      EXPECT_TRUE(same_bits(y, want)) << N << "x" << in << "x" << out << " accumulate " << accumulate;
      expect_product(want, accumulate ? &y0 : nullptr, in, [&](int64_t n, int64_t i) { return at(x, n, i); },
                     [&](int64_t i, int64_t o) { return at(wf, o, i); },
                     std::string("linear F32") + (accumulate ? " accumulate" : ""));
    }
}

// A BF16 x (the GPU's attention output into o_proj) is its values widened: bit for bit an F32 x
// holding them, with F32 and BF16 weights.
TEST(GemmCpu, LinearWithBf16InputIsTheF32PathOnTheWidenedInput) {
  std::mt19937 rng(13);
  for (auto [N, in, out] : kShapes)
    for (bool bf16_weight : {false, true})
      for (bool accumulate : {false, true}) {
        const Tensor x = random_bf16({N, in}, rng), xf = widened(x);
        const Tensor w = bf16_weight ? random_bf16({out, in}, rng) : random_f32({out, in}, rng);
        const Tensor y0 = random_f32({N, out}, rng);
        Tensor y = y0.clone(), want = y0.clone();
        ops::linear(x, w, y, accumulate);
        ops::linear(xf, w, want, accumulate);
        EXPECT_TRUE(same_bits(y, want)) << N << "x" << in << "x" << out << " bf16 weight " << bf16_weight
                                        << " accumulate " << accumulate;
      }
}

TEST(GemmCpu, LinearBackwardInputWithBf16WeightIsTheF32PathAndAccumulates) {
  std::mt19937 rng(12);
  for (auto [N, in, out] : kShapes)
    for (bool accumulate : {false, true}) {
      const Tensor dy = random_f32({N, out}, rng), w = random_bf16({out, in}, rng), wf = widened(w),
                   dx0 = random_f32({N, in}, rng);
      Tensor dx = dx0.clone(), want = dx0.clone();
      ops::linear_backward_input(dy, w, dx, accumulate);
      ops::linear_backward_input(dy, wf, want, accumulate);
      EXPECT_TRUE(same_bits(dx, want)) << N << "x" << in << "x" << out << " accumulate " << accumulate;
      expect_product(want, accumulate ? &dx0 : nullptr, out, [&](int64_t n, int64_t o) { return at(dy, n, o); },
                     [&](int64_t o, int64_t i) { return at(wf, o, i); }, "linear_backward_input F32");
    }
}

// Weights over kernels/cpu/ops_cpu.h's 32 MiB widening block go block by block: each block's
// product is still a float32 GEMM of the whole inner dimension.
TEST(GemmCpu, Bf16WeightsOverOneWideningBlock) {
  std::mt19937 rng(13);
  {
    const int64_t N = 2, in = 4096, out = 2049;  // 2 blocks of w's rows
    const Tensor x = random_f32({N, in}, rng), w = random_bf16({out, in}, rng), wf = widened(w);
    Tensor y = Tensor::empty({N, out}, DType::F32);
    ops::linear(x, w, y);
    expect_product(y, nullptr, in, [&](int64_t n, int64_t i) { return at(x, n, i); },
                   [&](int64_t i, int64_t o) { return at(wf, o, i); }, "linear BF16 blocks");
  }
  {
    const int64_t N = 3, in = 2049, out = 4096;  // 2 blocks of w's columns
    const Tensor dy = random_f32({N, out}, rng), w = random_bf16({out, in}, rng), wf = widened(w),
                 dx0 = random_f32({N, in}, rng);
    Tensor dx = dx0.clone();
    ops::linear_backward_input(dy, w, dx, /*accumulate=*/true);
    expect_product(dx, &dx0, out, [&](int64_t n, int64_t o) { return at(dy, n, o); },
                   [&](int64_t o, int64_t i) { return at(wf, o, i); }, "linear_backward_input BF16 blocks");
  }
}

TEST(GemmCpu, LinearBackwardWeightMatchesFloat64) {
  std::mt19937 rng(14);
  for (auto [N, in, out] : kShapes)
    for (bool accumulate : {false, true}) {
      const Tensor dy = random_f32({N, out}, rng), x = random_f32({N, in}, rng), dw0 = random_f32({out, in}, rng);
      Tensor dw = dw0.clone();
      ops::linear_backward_weight(dy, x, dw, accumulate);
      expect_product(dw, accumulate ? &dw0 : nullptr, N, [&](int64_t o, int64_t n) { return at(dy, n, o); },
                     [&](int64_t n, int64_t i) { return at(x, n, i); },
                     "linear_backward_weight " + std::to_string(N) + "x" + std::to_string(in) + "x" +
                         std::to_string(out) + (accumulate ? " accumulate" : ""));
    }
}

TEST(GemmCpu, EmptyInnerDimensionsAreZeroOrUnchanged) {
  std::mt19937 rng(15);
  const Tensor dw0 = random_f32({4, 5}, rng);
  Tensor dw = dw0.clone();
  ops::linear_backward_weight(Tensor::empty({0, 4}, DType::F32), Tensor::empty({0, 5}, DType::F32), dw, true);
  EXPECT_TRUE(same_bits(dw, dw0));
  ops::linear_backward_weight(Tensor::empty({0, 4}, DType::F32), Tensor::empty({0, 5}, DType::F32), dw, false);
  for (int64_t i = 0; i < dw.numel(); ++i) EXPECT_EQ(dw.data<float>()[i], 0.0f);
  const Tensor y0 = random_f32({3, 2}, rng);
  Tensor y = y0.clone();
  ops::linear(Tensor::empty({3, 0}, DType::F32), Tensor::empty({2, 0}, DType::BF16), y, /*accumulate=*/true);
  EXPECT_TRUE(same_bits(y, y0));
  ops::linear(Tensor::empty({3, 0}, DType::F32), Tensor::empty({2, 0}, DType::BF16), y);
  for (int64_t i = 0; i < y.numel(); ++i) EXPECT_EQ(y.data<float>()[i], 0.0f);
}

// Every float dtype pair against half.h, on values with ±0, ±inf, NaNs, subnormals and ties.
TEST(GemmCpu, CastIsHalfHBitForBit) {
  std::mt19937 rng(16);
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u,
                                0x00000001u, 0x3f808000u, 0x3f818000u, 0x33000000u, 0x387ff000u, 0x477ff000u};
  std::uniform_int_distribution<uint32_t> any;
  while (bits.size() < 3 * 1000) bits.push_back(any(rng));
  Tensor f = Tensor::empty({3, 1000}, DType::F32);
  std::memcpy(f.raw(), bits.data(), f.nbytes());
  const DType types[] = {DType::F32, DType::BF16, DType::F16};
  // Sources of each dtype: the float32 patterns, and every 16-bit pattern (65536 = 64 × 1024).
  std::vector<Tensor> sources = {f};
  for (DType t : {DType::BF16, DType::F16}) {
    Tensor s = Tensor::empty({64, 1024}, t);
    for (int64_t i = 0; i < s.numel(); ++i) static_cast<uint16_t*>(s.raw())[i] = static_cast<uint16_t>(i);
    sources.push_back(s);
  }
  const auto to_f32 = [](const Tensor& t, int64_t i) {
    const uint16_t h = t.dtype() == DType::F32 ? 0 : static_cast<const uint16_t*>(t.raw())[i];
    return t.dtype() == DType::F32 ? t.data<float>()[i] : t.dtype() == DType::BF16 ? bf16_to_f32(h) : f16_to_f32(h);
  };
  for (const Tensor& src : sources)
    for (DType to : types) {
      Tensor dst = Tensor::empty(src.shape(), to);
      ops::cast(src, dst);
      if (to == src.dtype()) {
        EXPECT_TRUE(same_bits(dst, src)) << dtype_name(to);
        continue;
      }
      for (int64_t i = 0; i < src.numel(); ++i) {
        const float v = to_f32(src, i);
        uint32_t want = 0, got = 0;
        if (to == DType::F32) {
          std::memcpy(&want, &v, 4);
          got = static_cast<const uint32_t*>(dst.raw())[i];
        } else {
          want = to == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v);
          got = static_cast<const uint16_t*>(dst.raw())[i];
        }
        ASSERT_EQ(got, want) << dtype_name(src.dtype()) << " -> " << dtype_name(to) << " element " << i;
      }
    }
  Tensor same = f.clone();
  ops::cast(same, same);  // equal dtypes in place: a no-op
  EXPECT_TRUE(same_bits(same, f));
}

TEST(GemmCpu, BadInputsAreOneLineErrors) {
  std::mt19937 rng(17);
  const Tensor x = random_f32({4, 6}, rng), w = random_f32({3, 6}, rng);
  Tensor y = Tensor::empty({4, 3}, DType::F32);
  const Tensor w16 = Tensor::empty({3, 6}, DType::F16), xb = random_bf16({4, 6}, rng);
  expect_one_line_error([&] { ops::linear(x, w16, y); }, "linear: w must be 2-d F32 or BF16");  // F16 weight
  expect_one_line_error([&] { ops::linear(Tensor::empty({4, 6}, DType::F16), w, y); },
                        "linear: x must be 2-d F32 or BF16, got F16");  // an F16 activation
  expect_one_line_error([&] { ops::linear(x, random_f32({3, 5}, rng), y); }, "linear");
  Tensor y_in_x = Tensor::view(const_cast<void*>(x.raw()), {4, 3}, DType::F32, nullptr);
  expect_one_line_error([&] { ops::linear(x, w, y_in_x); }, "linear: y must not alias");

  const Tensor dy = random_f32({4, 3}, rng);
  Tensor dx = Tensor::empty({4, 6}, DType::F32);
  expect_one_line_error([&] { ops::linear_backward_input(dy, w16, dx); }, "linear_backward_input: w must be");
  expect_one_line_error([&] { ops::linear_backward_input(random_f32({4, 2}, rng), w, dx); }, "linear_backward_input");
  Tensor buf = random_f32({4, 6}, rng);  // dx starts 3 floats into dy: overlapping, not the same start
  const Tensor dy_in_buf = Tensor::view(buf.raw(), {2, 3}, DType::F32, nullptr);
  Tensor dx_in_buf = Tensor::view(buf.data<float>() + 3, {2, 6}, DType::F32, nullptr);
  expect_one_line_error([&] { ops::linear_backward_input(dy_in_buf, w, dx_in_buf); }, "dx must not alias");

  Tensor dw = Tensor::empty({3, 6}, DType::F32);
  expect_one_line_error([&] { ops::linear_backward_weight(dy, xb, dw); }, "linear_backward_weight");
  expect_one_line_error([&] { ops::linear_backward_weight(random_f32({5, 3}, rng), x, dw); }, "linear_backward_weight");
  Tensor dw_bad = Tensor::empty({6, 3}, DType::F32);
  expect_one_line_error([&] { ops::linear_backward_weight(dy, x, dw_bad); }, "linear_backward_weight");
  Tensor dw_in_x = Tensor::view(const_cast<void*>(x.raw()), {3, 6}, DType::F32, nullptr);
  expect_one_line_error([&] { ops::linear_backward_weight(dy, x, dw_in_x); }, "dw must not alias");

  Tensor i32 = Tensor::empty({4, 6}, DType::I32), b = Tensor::empty({4, 6}, DType::BF16);
  expect_one_line_error([&] { ops::cast(i32, b); }, "cast");
  expect_one_line_error([&] { ops::cast(x, i32); }, "cast");
  Tensor b_bad = Tensor::empty({6, 4}, DType::BF16);
  expect_one_line_error([&] { ops::cast(x, b_bad); }, "cast");
  Tensor b_in_x = Tensor::view(const_cast<void*>(x.raw()), {4, 6}, DType::BF16, nullptr);
  expect_one_line_error([&] { ops::cast(x, b_in_x); }, "cast: dst must not alias");  // a narrowing cast in place
}

}  // namespace
