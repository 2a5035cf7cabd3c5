// The KVPOP scorer step (model/kvpop_step.h) with the frozen model on the GPU
// (DeviceWeightProvider: bf16 weights, the teacher through the CUDA kernels, the mLSTM through
// kernels/cuda/kvpop.cu) against the same step on the CPU (LocalWeightProvider, whose pass and
// gradients equal the float64 references of tests/kvpop/test_kvpop_step.cpp):
// - the teacher pass: the same decision slots (q, t_new: geometry only), the scorer inputs
//   [k; v] within the bf16 tolerance of the attention inputs, and the same boundary key and
//   label wherever the CPU's target makes the decision clear-cut (bf16 may flip near-ties);
// - the scorer step on the GPU pass against the same pass moved to the host: the mLSTM is
//   float64 on both devices, so losses, agreement and every gradient match to float32 rounding.
// Skips (visibly) without a CUDA build or device. Not yet run: no GPU has been lent.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "model/device_weights.h"
#include "model/kvpop/scorers.h"
#include "model/kvpop_step.h"
#include "model/tiny.h"
#include "model/weights.h"
#include "tests/cuda/cuda_test.h"

using namespace retain;
namespace fs = std::filesystem;

namespace {

Tensor i32(const std::vector<int32_t>& v) { return Tensor::from_vector<int32_t>(v, {static_cast<int64_t>(v.size())}); }

double rel_l2(const Tensor& got, const Tensor& want) {
  const Tensor g = got.on(Device::CPU);
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double a = g.data<float>()[i], b = want.data<float>()[i];
    diff += (a - b) * (a - b);
    norm += b * b;
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// Every HeadParams field of a and b, paired, for the gradient comparison.
std::vector<std::pair<const Tensor*, const Tensor*>> fields(const kvpop::HeadParams& a, const kvpop::HeadParams& b) {
  return {{&a.W_q, &b.W_q}, {&a.W_k, &b.W_k}, {&a.W_v, &b.W_v}, {&a.w_i, &b.w_i}, {&a.w_f, &b.w_f},
          {&a.b_i, &b.b_i}, {&a.b_f, &b.b_f}, {&a.w_o, &b.w_o}, {&a.b_o, &b.b_o}, {&a.theta, &b.theta}};
}

TEST(KvpopStepCuda, EqualsTheCpuStep) {
  SKIP_WITHOUT_GPU();
  const fs::path dir = fs::temp_directory_path() / fmt::format("retain_kvpop_step_cuda_{}", ::getpid());
  fs::remove_all(dir);
  TinyModelOptions opt;  // head_dim 64: the CUDA attention kernels take 64 and 128
  opt.layers = 2, opt.hidden = 128, opt.heads = 4, opt.kv_heads = 2, opt.head_dim = 64;
  opt.intermediate = 256, opt.vocab = 300, opt.seed = 11;
  make_tiny_model(dir.string(), opt);
  auto ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(dir.string()));

  // Two documents and padding.
  std::vector<int32_t> doc;
  for (auto [id, len] : std::vector<std::pair<int32_t, int>>{{0, 150}, {1, 90}, {-1, 16}})
    doc.insert(doc.end(), static_cast<size_t>(len), id);
  std::mt19937 rng(3);
  std::vector<int32_t> ids(doc.size());
  for (int32_t& t : ids) t = std::uniform_int_distribution<int32_t>(0, 299)(rng);
  const kvpop::StepSettings s{8, 2, 4, 1.0};

  LocalWeightProvider cpu_weights(ckpt);
  DeviceWeightProvider gpu_weights(ckpt);
  const kvpop::TeacherPass want = kvpop::teacher_pass(cpu_weights, i32(ids), i32(doc), s);
  const kvpop::TeacherPass got = kvpop::teacher_pass(gpu_weights, i32(ids), i32(doc), s);
  EXPECT_EQ(got.device, Device::CUDA);
  EXPECT_EQ(got.doc.device(), Device::CPU);
  ASSERT_EQ(got.x.size(), want.x.size());
  EXPECT_EQ(got.num_decisions, want.num_decisions);
  ASSERT_GT(want.num_decisions, 0);

  int64_t clear = 0, clear_same = 0, same_b = 0, total = 0;
  for (size_t l = 0; l < want.x.size(); ++l) {
    ASSERT_EQ(got.x[l].size(), want.x[l].size());
    for (size_t kv = 0; kv < want.x[l].size(); ++kv) {
      ASSERT_EQ(got.x[l][kv].device(), Device::CPU);
      // k, v are the attention inputs, which CUDA keeps in bf16 (2^-9 relative each).
      EXPECT_LE(rel_l2(got.x[l][kv], want.x[l][kv]), 1e-2) << "layer " << l << " head " << kv;
      const auto& dg = got.decisions[l][kv];
      const auto& dw = want.decisions[l][kv];
      ASSERT_EQ(dg.size(), dw.size()) << "layer " << l << " head " << kv;
      for (size_t i = 0; i < dw.size(); ++i) {
        ASSERT_EQ(dg[i].q, dw[i].q);
        ASSERT_EQ(dg[i].t_new, dw[i].t_new);
        ++total;
        if (dg[i].b != dw[i].b) continue;
        ++same_b;
        // The same pair: the label may differ only where the float32 target nearly ties.
        if (dw[i].margin > 0.05f) {
          ++clear;
          if (dg[i].y == dw[i].y) ++clear_same;
          EXPECT_NEAR(dg[i].margin, dw[i].margin, 0.05 + 0.05 * dw[i].margin) << "decision " << i;
        }
      }
    }
  }
  EXPECT_EQ(clear_same, clear);
  // The boundary key is the k-th best by target: a near-tie among the eligible keys may pick
  // another, but not for most decisions.
  EXPECT_GE(static_cast<double>(same_b), 0.75 * static_cast<double>(total)) << same_b << " of " << total;
  std::printf("teacher pass on cuda vs cpu: %lld of %lld boundary keys equal; %lld clear-cut labels all equal\n",
              static_cast<long long>(same_b), static_cast<long long>(total), static_cast<long long>(clear));

  // The scorer step: the GPU pass (mLSTM on the GPU) vs the same pass on the host.
  const kvpop::Scorers scorers = kvpop::Scorers::init(kvpop::Scorers::dims_for(ckpt->config()),
                                                      kvpop::PolicyGeometry{s.window, s.sinks, s.topk}, 9);
  const auto params = scorers.head_values();
  kvpop::TeacherPass host = got;
  host.device = Device::CPU;
  host.doc_on_device = host.doc;
  std::vector<std::vector<kvpop::HeadParams>> g_gpu, g_cpu;
  int64_t agreed_gpu = 0, agreed_cpu = 0;
  const double margin_scale = got.num_decisions / got.margin_sum, grad_scale = 1.0 / got.num_decisions;
  const double loss_gpu = kvpop::scorer_step(got, params, s, margin_scale, grad_scale, g_gpu, &agreed_gpu);
  const double loss_cpu = kvpop::scorer_step(host, params, s, margin_scale, grad_scale, g_cpu, &agreed_cpu);
  EXPECT_NEAR(loss_gpu, loss_cpu, 1e-6 * std::abs(loss_cpu));
  EXPECT_EQ(agreed_gpu, agreed_cpu);
  for (size_t l = 0; l < g_cpu.size(); ++l)
    for (size_t kv = 0; kv < g_cpu[l].size(); ++kv)
      for (auto [a, b] : fields(g_gpu[l][kv], g_cpu[l][kv])) {
        ASSERT_EQ(a->device(), Device::CPU);
        ASSERT_EQ(a->numel(), b->numel());
        EXPECT_LE(rel_l2(*a, *b), 1e-5) << "layer " << l << " head " << kv;
      }
  fs::remove_all(dir);
}

}  // namespace
