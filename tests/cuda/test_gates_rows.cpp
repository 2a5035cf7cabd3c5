// The math of the CUDA retention-gate kernels (kernels/cuda/gates_rows.h) run on the CPU, in
// every build, against the CPU gates (model/gates/gates.cpp). Each kernel of
// kernels/cuda/gates.cu is emulated thread by thread over its launch grid, the bias gradient in
// the kernels' reduction order (one float64 partial per (token block, column), then the blocks
// in order), and composed as model/gates/gates.cpp composes them on CUDA tensors. The GEMMs
// between the kernels are made here exactly as the CPU path makes them (ops::linear forward,
// the same cblas_sgemm calls backward), so every difference left is in the kernels' math: the
// forward (a1, a2, z, logβ), the parameter gradients and dh must be bit-identical to the CPU
// gates', on random gates and on logits at ±100 and ±1e4.
// What the emulation cannot check is the CUDA plumbing and CUDA's expf/log1pf (≤ 2 ulp off
// glibc's) and cuBLASLt's GEMMs; tests/cuda/test_gates_cuda.cpp does, on a GPU.
#include <cblas.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/gates_rows.h"
#include "kernels/ops.h"
#include "model/gates/gates.h"
#include "tests/cuda/cuda_test.h"

using namespace retain;
using namespace retain::gates;
namespace rows = retain::cuda::gates_rows;

namespace {

// ---- the kernels, emulated over their grids -------------------------------------------------

// Every index a grid-stride kernel of kernels/cuda/gates.cu visits for n items, thread by thread.
template <typename F> void for_each_thread(int64_t n, F&& f) {
  if (n == 0) return;  // no launch
  const int64_t blocks = cuda::elem_blocks(n);  // the launch's grid
  const int64_t stride = blocks * cuda::kElemThreads;
  for (int64_t block = 0; block < blocks; ++block)
    for (int64_t tid = 0; tid < cuda::kElemThreads; ++tid)
      for (int64_t i = block * cuda::kElemThreads + tid; i < n; i += stride) f(i);
}

void bias_silu(Tensor& a, const Tensor& b, Tensor& s) {
  for_each_thread(a.numel(), [&](int64_t i) {
    rows::bias_silu_element(a.data<float>(), b.data<float>(), s.data<float>(), b.numel(), i);
  });
}
void bias_log_sigmoid(Tensor& z, const Tensor& b, Tensor& lb) {
  for_each_thread(z.numel(), [&](int64_t i) {
    rows::bias_log_sigmoid_element(z.data<float>(), b.data<float>(), lb.data<float>(), b.numel(), i);
  });
}
void silu(const Tensor& a, Tensor& s) {
  for_each_thread(a.numel(), [&](int64_t i) { s.data<float>()[i] = rows::silu(a.data<float>()[i]); });
}
void log_sigmoid_backward(const Tensor& z, const Tensor& g, Tensor& dz) {
  for_each_thread(z.numel(), [&](int64_t i) {
    dz.data<float>()[i] = rows::log_sigmoid_backward_element(g.data<float>()[i], z.data<float>()[i]);
  });
}
void times_silu_grad(Tensor& ds, const Tensor& a) {
  for_each_thread(a.numel(), [&](int64_t i) {
    ds.data<float>()[i] = rows::times_silu_grad_element(ds.data<float>()[i], a.data<float>()[i]);
  });
}

// gate_add_column_sums: the partials kernel (item k = block·N + j), then the totals kernel.
// Returns the float64 totals too, for the reduction tests.
std::vector<double> add_column_sums(const float* dy, int64_t T, int64_t N, float* db) {
  std::vector<double> totals(static_cast<size_t>(N), 0.0);
  if (T == 0 || N == 0) return totals;
  const int64_t blocks = rows::column_blocks(T);
  std::vector<double> partials(static_cast<size_t>(blocks * N));
  for_each_thread(blocks * N, [&](int64_t k) { partials[k] = rows::column_block_partial(dy, T, N, k / N, k % N); });
  for_each_thread(N, [&](int64_t j) {
    totals[j] = rows::column_total(partials.data(), blocks, N, j);
    db[j] = rows::add_total(db[j], totals[j]);
  });
  return totals;
}

// ---- the GEMMs, exactly as the CPU gates make them -------------------------------------------

Tensor linear(const Tensor& x, const Tensor& w) {
  Tensor y = Tensor::empty({x.dim(0), w.dim(0)}, DType::F32);
  ops::linear(x, w, y);
  return y;
}
// dW += dyᵀ·x (the GPU: linear_backward_weight, accumulate).
void backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw) {
  const int T = static_cast<int>(x.dim(0)), in = static_cast<int>(x.dim(1)), out = static_cast<int>(dy.dim(1));
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, T, 1.0f, dy.data<float>(), out, x.data<float>(), in,
              1.0f, dw.data<float>(), in);
}
// dx = dy·W (beta 0) or dx += dy·W (beta 1) (the GPU: linear_backward_input).
void backward_input(const Tensor& dy, const Tensor& w, Tensor& dx, float beta) {
  const int T = static_cast<int>(dy.dim(0)), in = static_cast<int>(w.dim(1)), out = static_cast<int>(w.dim(0));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, in, out, 1.0f, dy.data<float>(), out, w.data<float>(),
              in, beta, dx.data<float>(), in);
}

