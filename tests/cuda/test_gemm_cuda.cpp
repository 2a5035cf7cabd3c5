// The CUDA GEMM ops and cast (kernels/cuda/gemm.cu: cuBLASLt, CUBLAS_COMPUTE_32F) through the
// ops:: functions on CUDA tensors, against the same ops on CPU tensors on fresh random inputs
// per run (the seed is printed with every failure; RETAIN_TEST_SEED=n replays one): linear (F32
// and BF16 x), linear_backward_input (F32 and BF16 weights) and linear_backward_weight, odd shapes, row views
// that start off cuBLASLt's preferred alignment, accumulate; bitwise repeatable; cast exact for
// every dtype pair; mixed devices as one-line errors. Small shapes: compute-sanitizer runs the
// whole suite. Skips (visibly) without a CUDA build or device. Not yet run: no GPU has been lent.
//
// Bounds, elementwise, u = 2^-24, k the inner dimension, M = Σ_l |a_l·b_l| (+ |C₀| when
// accumulating) in float64 over the operands both sides multiplied:
//   F32 weights: each side is a float32 sum of k exact-rounded products (+ C₀) in some order,
//     ≤ (k + 2)·u·M from the exact value, so the two differ by ≤ 2(k + 2)·u·M.
//   BF16 weights: the GPU multiplies bf16(x) (or bf16(dy)) by the bf16 weight; the CPU reference
//     is the F32 path on exactly those rounded activations and the widened weight, so only the
//     accumulation differs. bf16 products are exact in fp32; tensor cores add aligned blocks of
//     up to 8 products with truncation (Fasi et al. 2021), ≤ 2(k + 8)·u·M; the CPU ≤ (k + 2)·u·M:
//     together (3k + 18)·u·M.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/base/half.h"
#include "kernels/ops.h"
#include "tests/cuda/gemm_cases.h"
#include "tests/cuda/cuda_test.h"

using namespace retain;
using retain::gemm_test::random_f32;

namespace {

constexpr double kU = 1.0 / (1 << 24);

Tensor gpu(const Tensor& t) { return t.to(Device::CUDA); }
Tensor host(const Tensor& t) { return t.on(Device::CPU); }


Tensor cast_to(const Tensor& t, DType dt) {  // on t's device
  Tensor out = Tensor::empty(t.shape(), dt, t.device());
  ops::cast(t, out);
  return out;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor ha = host(a), hb = host(b);
  return ha.nbytes() == hb.nbytes() && (ha.nbytes() == 0 || std::memcmp(ha.raw(), hb.raw(), ha.nbytes()) == 0);
}

// A strided view of a row-major F32 matrix as the operand of a product: (i, l) ↦ p[i·rs + l·cs].
struct Op {
  const float* p;
  int64_t rs, cs;
  double operator()(int64_t i, int64_t l) const { return p[i * rs + l * cs]; }
};

// |got − want| ≤ units·u·(Σ_l |A(i,l)·B(l,j)| + |C₀(i,j)|) for got, want [m, n].
void expect_close(const Tensor& got_any, const Tensor& want, const Op& a, const Op& b, int64_t k, const Tensor* c0,
                  double units, const std::string& what) {
  const Tensor got = host(got_any);
  const int64_t m = want.dim(0), n = want.dim(1);
  int bad = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double mag = c0 ? std::fabs(c0->data<float>()[i * n + j]) : 0.0;
      for (int64_t l = 0; l < k; ++l) mag += std::fabs(a(i, l) * b(l, j));
      const double g = got.data<float>()[i * n + j], w = want.data<float>()[i * n + j];
      const double err = std::fabs(g - w), bound = units * kU * mag;
      if (!(err <= bound) && bad++ < 5)
        ADD_FAILURE() << what << " [" << i << ", " << j << "]: got " << g << " want " << w << " error " << err
                      << " > bound " << bound;
    }
}

double units(bool bf16, int64_t k) { return bf16 ? 3.0 * k + 18 : 2.0 * (k + 2); }

struct Case {
  int64_t N, in, out;
};
// Odd sizes on every dimension; the 4096-token case gives linear_backward_weight a long inner sum.
const std::vector<Case> kCases = {{1, 1, 1},     {7, 13, 5},   {1, 257, 130}, {130, 7, 257},
                                  {257, 130, 7}, {33, 64, 1},  {2, 1024, 96}, {4096, 7, 3}};

class GemmCuda : public cuda_test::SeededTest {};

// Fails without a device: run_sanitizer.sh uses it to skip (exit 77) on machines without one.
TEST_F(GemmCuda, DISABLED_DevicePresent) { ASSERT_GT(cuda_device_count(), 0); }

