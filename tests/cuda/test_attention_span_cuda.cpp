// The CUDA span ops of context parallelism (kernels/cuda/gated_attention.cu's
// gated_attention_span / _span_backward, kernels/cuda/attention_merge.cu's merge_attention)
// against the CPU reference span ops, on fresh random inputs per run (seed printed,
// RETAIN_TEST_SEED=n replays one). A sequence of T tokens (documents crossing the cuts,
// padding) is cut into chunks of lengths that are not multiples of the 64-token block; every
// (query chunk, key chunk) pair runs as trainer/context_parallel.cpp's rings pair them: a chunk
// with itself, with a wholly earlier chunk (a rectangle) and with a later one (nothing).
//   - each pair's partial out and lse against the CPU span op (out ‖Δ‖/‖ref‖ ≤ 1e-2: bf16
//     operands; lse 1e-3; rows with no allowed key exactly 0 and −inf), every output poisoned;
//   - the pairs merged on the device against the CPU whole-sequence op (as one rank);
//   - the backward's sums over every pair, added into shared F32 buffers, against the CPU
//     whole-sequence backward given the merged out and lse (test_gated_attention_cuda.cpp's
//     tolerances and rounding floors);
// on the mma.sync kernels and on wgmma; the bad pairs as one-line errors. Skips (visibly)
// without a CUDA build or device.
#include <gtest/gtest.h>

#include "tests/cuda/attention_cases.h"
#include "tests/cuda/cuda_test.h"

#include <cmath>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/retention.h"
#include "kernels/retention_spans.h"
#include "kernels/tensor.h"

using namespace retain;
using namespace attention_cases;

namespace {

struct SpanCase {
  Case c;
  std::vector<int64_t> cuts;  // chunk x is [cuts[x], cuts[x + 1])
};

const std::vector<SpanCase> kCases = {
    {{300, 4, 2, 64, Docs::contiguous}, {0, 64, 100, 230, 300}},
    {{257, 2, 1, 128, Docs::interleaved}, {0, 129, 130, 257}},
    {{200, 8, 2, 64, Docs::one}, {0, 70, 200}},
    {{330, 4, 4, 128, Docs::contiguous}, {0, 1, 65, 193, 330}},
};

// Every pair's partial attention against the CPU span op, merged on the device; returns the
// merged out and lse (F32, device) of the whole sequence.
std::pair<Tensor, Tensor> check_forward(const Problem& p, const std::vector<int64_t>& cuts) {
  const Case& c = p.c;
  Tensor out = Tensor::zeros({c.T, c.H, c.d}, DType::F32).to(Device::CUDA);
  Tensor lse = Tensor::from_vector<float>(std::vector<float>(static_cast<size_t>(c.T * c.H), -INFINITY), {c.T, c.H})
                   .to(Device::CUDA);
  for (size_t qi = 0; qi + 1 < cuts.size(); ++qi) {
    const int64_t q0 = cuts[qi], q1 = cuts[qi + 1];
    for (size_t ki = 0; ki + 1 < cuts.size(); ++ki) {
      const int64_t k0 = cuts[ki], k1 = cuts[ki + 1];
      SCOPED_TRACE(::testing::Message() << "queries [" << q0 << ", " << q1 << "), keys [" << k0 << ", " << k1 << ")");
      Tensor part = poisoned({q1 - q0, c.H, c.d}, DType::F32), part_lse = poisoned({q1 - q0, c.H}, DType::F32);
      ops::gated_attention_span(p.q.device.rows(q0, q1), p.doc_dev.rows(q0, q1), q0, p.k.device.rows(k0, k1),
                                p.v.device.rows(k0, k1), p.lb_dev.rows(k0, k1), p.doc_dev.rows(k0, k1), k0, p.scale,
                                part, part_lse);
      Tensor want = Tensor::empty({q1 - q0, c.H, c.d}, DType::F32), want_lse = Tensor::empty({q1 - q0, c.H}, DType::F32);
      ops::gated_attention_span(p.q.host.rows(q0, q1), p.doc_host.rows(q0, q1), q0,
                                p.k.host.rows(k0, k1), p.v.host.rows(k0, k1), p.lb_host.rows(k0, k1),
                                p.doc_host.rows(k0, k1), k0, p.scale, want, want_lse);
      const std::vector<double> got_o = host_values(part), got_l = host_values(part_lse), want_o = host_values(want),
                                want_l = host_values(want_lse);
      EXPECT_LE(rel_err(got_o, want_o, "partial out"), 1e-2);
      int bad = 0;  // the first few bad rows are reported
      for (size_t x = 0; x < want_l.size() && bad < 3; ++x) {
        bool ok = true;
        if (std::isinf(want_l[x])) {
          ok = got_l[x] == want_l[x];
          for (size_t j = 0; j < static_cast<size_t>(c.d); ++j) ok = ok && got_o[x * static_cast<size_t>(c.d) + j] == 0.0;
        } else {
          ok = std::abs(got_l[x] - want_l[x]) <= 1e-3 * (1 + std::abs(want_l[x]));
        }
        if (!ok) ++bad;
        EXPECT_TRUE(ok) << "row " << x << ": lse " << got_l[x] << ", want " << want_l[x]
                        << " (a row with no allowed key: out exactly 0, lse −inf)";
      }
      Tensor o = out.rows(q0, q1), l = lse.rows(q0, q1);
      ops::merge_attention(o, l, part, part_lse);
    }
  }
  const auto [want_out, want_lse] = cpu_forward(p);
  EXPECT_LE(rel_err(host_values(out), host_values(want_out), "merged out"), 1e-2);
  const std::vector<double> got_l = host_values(lse), want_l = host_values(want_lse);
  for (size_t x = 0; x < want_l.size(); ++x) {
    if (std::isinf(want_l[x]))
      EXPECT_EQ(got_l[x], want_l[x]) << "merged lse row " << x;
    else
      EXPECT_NEAR(got_l[x], want_l[x], 1e-3 * (1 + std::abs(want_l[x]))) << "merged lse row " << x;
  }
  return {out, lse};
}

// Every pair's backward added into whole-sequence F32 sums, against the CPU whole backward
// given the merged out and lse.
void check_backward(const Problem& p, const std::vector<int64_t>& cuts, const Tensor& out, const Tensor& lse) {
  const Case& c = p.c;
  Tensor dq = Tensor::zeros({c.T, c.H, c.d}, DType::F32).to(Device::CUDA),
         dk = Tensor::zeros({c.T, c.K, c.d}, DType::F32).to(Device::CUDA),
         dv = Tensor::zeros({c.T, c.K, c.d}, DType::F32).to(Device::CUDA),
         dlb = Tensor::zeros({c.T, c.K}, DType::F32).to(Device::CUDA);
  for (size_t qi = 0; qi + 1 < cuts.size(); ++qi) {
    const int64_t q0 = cuts[qi], q1 = cuts[qi + 1];
    for (size_t ki = 0; ki + 1 < cuts.size(); ++ki) {
      const int64_t k0 = cuts[ki], k1 = cuts[ki + 1];
      Tensor dq_rows = dq.rows(q0, q1), dk_rows = dk.rows(k0, k1), dv_rows = dv.rows(k0, k1),
             dlb_rows = dlb.rows(k0, k1);
      ops::gated_attention_span_backward(p.q.device.rows(q0, q1), p.doc_dev.rows(q0, q1), q0, p.k.device.rows(k0, k1),
                                         p.v.device.rows(k0, k1), p.lb_dev.rows(k0, k1), p.doc_dev.rows(k0, k1), k0,
                                         p.scale, out.rows(q0, q1), lse.rows(q0, q1), p.dout.device.rows(q0, q1),
                                         dq_rows, dk_rows, dv_rows, dlb_rows);
    }
  }
  Results got{host_values(out), host_values(lse), host_values(dq), host_values(dk), host_values(dv), host_values(dlb)};
  Results want;
  cpu_backward(p, out.to(Device::CPU), lse.to(Device::CPU), want);
  const Floors floor = rounding_floors(p, got);
  const double tol = 1e-2;
  expect_close(got.dq, want.dq, floor.dq, tol, "dq");
  expect_close(got.dk, want.dk, floor.dk, tol, "dk");
  EXPECT_LE(rel_err(got.dv, want.dv, "dv"), tol);
  expect_close(got.dlb, want.dlb, floor.dlb, tol, "dlog_beta");
}

void spans_match_cpu_reference() {
  const uint32_t seed = cuda_test::fresh_seed();
  std::cout << "seed " << seed << "\n";
  for (size_t x = 0; x < kCases.size(); ++x) {
    const SpanCase& s = kCases[x];
    SCOPED_TRACE(::testing::Message() << "seed=" << seed + x << " (RETAIN_TEST_SEED replays case " << x << ") T="
                                      << s.c.T << " H=" << s.c.H << " K=" << s.c.K << " d=" << s.c.d);
    std::mt19937 rng(seed + static_cast<uint32_t>(x));
    const Problem p = make_problem(s.c, rng);
    const auto [out, lse] = check_forward(p, s.cuts);
    check_backward(p, s.cuts, out, lse);
  }
}

struct Pin {
  ScopedEnv forward, backward;
  explicit Pin(const char* kernels)
      : forward("RETAIN_ATTENTION_FORWARD", kernels), backward("RETAIN_ATTENTION_BACKWARD", kernels) {}
};

}  // namespace

