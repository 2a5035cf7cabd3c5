// The retention ops against PyTorch autograd: tests/fixtures/retention/*.safetensors hold
// inputs and float64 outputs/gradients computed with dense torch ops and torch.autograd
// (make_fixtures.py beside them), an implementation and a differentiator written by others.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/retention.h"
#include "data/formats/safetensors.h"
#include "tests/retention/reference.h"

using namespace retain;
using namespace retain::test;

namespace {

std::string fixture(const char* name) { return std::string(RETAIN_FIXTURES_DIR) + "/retention/" + name; }

std::vector<double> f64(const formats::SafetensorsFile& f, const char* name) {
  const Tensor t = f.tensor(name).to_dtype(DType::F64);
  return std::vector<double>(t.data<double>(), t.data<double>() + t.numel());
}

}  // namespace

// Tolerances as in test_gated_attention.cpp (float32 op vs float64 truth): forward 2e-5
// relative, gradients 1e-4 relative (this case has no one-hot rows, so no magnitude floor).
TEST(TorchFixtures, GatedAttentionMatchesAutograd) {
  const formats::SafetensorsFile f = formats::SafetensorsFile::open(fixture("attention.safetensors"));
  const Tensor q = f.tensor("q").clone(), k = f.tensor("k").clone(), v = f.tensor("v").clone();
  const Tensor lb = f.tensor("log_beta").clone(), doc = f.tensor("doc").clone(), R = f.tensor("R").clone();
  const float scale = f.tensor("scale").data<float>()[0];
  const int64_t T = q.dim(0), H = q.dim(1), K = k.dim(1), d = q.dim(2);
  Tensor out = Tensor::empty({T, H, d}, DType::F32), lse = Tensor::empty({T, H}, DType::F32);
  ops::gated_attention(q, k, v, lb, doc, scale, out, lse);
  EXPECT_LT(rel_err(to_f64(out), f64(f, "out")), 2e-5);
  const std::vector<double> want_lse = f64(f, "lse");
  int padding_rows = 0;
  for (int64_t x = 0; x < T * H; ++x) {
    if (std::isinf(want_lse[x])) {
      ++padding_rows;
      EXPECT_EQ(lse.data<float>()[x], -INFINITY);
    } else {
      EXPECT_NEAR(lse.data<float>()[x], want_lse[x], 1e-4);
    }
  }
  EXPECT_GT(padding_rows, 0);

  Tensor dq = Tensor::empty({T, H, d}, DType::F32), dk = Tensor::empty({T, K, d}, DType::F32);
  Tensor dv = Tensor::empty({T, K, d}, DType::F32), dlb = Tensor::empty({T, K}, DType::F32);
  ops::gated_attention_backward(q, k, v, lb, doc, scale, out, lse, R, dq, dk, dv, dlb);
  EXPECT_LT(rel_err(to_f64(dq), f64(f, "dq")), 1e-4);
  EXPECT_LT(rel_err(to_f64(dk), f64(f, "dk")), 1e-4);
  EXPECT_LT(rel_err(to_f64(dv), f64(f, "dv")), 1e-4);
  EXPECT_LT(rel_err(to_f64(dlb), f64(f, "dlog_beta")), 1e-4);
}

// Capacity: S to 1e-5 relative per entry, the hinge sums to 1e-5 and counts exactly, the
// gradients to 1e-4 relative (as in test_capacity.cpp).
TEST(TorchFixtures, CapacityMatchesAutograd) {
  const formats::SafetensorsFile f = formats::SafetensorsFile::open(fixture("capacity.safetensors"));
  const Tensor lb = f.tensor("log_beta").clone(), doc = f.tensor("doc").clone();
  const Tensor pos = f.tensor("positions").clone();
  const double M = f.tensor("memory").data<double>()[0];
  Tensor S = Tensor::empty(lb.shape(), DType::F32);
  ops::capacity_sums(lb, doc, S);
  const std::vector<double> want_S = f64(f, "S");
  for (size_t x = 0; x < want_S.size(); ++x) ASSERT_NEAR(S.data<float>()[x], want_S[x], 1e-5 * want_S[x]);
  for (auto [mode, name] : {std::pair{ops::CapacityMode::local, std::string("local")},
                            std::pair{ops::CapacityMode::global, std::string("global")}}) {
    SCOPED_TRACE(name);
    const ops::CapacityLoss got = ops::capacity_loss(lb, doc, pos, M, mode);
    const double want_sum = f.tensor(name + "_sum").data<double>()[0];
    EXPECT_NEAR(got.sum, want_sum, 1e-5 * want_sum);
    EXPECT_EQ(got.positive, f.tensor(name + "_count").data<int64_t>()[0]);
    Tensor g = Tensor::empty(lb.shape(), DType::F32);
    ops::capacity_loss_backward(lb, doc, pos, M, mode, 1.0, g);
    EXPECT_LT(rel_err(to_f64(g), f64(f, (name + "_grad").c_str())), 1e-4);
  }
}