TEST_F(GemmCuda, LinearAndInputGradientMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  for (const Case c : kCases)
    for (bool bf16 : {false, true})
      for (bool view : {false, true}) {  // view: operands start one row into a buffer (alignment 4 when in is odd)
        const std::string where = fmt::format("N {} in {} out {} {}{}", c.N, c.in, c.out, bf16 ? "BF16" : "F32",
                                              view ? " row view" : "");
        const Tensor x = random_f32({c.N + 1, c.in}, rng_), dy = random_f32({c.N + 1, c.out}, rng_);
        const Tensor xs = view ? x.rows(1, c.N + 1) : x.rows(0, c.N);
        const Tensor dys = view ? dy.rows(1, c.N + 1) : dy.rows(0, c.N);
        const Tensor w32 = random_f32({c.out, c.in}, rng_);
        const Tensor w = bf16 ? cast_to(w32, DType::BF16) : w32, wf = bf16 ? cast_to(w, DType::F32) : w32;
        // The CPU reference multiplies what the GPU multiplies: bf16-rounded activations.
        const Tensor xr = bf16 ? cast_to(cast_to(xs.clone(), DType::BF16), DType::F32) : xs.clone();
        const Tensor dyr = bf16 ? cast_to(cast_to(dys.clone(), DType::BF16), DType::F32) : dys.clone();
        const Tensor xd = gpu(x), dyd = gpu(dy), wd = gpu(w);
        const Tensor xds = view ? xd.rows(1, c.N + 1) : xd.rows(0, c.N);
        const Tensor dyds = view ? dyd.rows(1, c.N + 1) : dyd.rows(0, c.N);

        for (bool accumulate : {false, true}) {
          const Tensor y0 = random_f32({c.N, c.out}, rng_);
          Tensor y = y0.clone(), yd = gpu(y0);
          ops::linear(xr, w, y, accumulate);
          ops::linear(xds, wd, yd, accumulate);
          expect_close(yd, y, {xr.data<float>(), c.in, 1}, {wf.data<float>(), 1, c.in}, c.in, accumulate ? &y0 : nullptr,
                       units(bf16, c.in) + (accumulate ? 2 : 0),
                       fmt::format("linear {} accumulate {}", where, accumulate));
          Tensor again = gpu(y0);
          ops::linear(xds, wd, again, accumulate);
          EXPECT_TRUE(same_bits(again, yd)) << "linear not repeatable " << where;
          // A BF16 x holding the same values (the attention output into o_proj): read in place by
          // BF16 weights, widened for F32 ones; the same bound against the same reference.
          const Tensor xb = cast_to(xr, DType::BF16), xbr = cast_to(xb, DType::F32);
          Tensor yb = gpu(y0), yb_want = y0.clone();
          ops::linear(gpu(xb), wd, yb, accumulate);
          ops::linear(xbr, w, yb_want, accumulate);
          expect_close(yb, yb_want, {xbr.data<float>(), c.in, 1}, {wf.data<float>(), 1, c.in}, c.in,
                       accumulate ? &y0 : nullptr, units(bf16, c.in) + (accumulate ? 2 : 0),
                       fmt::format("linear, BF16 x, {} accumulate {}", where, accumulate));
        }

        for (bool accumulate : {false, true}) {
          const Tensor dx0 = random_f32({c.N, c.in}, rng_);
          Tensor dx = dx0.clone(), dxd = gpu(dx0);
          ops::linear_backward_input(dyr, w, dx, accumulate);
          ops::linear_backward_input(dyds, wd, dxd, accumulate);
          expect_close(dxd, dx, {dyr.data<float>(), c.out, 1}, {wf.data<float>(), c.in, 1}, c.out,
                       accumulate ? &dx0 : nullptr, units(bf16, c.out) + (accumulate ? 2 : 0),
                       fmt::format("linear_backward_input {} accumulate {}", where, accumulate));
          Tensor dx_again = gpu(dx0);
          ops::linear_backward_input(dyds, wd, dx_again, accumulate);
          EXPECT_TRUE(same_bits(dx_again, dxd)) << "linear_backward_input not repeatable " << where;
        }
      }
}