// ---- the gates on "device": model/gates/gates.cpp's CUDA path with the kernels emulated -------

int index_of(const RetentionGates& g, int64_t layer, const char* suffix) {
  const std::string name = gate_tensor_name(layer, suffix);
  for (size_t i = 0; i < g.parameters().size(); ++i)
    for (const std::string& n : g.parameters()[i].file_names)
      if (n == name) return static_cast<int>(i);
  ADD_FAILURE() << "no parameter " << name;
  return 0;
}

struct Slots {
  int w1, b1, w2, b2 = -1, w3 = -1, b;
};
Slots slots_of(const RetentionGates& g, int64_t l) {
  Slots s{index_of(g, l, "linear1.weight"), index_of(g, l, "linear1.bias"), index_of(g, l, "linear2.weight"), -1,
          -1, index_of(g, l, "bias")};
  if (g.kind() == GateKind::dbtrimkv) s.b2 = index_of(g, l, "linear2.bias"), s.w3 = index_of(g, l, "linear3.weight");
  return s;
}

struct Emulated {
  const RetentionGates& g;
  std::vector<Tensor> grads;  // the mirror gradients, zeroed as sync_to_device() leaves them

  explicit Emulated(const RetentionGates& gates) : g(gates) {
    for (const GateParameter& p : g.parameters()) grads.push_back(Tensor::zeros(p.value.shape(), DType::F32));
  }
  const Tensor& v(int slot) const { return g.parameters()[static_cast<size_t>(slot)].value; }

  Tensor forward(int64_t l, const Tensor& h, GateActivations& saved) const {
    const Slots s = slots_of(g, l);
    const int64_t T = h.dim(0), G = g.dims().gate_hidden;
    Tensor a1 = linear(h, v(s.w1)), s1 = Tensor::empty({T, G}, DType::F32);
    bias_silu(a1, v(s.b1), s1);
    Tensor a2, z;
    if (g.kind() == GateKind::trimkv) {
      z = linear(s1, v(s.w2));
    } else {
      a2 = linear(s1, v(s.w2));
      Tensor s2 = Tensor::empty({T, G}, DType::F32);
      bias_silu(a2, v(s.b2), s2);
      z = linear(s2, v(s.w3));
    }
    Tensor lb = Tensor::empty(z.shape(), DType::F32);
    bias_log_sigmoid(z, v(s.b), lb);
    saved = {a1, a2, z};
    return lb;
  }

  void affine_backward(const Tensor& x, int w, const Tensor& dy, int dw, int db, Tensor* dx, float beta) {
    if (x.dim(0) == 0) return;
    backward_weight(dy, x, grads[static_cast<size_t>(dw)]);
    add_column_sums(dy.data<float>(), dy.dim(0), dy.dim(1), grads[static_cast<size_t>(db)].data<float>());
    if (dx) backward_input(dy, v(w), *dx, beta);
  }

