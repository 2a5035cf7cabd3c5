// The CUDA capacity span ops of context parallelism (kernels/cuda/capacity.cu's
// capacity_sums_span, capacity_hinge, capacity_grad_span) against the CPU reference span ops on
// fresh random inputs per run (seed printed, RETAIN_TEST_SEED=n replays one). A sequence of T
// tokens (packed documents crossing the cuts, padding) is cut into chunks of lengths that are
// not multiples of the 128-token tile, and every (row chunk, key chunk) pair runs as
// trainer/context_parallel.cpp's ring pairs them — a chunk with itself, with a wholly earlier
// chunk (a rectangle), with a later one (nothing) — each adding into one F64 buffer per chunk:
//   - S summed over the pairs within 1e-5 relative of the CPU's (float32 partials, as the
//     whole-sequence kernels; the CPU sums in float64), padding rows exactly 0;
//   - the hinge of those S (local and global) as the CPU's from the same S: the count exactly,
//     the sum and g to 1e-12;
//   - dlogβ summed over the pairs for a g from the CPU hinge, within 1e-5 relative;
// and the bad pairs as one-line errors. Skips (visibly) without a CUDA build or device.
#include <gtest/gtest.h>

#include "tests/cuda/cuda_test.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/ops.h"
#include "kernels/retention.h"
#include "kernels/retention_spans.h"
#include "kernels/tensor.h"
#include "tests/retention/random_inputs.h"
#include "tests/retention/reference.h"

using namespace retain;
using namespace retain::test;

namespace {

struct SpanCase {
  int64_t L, T, K, max_doc;
  std::vector<int64_t> cuts;  // chunk x is [cuts[x], cuts[x + 1])
};

const std::vector<SpanCase> kCases = {
    {2, 300, 3, 90, {0, 128, 150, 300}},
    {1, 520, 2, 400, {0, 1, 129, 300, 520}},
    {3, 260, 9, 30, {0, 100, 260}},
};

// An F64 tensor's values, from either device.
std::vector<double> values(const Tensor& t) {
  const Tensor host = t.to(Device::CPU);
  const double* p = host.data<double>();
  return std::vector<double>(p, p + host.numel());
}

Tensor zeros_f64(const Shape& shape, Device device) {
  Tensor t = Tensor::zeros(shape, DType::F64);
  return device == Device::CPU ? t : t.to(device);
}

// Layer-major [L, T, K] rows [a, b) of every layer, as a contiguous [L, b − a, K] copy.
Tensor layer_rows(const Tensor& x, int64_t a, int64_t b) {
  const int64_t L = x.dim(0), T = x.dim(1), K = x.dim(2);
  const Tensor host = x.to(Device::CPU);
  Tensor out = Tensor::empty({L, b - a, K}, x.dtype());
  const size_t es = dtype_size(x.dtype());
  for (int64_t l = 0; l < L; ++l)
    std::memcpy(static_cast<char*>(out.raw()) + static_cast<size_t>(l * (b - a) * K) * es,
                static_cast<const char*>(host.raw()) + static_cast<size_t>((l * T + a) * K) * es,
                static_cast<size_t>((b - a) * K) * es);
  return x.device() == Device::CPU ? out : out.to(x.device());
}

void check_case(const SpanCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const Tensor lb = Tensor::from_vector(random_log_betas(c.L, c.T, c.K, rng), {c.L, c.T, c.K});
  const Tensor doc = i32(packed_docs(c.T, rng, c.max_doc));
  const Tensor pos = ops::document_positions(doc);
  const size_t n = c.cuts.size() - 1;
  std::vector<Tensor> lbs, docs, poss;  // per chunk, CPU
  for (size_t x = 0; x < n; ++x) {
    lbs.push_back(layer_rows(lb, c.cuts[x], c.cuts[x + 1]));
    docs.push_back(doc.rows(c.cuts[x], c.cuts[x + 1]));
    poss.push_back(pos.rows(c.cuts[x], c.cuts[x + 1]));
  }
  const auto len = [&](size_t x) { return c.cuts[x + 1] - c.cuts[x]; };
  // S per row chunk over every key chunk, on both devices.
  std::vector<Tensor> S_cpu, S_gpu;
  for (size_t qi = 0; qi < n; ++qi) {
    S_cpu.push_back(zeros_f64({c.L, len(qi), c.K}, Device::CPU));
    S_gpu.push_back(zeros_f64({c.L, len(qi), c.K}, Device::CUDA));
    for (size_t ki = 0; ki < n; ++ki) {
      ops::capacity_sums_span(lbs[ki], docs[ki], c.cuts[ki], docs[qi], c.cuts[qi], S_cpu[qi]);
      ops::capacity_sums_span(lbs[ki].to(Device::CUDA), docs[ki].to(Device::CUDA), c.cuts[ki],
                              docs[qi].to(Device::CUDA), c.cuts[qi], S_gpu[qi]);
    }
    SCOPED_TRACE(::testing::Message() << "row chunk " << qi);
    const std::vector<double> got = values(S_gpu[qi]), want = values(S_cpu[qi]);
    EXPECT_LE(rel_err(got, want), 1e-5);
    for (size_t x = 0; x < got.size(); ++x) {
      if (docs[qi].data<int32_t>()[(x / static_cast<size_t>(c.K)) % static_cast<size_t>(len(qi))] < 0) {
        ASSERT_EQ(got[x], 0.0) << "padding row, element " << x;
      }
    }
  }
  // The hinge per chunk from the GPU's S, on both devices; dlogβ over every pair.
  for (ops::CapacityMode mode : {ops::CapacityMode::local, ops::CapacityMode::global}) {
    SCOPED_TRACE(mode == ops::CapacityMode::local ? "local" : "global");
    const double M = 2.5;
    std::vector<Tensor> g_cpu;
    for (size_t qi = 0; qi < n; ++qi) {
      const Tensor S_host = S_gpu[qi].to(Device::CPU);
      Tensor g = zeros_f64({c.L, len(qi), c.K}, Device::CPU), g_d = zeros_f64({c.L, len(qi), c.K}, Device::CUDA);
      const ops::CapacityLoss want = ops::capacity_hinge(S_host, docs[qi], poss[qi], M, mode, &g);
      const ops::CapacityLoss got = ops::capacity_hinge(S_gpu[qi], docs[qi].to(Device::CUDA),
                                                        poss[qi].to(Device::CUDA), M, mode, &g_d);
      EXPECT_EQ(got.positive, want.positive) << "row chunk " << qi;
      EXPECT_NEAR(got.sum, want.sum, 1e-12 * std::max(1.0, want.sum)) << "row chunk " << qi;
      EXPECT_LE(rel_err(values(g_d), values(g)), 1e-12) << "row chunk " << qi;
      g_cpu.push_back(g);
    }
    for (size_t ki = 0; ki < n; ++ki) {
      Tensor d_cpu = zeros_f64({c.L, len(ki), c.K}, Device::CPU), d_gpu = zeros_f64({c.L, len(ki), c.K}, Device::CUDA);
      for (size_t qi = 0; qi < n; ++qi) {
        ops::capacity_grad_span(lbs[ki], docs[ki], c.cuts[ki], docs[qi], c.cuts[qi], g_cpu[qi], d_cpu);
        ops::capacity_grad_span(lbs[ki].to(Device::CUDA), docs[ki].to(Device::CUDA), c.cuts[ki],
                                docs[qi].to(Device::CUDA), c.cuts[qi], g_cpu[qi].to(Device::CUDA), d_gpu);
      }
      EXPECT_LE(rel_err(values(d_gpu), values(d_cpu)), 1e-5) << "key chunk " << ki;
    }
  }
}

}  // namespace