// Run with --gtest_also_run_disabled_tests by tests/cuda/run_sanitizer.sh to ask "is there a
// device?" (fails without one).
TEST(AttentionSpanCuda, DISABLED_DevicePresent) { ASSERT_GT(cuda_device_count(), 0); }

TEST(AttentionSpanCuda, PairsMatchCpuReferenceMma) {
  SKIP_WITHOUT_GPU();
  const Pin mma("mma");
  spans_match_cpu_reference();
}

TEST(AttentionSpanCuda, PairsMatchCpuReferenceWgmma) {
  SKIP_WITHOUT_GPU();
  const Pin wgmma("wgmma");
  spans_match_cpu_reference();
}

TEST(AttentionSpanCuda, OverlappingSpansAreOneLineErrors) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(1);
  const Problem p = make_problem({130, 2, 1, 64, Docs::one}, rng);
  Tensor out = poisoned({100, 2, 64}, DType::F32), lse = poisoned({100, 2}, DType::F32);
  try {  // queries [30, 130) against keys [0, 100): neither the same span nor wholly before
    ops::gated_attention_span(p.q.device.rows(30, 130), p.doc_dev.rows(30, 130), 30, p.k.device.rows(0, 100),
                              p.v.device.rows(0, 100), p.lb_dev.rows(0, 100), p.doc_dev.rows(0, 100), 0, p.scale, out,
                              lse);
    ADD_FAILURE() << "an overlapping pair was accepted";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("gated_attention_span: on CUDA the keys [0, 100)"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  try {  // F32 queries on the device: CUDA takes BF16
    const Tensor q32 = p.q.host.to(Device::CUDA);
    ops::gated_attention_span(q32.rows(0, 100), p.doc_dev.rows(0, 100), 0, p.k.device.rows(0, 100),
                              p.v.device.rows(0, 100), p.lb_dev.rows(0, 100), p.doc_dev.rows(0, 100), 0, p.scale, out,
                              lse);
    ADD_FAILURE() << "F32 queries on CUDA were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be BF16"), std::string::npos) << e.what();
  }
}