TEST_F(GemmCuda, WeightGradientMatchesTheCpu) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  for (const Case c : kCases)
    for (bool accumulate : {false, true}) {
      const std::string where = fmt::format("N {} in {} out {} accumulate {}", c.N, c.in, c.out, accumulate);
      const Tensor dy = random_f32({c.N, c.out}, rng_), x = random_f32({c.N, c.in}, rng_),
                   dw0 = random_f32({c.out, c.in}, rng_);
      Tensor dw = dw0.clone(), dwd = gpu(dw0);
      ops::linear_backward_weight(dy, x, dw, accumulate);
      const Tensor dyd = gpu(dy), xd = gpu(x);
      ops::linear_backward_weight(dyd, xd, dwd, accumulate);
      expect_close(dwd, dw, {dy.data<float>(), 1, c.out}, {x.data<float>(), c.in, 1}, c.N, accumulate ? &dw0 : nullptr,
                   units(false, c.N) + (accumulate ? 2 : 0), "linear_backward_weight " + where);
      Tensor again = gpu(dw0);
      ops::linear_backward_weight(dyd, xd, again, accumulate);
      EXPECT_TRUE(same_bits(again, dwd)) << "not repeatable " << where;
    }
}

TEST_F(GemmCuda, EmptyInnerDimensionsAreZeroOrUnchanged) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  const Tensor dw0 = random_f32({4, 5}, rng_);
  const Tensor dy = Tensor::empty({0, 4}, DType::F32, Device::CUDA);
  const Tensor x = Tensor::empty({0, 5}, DType::F32, Device::CUDA);
  Tensor dw = gpu(dw0);
  ops::linear_backward_weight(dy, x, dw, true);
  EXPECT_TRUE(same_bits(dw, dw0));
  ops::linear_backward_weight(dy, x, dw, false);
  EXPECT_TRUE(same_bits(dw, Tensor::zeros({4, 5}, DType::F32)));
  const Tensor y0 = random_f32({3, 2}, rng_);
  Tensor y = gpu(y0);
  ops::linear(Tensor::empty({3, 0}, DType::F32, Device::CUDA), Tensor::empty({2, 0}, DType::BF16, Device::CUDA), y,
              /*accumulate=*/true);
  EXPECT_TRUE(same_bits(y, y0));
  ops::linear(Tensor::empty({3, 0}, DType::F32, Device::CUDA), Tensor::empty({2, 0}, DType::BF16, Device::CUDA), y);
  EXPECT_TRUE(same_bits(y, Tensor::zeros({3, 2}, DType::F32)));
}

// Every dtype pair equals the CPU cast bit for bit: random float32 patterns (NaNs, infinities,
// subnormals included by chance and by hand) and all 65536 patterns of each 16-bit type.
TEST_F(GemmCuda, CastEqualsTheCpu) {
  SKIP_WITHOUT_GPU();
  TRACE_SEED();
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u,
                                0x00000001u, 0x3f808000u, 0x3f818000u, 0x33000000u, 0x387ff000u, 0x477ff000u};
  std::uniform_int_distribution<uint32_t> any;
  while (bits.size() < 300 * 1001) bits.push_back(any(rng_));
  Tensor f = Tensor::empty({300, 1001}, DType::F32);
  std::memcpy(f.raw(), bits.data(), f.nbytes());
  std::vector<Tensor> sources = {f};
  for (DType t : {DType::BF16, DType::F16}) {
    Tensor s = Tensor::empty({64, 1024}, t);
    for (int64_t i = 0; i < s.numel(); ++i) static_cast<uint16_t*>(s.raw())[i] = static_cast<uint16_t>(i);
    sources.push_back(s);
  }
  for (const Tensor& src : sources)
    for (DType to : {DType::F32, DType::BF16, DType::F16}) {
      Tensor want = Tensor::empty(src.shape(), to), got = Tensor::empty(src.shape(), to, Device::CUDA);
      ops::cast(src, want);
      ops::cast(gpu(src), got);
      EXPECT_TRUE(same_bits(got, want)) << dtype_name(src.dtype()) << " -> " << dtype_name(to);
    }
}

TEST_F(GemmCuda, MixedDevicesAreOneLineErrors) {
  SKIP_WITHOUT_GPU();
  const auto message = [](auto&& call) -> std::string {
    try {
      call();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  const Tensor x = Tensor::zeros({2, 3}, DType::F32), w = Tensor::zeros({4, 3}, DType::BF16, Device::CUDA);
  Tensor y = Tensor::empty({2, 4}, DType::F32, Device::CUDA);
  Tensor dx = Tensor::empty({2, 3}, DType::F32, Device::CUDA);
  Tensor dw = Tensor::empty({4, 3}, DType::F32, Device::CUDA), b = Tensor::empty({2, 3}, DType::BF16, Device::CUDA);
  const Tensor dy = Tensor::zeros({2, 4}, DType::F32);
  for (const std::string& msg :
       {message([&] { ops::linear(x, w, y); }), message([&] { ops::linear_backward_input(dy, w, dx); }),
        message([&] { ops::linear_backward_weight(dy, gpu(x), dw); }), message([&] { ops::cast(x, b); })}) {
    EXPECT_NE(msg.find("all tensors must be on one device"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

}  // namespace