TEST(CapacitySpanCuda, DISABLED_DevicePresent) { ASSERT_GT(cuda_device_count(), 0); }

TEST(CapacitySpanCuda, PairsMatchCpuReference) {
  SKIP_WITHOUT_GPU();
  const uint32_t seed = cuda_test::fresh_seed();
  std::cout << "seed " << seed << "\n";
  for (size_t x = 0; x < kCases.size(); ++x) {
    const SpanCase& c = kCases[x];
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " (RETAIN_TEST_SEED replays it) case " << x << ": L="
                                      << c.L << " T=" << c.T << " K=" << c.K);
    check_case(c, seed + static_cast<uint32_t>(x));
  }
}

TEST(CapacitySpanCuda, OverlappingSpansAreOneLineErrors) {
  SKIP_WITHOUT_GPU();
  const Tensor lb = Tensor::zeros({1, 100, 1}, DType::F32, Device::CUDA);
  const Tensor doc = Tensor::zeros({100}, DType::I32, Device::CUDA);
  Tensor S = Tensor::zeros({1, 100, 1}, DType::F64, Device::CUDA);
  try {  // rows [50, 150) against keys [0, 100)
    ops::capacity_sums_span(lb, doc, 0, doc, 50, S);
    ADD_FAILURE() << "an overlapping pair was accepted";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("capacity_sums_span: on CUDA the keys [0, 100)"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  try {  // S on the host, log_beta on the device
    Tensor S_host = Tensor::zeros({1, 100, 1}, DType::F64);
    ops::capacity_sums_span(lb, doc, 0, doc, 0, S_host);
    ADD_FAILURE() << "tensors on two devices were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("one device"), std::string::npos) << e.what();
  }
}