  void backward(int64_t l, const Tensor& h, const GateActivations& saved, const Tensor& dlb, Tensor* dh) {
    const Slots s = slots_of(g, l);
    const int64_t T = h.dim(0), G = g.dims().gate_hidden, K = g.dims().kv_heads;
    if (T == 0) return;
    Tensor dz = Tensor::empty({T, K}, DType::F32), s1 = Tensor::empty({T, G}, DType::F32),
           da1 = Tensor::empty({T, G}, DType::F32);
    log_sigmoid_backward(saved.z, dlb, dz);
    silu(saved.a1, s1);
    if (g.kind() == GateKind::trimkv) {
      affine_backward(s1, s.w2, dz, s.w2, s.b, &da1, 0.0f);
    } else {
      Tensor s2 = Tensor::empty({T, G}, DType::F32), da2 = Tensor::empty({T, G}, DType::F32);
      silu(saved.a2, s2);
      affine_backward(s2, s.w3, dz, s.w3, s.b, &da2, 0.0f);
      times_silu_grad(da2, saved.a2);
      affine_backward(s1, s.w2, da2, s.w2, s.b2, &da1, 0.0f);
    }
    times_silu_grad(da1, saved.a1);
    affine_backward(h, s.w1, da1, s.w1, s.b1, dh, 1.0f);
  }
};

// ---- helpers ----------------------------------------------------------------------------------

Tensor random_f32(const Shape& shape, double std, std::mt19937& rng) {
  std::normal_distribution<double> n(0, std);
  Tensor t = Tensor::empty(shape, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(n(rng));
  return t;
}

// O(1) random weights; the logit biases cycle through `biases` (offset per layer), and with
// `small_out` the last layer's weights are 1e-3-sized so that z ≈ b: the logits sit at the biases.
RetentionGates random_gates(const GateDims& d, const std::vector<double>& biases, bool small_out, std::mt19937& rng) {
  RetentionGates g = RetentionGates::init(d, 0.0, rng());
  int64_t offset = 0;
  for (GateParameter& p : g.parameters()) {
    const bool logit_bias = p.name().ends_with("retention_gate.bias");
    const bool out_weight = p.value.dim(0) == d.kv_heads && p.value.ndim() == 2;
    const double scale = p.value.ndim() == 2 ? 1.5 / std::sqrt(double(p.value.dim(1))) : 0.5;
    Tensor v = random_f32(p.value.shape(), small_out && out_weight ? 1e-3 : scale, rng);
    if (logit_bias) {
      for (int64_t k = 0; k < v.numel(); ++k)
        v.data<float>()[k] = static_cast<float>(biases[static_cast<size_t>(k + offset) % biases.size()]);
      offset += 1;
    }
    p.value.copy_from(v);
  }
  return g;
}

// Bitwise equality, naming the first difference.
void expect_same_bits(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const float a = got.data<float>()[i], b = want.data<float>()[i];
    if (std::memcmp(&a, &b, sizeof a) != 0) {
      ADD_FAILURE() << what << " [" << i << "]: emulated " << a << " cpu " << b << " (of " << got.numel() << ")";
      return;
    }
  }
}

struct Case {
  GateKind kind;
  int64_t L, D, G, K;
  std::vector<int64_t> Ts;  // per layer
};

// Forward and backward of every layer, CPU gates vs the emulation, bit for bit.
void check_case(const Case& c, const std::vector<double>& biases, bool small_out, std::mt19937& rng,
                double* zmin = nullptr, double* zmax = nullptr) {
  const GateDims d{c.kind, c.L, c.D, c.G, c.K};
  RetentionGates g = random_gates(d, biases, small_out, rng);
  g.zero_grad();
  Emulated emu(g);
  for (int64_t l = 0; l < c.L; ++l) {
    const int64_t T = c.Ts[static_cast<size_t>(l)];
    const std::string where = fmt::format("{} layer {} T {}", gate_kind_name(c.kind), l, T);
    const Tensor h = random_f32({T, c.D}, 1.0, rng), dlb = random_f32({T, c.K}, 1.0, rng),
                 dh0 = random_f32({T, c.D}, 1.0, rng);
    GateActivations want_saved, got_saved;
    const Tensor want = g.forward(l, h, &want_saved), got = emu.forward(l, h, got_saved);
    expect_same_bits(got, want, "logβ " + where);
    expect_same_bits(got_saved.a1, want_saved.a1, "a1 " + where);
    expect_same_bits(got_saved.z, want_saved.z, "z " + where);
    if (c.kind == GateKind::dbtrimkv) expect_same_bits(got_saved.a2, want_saved.a2, "a2 " + where);
    for (int64_t i = 0; i < got_saved.z.numel(); ++i) {
      const double z = got_saved.z.data<float>()[i];
      if (zmin) *zmin = std::min(*zmin, z);
      if (zmax) *zmax = std::max(*zmax, z);
      ASSERT_LE(got.data<float>()[i], 0.0f) << where;
    }
    Tensor want_dh = dh0.clone(), got_dh = dh0.clone();
    g.backward(l, h, want_saved, dlb, &want_dh);
    emu.backward(l, h, got_saved, dlb, &got_dh);
    expect_same_bits(got_dh, want_dh, "dh " + where);
  }
  // add_device_grads_to_host into zeroed CPU gradients: 0 + x, in parameter order. The layers
  // accumulated into the mirror as into the CPU gradients (a shared tensor: every layer).
  for (size_t i = 0; i < g.parameters().size(); ++i) {
    Tensor host = Tensor::zeros(emu.grads[i].shape(), DType::F32);
    for (int64_t k = 0; k < host.numel(); ++k) host.data<float>()[k] += emu.grads[i].data<float>()[k];
    for (int64_t k = 0; k < host.numel(); ++k)
      ASSERT_EQ(host.data<float>()[k], g.parameters()[i].grad.data<float>()[k])
          << gate_kind_name(c.kind) << " gradient " << g.parameters()[i].name() << " [" << k << "]";
  }
}

class GatesRows : public cuda_test::SeededTest {};

}  // namespace

TEST_F(GatesRows, LogSigmoidIsTheCpuOne) {
  TRACE_SEED();
  const float inf = std::numeric_limits<float>::infinity(), big = std::numeric_limits<float>::max();
  std::vector<float> xs = {0.0f, -0.0f, 1e-30f, -1e-30f, 1e-7f, -1e-7f, 1.0f, -1.0f, 17.0f, -17.0f, 18.0f, 88.0f,
                           -88.0f, 89.0f, -104.0f, 100.0f, -100.0f, 1e4f, -1e4f, big, -big, inf, -inf};
  std::uniform_real_distribution<float> u(-120.0f, 120.0f);
  for (int i = 0; i < 100000; ++i) xs.push_back(u(rng_));
  for (float x : xs) {
    const float got = rows::log_sigmoid(x), want = log_sigmoid(x);
    EXPECT_EQ(std::memcmp(&got, &want, sizeof got), 0) << x << ": " << got << " vs " << want;
  }
  const float nan = rows::log_sigmoid(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(nan)) << "a NaN logit must stay NaN, as on the CPU";
  // The extremes the backward meets: σ(−z) and silu' are finite, exact in the limits.
  EXPECT_EQ(rows::log_sigmoid_backward_element(2.0f, 1e4f), 0.0f);
  EXPECT_EQ(rows::log_sigmoid_backward_element(2.0f, -1e4f), 2.0f);
  EXPECT_EQ(rows::log_sigmoid_backward_element(2.0f, 100.0f), 2.0f * std::exp(-100.0f));
  EXPECT_EQ(rows::silu_grad(1e4f), 1.0f);
  EXPECT_EQ(rows::silu_grad(-1e4f), 0.0f);
  EXPECT_EQ(rows::silu(-1e4f), 0.0f);
  EXPECT_EQ(rows::silu(1e4f), 1e4f);
}

TEST_F(GatesRows, ForwardAndBackwardAreTheCpuGatesBitForBit) {
  TRACE_SEED();
  // T crosses the kColumnBlock = 256 token blocks of the bias gradient (1, 3 blocks, exactly 2).
  const std::vector<double> spread = {-60.0, 0.7, 35.0, -3.0, 2.0};
  double zmin = 1e9, zmax = -1e9;
  check_case({GateKind::trimkv, 3, 24, 20, 3, {1, 700, 512}}, spread, false, rng_, &zmin, &zmax);
  check_case({GateKind::dbtrimkv, 3, 16, 12, 5, {300, 7, 257}}, spread, false, rng_, &zmin, &zmax);
  check_case({GateKind::trimkv, 1, 8, 4, 1, {0}}, spread, false, rng_);
  EXPECT_LT(zmin, -40) << "the test must reach very negative logits";
  EXPECT_GT(zmax, 25) << "the test must reach large positive logits";
}

TEST_F(GatesRows, ExtremeLogits) {
  TRACE_SEED();
  // z ≈ b ∈ {±100, ±1e4}: logβ = −0 or −1e4, σ(−z) = 0 or 1 — the kernels must agree there too.
  const std::vector<double> extreme = {100.0, -100.0, 1e4, -1e4};
  double zmin = 1e9, zmax = -1e9;
  check_case({GateKind::trimkv, 2, 12, 10, 4, {300, 33}}, extreme, true, rng_, &zmin, &zmax);
  check_case({GateKind::dbtrimkv, 2, 12, 10, 4, {33, 300}}, extreme, true, rng_, &zmin, &zmax);
  EXPECT_LT(zmin, -9990);
  EXPECT_GT(zmax, 9990);
}

TEST_F(GatesRows, BiasGradientReduction) {
  TRACE_SEED();
  // With the logit bias at −1e4, σ(−z) = 1 exactly, so the CPU's ∂/∂b is exactly its float64
  // column sum of dlogβ: any dy can be fed to both reductions. Each column holds ±2^60 pairs at
  // random tokens among N(0, 1) values: at a partial of 2^60 a float64 ulp is 256, so which small
  // terms are absorbed depends on the order and the block boundaries, and the float32 result
  // shows it — a different order or block size would not be bit-identical.
  for (int64_t T : {1, 255, 256, 257, 1000}) {
    const int64_t K = 3;
    const GateDims d{GateKind::trimkv, 1, 8, 6, K};
    RetentionGates g = random_gates(d, {-1e4}, true, rng_);
    std::normal_distribution<float> n(0.0f, 1.0f);
    std::uniform_int_distribution<int64_t> pos(0, T - 1);
    Tensor dy = Tensor::empty({T, K}, DType::F32);
    for (int64_t i = 0; i < dy.numel(); ++i) dy.data<float>()[i] = n(rng_);
    const float spike = std::ldexp(1.0f, 60);
    for (int64_t j = 0; j < K && T > 1; ++j)
      for (int p = 0; p < 4; ++p) {
        dy.data<float>()[pos(rng_) * K + j] = spike;
        dy.data<float>()[pos(rng_) * K + j] = -spike;
      }
    GateActivations saved;
    const Tensor h = random_f32({T, 8}, 1.0, rng_);
    g.forward(0, h, &saved);
    g.zero_grad();
    g.backward(0, h, saved, dy);
    const Tensor& want = g.parameters()[static_cast<size_t>(index_of(g, 0, "bias"))].grad;
    std::vector<float> got(static_cast<size_t>(K), 0.0f);
    const std::vector<double> totals = add_column_sums(dy.data<float>(), T, K, got.data());
    for (int64_t j = 0; j < K; ++j) {
      EXPECT_EQ(got[j], want.data<float>()[j]) << "T " << T << " column " << j;
      // And the float64 total is the blocked sum written out here from the contract.
      double s = 0;
      for (int64_t b0 = 0; b0 < T; b0 += rows::kColumnBlock) {
        double part = 0;
        for (int64_t t = b0; t < std::min(T, b0 + rows::kColumnBlock); ++t) part += dy.data<float>()[t * K + j];
        s += part;
      }
      EXPECT_EQ(totals[j], s) << "T " << T << " column " << j;
    }
    // Accumulating: a second backward adds float32(db + total) again, as the CPU does.
    g.backward(0, h, saved, dy);
    add_column_sums(dy.data<float>(), T, K, got.data());
    for (int64_t j = 0; j < K; ++j) EXPECT_EQ(got[j], want.data<float>()[j]) << "accumulated, T " << T;
  }
}
