// The training step on the GPU (trainer::compute_gradients with the model on a CUDA device:
// model/device_weights.h, every op through its CUDA kernel) against the same step on the CPU
// (LocalWeightProvider, the float32 reference whose gradients equal the TRIM-KV authors' code
// and float64 autograd): tiny random Qwen3s with both gate kinds, packed documents with
// padding, GQA, YaRN, one and two micro-batches; the bf16-weight GPU path and the F32-weight
// one; the GPU's MLP in several token chunks (the last one partial) against the CPU's one. Tolerances are the issue's: losses 1e-3 relative, each gate gradient ≤ 2e-2 relative
// L2 norm (the GPU rounds q, k, v, the probabilities and the bf16 path's GEMM inputs to bf16).
// Also the device memory the backward holds against docs/memory-plan.md (StepCudaMemory).
// Skips (visibly) without a CUDA build or device. Not yet run on a GPU: none has been lent;
// CI runs it on the CUDA emulator (kernels/cuda/emu).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "kernels/cuda/memory.h"
#include "model/device_weights.h"
#include "model/qwen3.h"
#include "model/student.h"
#include "model/gates/gates.h"
#include "model/tiny.h"
#include "model/weights.h"
#include "tests/cuda/cuda_test.h"
#include "kernels/dist/comm.h"
#include "trainer/step.h"

using namespace retain;
using namespace retain::trainer;

namespace {

namespace fs = std::filesystem;

struct Case {
  const char* name;
  gates::GateKind kind;
  int64_t head_dim;     // the CUDA attention kernels take 64 or 128
  double yarn_factor;   // > 1: YaRN
  int micro_batches;    // 2: gradient accumulation (the extra counting pass)
  DType weights;        // the GPU's matmul weights
  int64_t mlp_chunk;    // > 0: the GPU step's MLP chunk (set_mlp_chunk_tokens); the CPU keeps one chunk
  bool kv_input = false;  // gates reading [k ‖ v] (their input gradient joins dk, dv before the RoPE backward)
};

// Sets the process's MLP chunk for a scope (0: leaves it).
class MlpChunkScope {
 public:
  explicit MlpChunkScope(int64_t tokens) : previous_(tokens > 0 ? set_mlp_chunk_tokens(tokens) : 0) {}
  ~MlpChunkScope() {
    if (previous_ > 0) set_mlp_chunk_tokens(previous_);
  }
  MlpChunkScope(const MlpChunkScope&) = delete;
  MlpChunkScope& operator=(const MlpChunkScope&) = delete;

 private:
  int64_t previous_;
};

// A packed micro-batch of T tokens: documents of the given lengths, then padding.
MicroBatch packed(const std::vector<int64_t>& lengths, int64_t T, int64_t vocab, uint32_t seed) {
  MicroBatch mb{Tensor::empty({T}, DType::I32), Tensor::empty({T}, DType::I32), Tensor::empty({T}, DType::U8)};
  std::mt19937 rng(seed);
  int64_t t = 0;
  for (size_t d = 0; d < lengths.size(); ++d)
    for (int64_t i = 0; i < lengths[d]; ++i, ++t) mb.doc.data<int32_t>()[t] = static_cast<int32_t>(d);
  for (; t < T; ++t) mb.doc.data<int32_t>()[t] = -1;
  for (t = 0; t < T; ++t) {
    mb.ids.data<int32_t>()[t] = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
    mb.target_mask.data<uint8_t>()[t] = mb.doc.data<int32_t>()[t] >= 0 ? 1 : 0;
  }
  return mb;
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }

class StepCuda : public ::testing::TestWithParam<Case> {};

// Fails without a device: run_sanitizer.sh uses it to skip (exit 77) on machines without one.
TEST(StepCudaProbe, DISABLED_DevicePresent) { ASSERT_GT(cuda_device_count(), 0); }

TEST_P(StepCuda, EqualsTheCpuStep) {
  SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  const fs::path dir = fs::temp_directory_path() / fmt::format("retain_step_cuda_{}_{}", ::getpid(), c.name);
  fs::remove_all(dir);
  TinyModelOptions opt;
  opt.layers = 2, opt.hidden = 128, opt.heads = 4, opt.kv_heads = 2, opt.head_dim = c.head_dim;
  opt.intermediate = 256, opt.vocab = 300, opt.yarn_factor = c.yarn_factor, opt.seed = 7;
  opt.gate_kind = c.kind, opt.gate_hidden = 32, opt.gate_bias_init = 2.0;  // decay visible: a real capacity loss
  if (c.kv_input) opt.gate_input = gates::GateInput::kv;
  make_tiny_model(dir.string(), opt);
  auto ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(dir.string()));
  const std::string gate_file = (dir / "gates.safetensors").string();

  std::vector<MicroBatch> mbs{packed({90, 70, 60}, 256, opt.vocab, 1)};
  if (c.micro_batches == 2) mbs.push_back(packed({200, 40}, 256, opt.vocab, 2));
  LossConfig loss;
  loss.memory = 4;  // below S(t) ≈ 1/(1 − σ(2)) ≈ 8.4 of gates at bias 2: the hinge is active
  loss.mode = c.kind == gates::GateKind::dbtrimkv ? ops::CapacityMode::global : ops::CapacityMode::local;
  loss.loss_chunk = 100;
  auto comm = dist::make_local_comm();

  gates::RetentionGates cpu_gates = gates::RetentionGates::load(gate_file, ckpt->config());
  LocalWeightProvider cpu_weights(ckpt);
  cpu_gates.zero_grad();
  const StepLosses want = compute_gradients(cpu_weights, cpu_gates, mbs, loss, *comm);

  gates::RetentionGates gpu_gates = gates::RetentionGates::load(gate_file, ckpt->config());
  DeviceWeightProvider gpu_weights(ckpt, c.weights);
  gpu_gates.zero_grad();
  PhaseTimes times;
  StepLosses got;
  {
    const MlpChunkScope chunk(c.mlp_chunk);
    got = compute_gradients(gpu_weights, gpu_gates, mbs, loss, *comm, nullptr, &times);
  }
  EXPECT_EQ(mlp_chunk_tokens(), kMlpChunkTokens);

  EXPECT_EQ(got.positions, want.positions);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_GT(want.cap_positive, 0);
  EXPECT_LT(rel(got.kl_sum, want.kl_sum), 1e-3) << got.kl_sum << " vs " << want.kl_sum;
  EXPECT_LT(rel(got.ntp_sum, want.ntp_sum), 1e-3) << got.ntp_sum << " vs " << want.ntp_sum;
  EXPECT_LT(rel(got.cap_sum, want.cap_sum), 1e-3) << got.cap_sum << " vs " << want.cap_sum;
  EXPECT_LT(rel(got.total(loss), want.total(loss)), 1e-3);
  const auto& pw = cpu_gates.parameters();
  const auto& pg = gpu_gates.parameters();
  ASSERT_EQ(pw.size(), pg.size());
  for (size_t i = 0; i < pw.size(); ++i) {
    const Tensor& a = pg[i].grad;
    const Tensor& b = pw[i].grad;
    ASSERT_EQ(a.device(), Device::CPU) << "gradients come back to the host";
    double diff = 0, norm = 0;
    for (int64_t j = 0; j < b.numel(); ++j) {
      const double x = a.data<float>()[j], y = b.data<float>()[j];
      diff += (x - y) * (x - y);
      norm += y * y;
    }
    ASSERT_GT(norm, 0) << pw[i].name() << " has no gradient on the CPU";
    EXPECT_LE(std::sqrt(diff / norm), 2e-2) << pw[i].name();
  }
  EXPECT_GT(times.total(), 0);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Tiny, StepCuda,
    ::testing::Values(Case{"trimkv_d64", gates::GateKind::trimkv, 64, 0, 1, DType::BF16, 0},
                      Case{"dbtrimkv_d64", gates::GateKind::dbtrimkv, 64, 0, 1, DType::BF16, 0},
                      Case{"trimkv_d128_yarn", gates::GateKind::trimkv, 128, 4.0, 1, DType::BF16, 0},
                      Case{"dbtrimkv_accumulate", gates::GateKind::dbtrimkv, 64, 0, 2, DType::BF16, 0},
                      Case{"trimkv_f32_weights", gates::GateKind::trimkv, 64, 0, 2, DType::F32, 0},
                      // The MLP loop of every T > 8,192 run: 256 tokens in chunks of 100, 100
                      // and 56 (forward, recomputation and backward) against the CPU's one chunk.
                      Case{"dbtrimkv_mlp_chunk100", gates::GateKind::dbtrimkv, 64, 0, 2, DType::BF16, 100},
                      Case{"dbtrimkv_kv_input", gates::GateKind::dbtrimkv, 64, 0, 1, DType::BF16, 0, true}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// The device memory the student's forward leaves for the backward (the checkpoints: bf16
// layer inputs, the final norm's input and output, logβ, positions; after a warm-up pass, so
// cuBLASLt's workspace and the GEMM staging are already there) and the memory the GPU backward
// adds, from the stream-ordered pool (kernels/cuda/memory.h), against docs/memory-plan.md's
// accounting of one layer at a time,
// buffer by buffer (F32 A = [T, D], Q = [T, H·d], Kv = [T, K·d]; bf16 halves; c = the MLP
// chunk, min(T, mlp_chunk_tokens())), on top of dx, the running gradient:
//   recomputation, q narrowed:  stream, h, q and k before their norms, gate activations, logβ,
//                               the normed q and k and v in F32, q in bf16
//   recomputation's MLP:        stream, h, q and k before their norms, gate activations, logβ,
//                               q/k/v and the attention output in bf16, lse, h2 [c, D], three [c, I]
//   ∂attention narrowed:        h, the saved state, dlogβ [T, K], ∂loss/∂attention in F32 and
//                               in bf16
//   attention backward kernel:  h, the saved state, ∂loss/∂attention and dq, dk, dv in bf16,
//                               dlogβ [T, K], the kernel's rowsum(dout ∘ out) [T, H]
// (o_proj reads the bf16 attention output as it is, so its GEMM is no high point.) The
// high-water mark must be the largest of these, at most 64 KiB above it (small per-call
// tables; a driver's pool may round allocations up) and at most 16 KiB below: above means the
// plan misses a buffer, below that it counts one the code does not keep.
// Four shapes, one for each point to be the highest: the MLP (as one chunk, T ≤ 8,192, and in
// chunks of 384 tokens, the last one partial, as every T > 8,192 runs it), the narrowing of q
// (a wide stream, as many KV heads as query heads and a narrow MLP), ∂attention narrowed (many
// query heads on a narrow stream, as Qwen3-4B at 128K) and the kernel (as many KV heads as
// query heads on a narrow stream).
struct MemoryCase {
  const char* name;
  int64_t hidden, heads, kv_heads, intermediate, gate_hidden, T;
  const char* peak;   // which point the plan says is highest
  int64_t mlp_chunk;  // > 0: set_mlp_chunk_tokens for the case
};
void PrintTo(const MemoryCase& c, std::ostream* os) { *os << c.name; }

// The bytes of one buffer of each kind the plan counts, for T tokens of a case: F32 A = [T, D],
// Q = [T, H·d], Kv = [T, K·d] (bf16 copies are halves), lse [T, H], logβ [T, K], gate
// activations [T, G], positions [T], and the MLP chunk's tokens.
struct BufferBytes {
  int64_t A, Q, Kv, lse, lb, gate, pos, chunk;
};
BufferBytes buffer_bytes(const MemoryCase& c) {
  const int64_t T = c.T;
  return {T * c.hidden * 4, T * c.heads * 64 * 4, T * c.kv_heads * 64 * 4, T * c.heads * 4, T * c.kv_heads * 4,
          T * c.gate_hidden * 4, T * 4, std::min(T, mlp_chunk_tokens())};
}

// The case's tiny model (2 layers, head_dim 64, trimkv gates) on the device, and a packed
// batch of T tokens there.
class StepCudaMemory : public ::testing::TestWithParam<MemoryCase> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    c_ = GetParam();
    chunk_ = std::make_unique<MlpChunkScope>(c_.mlp_chunk);
    dir_ = fs::temp_directory_path() / fmt::format("retain_step_memory_{}_{}", ::getpid(), c_.name);
    fs::remove_all(dir_);
    opt_.layers = 2, opt_.hidden = c_.hidden, opt_.heads = c_.heads, opt_.kv_heads = c_.kv_heads;
    opt_.head_dim = 64, opt_.intermediate = c_.intermediate, opt_.vocab = 300, opt_.seed = 9;
    opt_.gate_kind = gates::GateKind::trimkv, opt_.gate_hidden = c_.gate_hidden, opt_.gate_bias_init = 2.0;
    make_tiny_model(dir_.string(), opt_);
    auto ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(dir_.string()));
    gates_ = std::make_unique<gates::RetentionGates>(
        gates::RetentionGates::load((dir_ / "gates.safetensors").string(), ckpt->config()));
    weights_ = std::make_unique<DeviceWeightProvider>(ckpt, DType::BF16);
    gates_->sync_to_device();
    const MicroBatch mb = packed({c_.T / 2, c_.T / 4, c_.T / 8}, c_.T, opt_.vocab, 3);
    ids_ = mb.ids.on(Device::CUDA), doc_ = mb.doc.on(Device::CUDA);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
    chunk_.reset();
  }
  MemoryCase c_{};
  std::unique_ptr<MlpChunkScope> chunk_;
  fs::path dir_;
  TinyModelOptions opt_;
  std::unique_ptr<gates::RetentionGates> gates_;
  std::unique_ptr<DeviceWeightProvider> weights_;
  Tensor ids_, doc_;
};

TEST_P(StepCudaMemory, BackwardHoldsOneLayerAtATime) {
  const MemoryCase& c = c_;
  const int64_t T = c.T, L = opt_.layers;
  const auto [A, Q, Kv, lse, lb, gate, pos, chunk] = buffer_bytes(c);
  std::mt19937 rng(4);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  auto random_on_device = [&](const Shape& shape) {
    Tensor t = Tensor::empty(shape, DType::F32);
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = n01(rng);
    return t.on(Device::CUDA);
  };
  const Tensor d_hidden = random_on_device({T, c.hidden}), d_log_beta = random_on_device({L, T, c.kv_heads});
  gates_->zero_grad();
  {  // a whole pass first: cuBLASLt's workspace, the GEMM staging at its size, the gates' grads
    const StudentPass warm = student_forward(*weights_, *gates_, ids_, doc_);
    student_backward(*weights_, *gates_, warm, d_hidden, d_log_beta);
  }
  cuda::synchronize();
  const size_t resident = cuda::device_memory_stats().in_use;
  const StudentPass pass = student_forward(*weights_, *gates_, ids_, doc_);
  cuda::synchronize();
  const size_t before = cuda::device_memory_stats().in_use;
  // What the forward leaves for the backward (memory-plan.md, "held through the whole
  // backward"): the bf16 layer inputs, the final norm's input and output F32 [T, D] (the step
  // frees the output after the loss), logβ [L, T, K], the positions; nothing else.
  const int64_t held = static_cast<int64_t>(before - resident);
  const int64_t held_plan = L * T * c.hidden * 2 + 2 * A + L * lb + pos;
  EXPECT_LE(held, held_plan + (64 << 10)) << "the forward holds more than the plan's checkpoints";
  EXPECT_GE(held, held_plan - (16 << 10));
  cuda::reset_device_memory_peak();
  student_backward(*weights_, *gates_, pass, d_hidden, d_log_beta);
  cuda::synchronize();
  const cuda::DeviceMemoryStats after = cuda::device_memory_stats();
  EXPECT_EQ(after.in_use, before) << "the backward left device memory behind";
  const int64_t added = static_cast<int64_t>(after.peak - before);

  const int64_t kept = Q + Kv + gate + 2 * lb;                 // q, k before their norms, gate activations, logβ
  const int64_t attention_state = (Q + 2 * Kv) / 2 + Q / 2 + lse;  // bf16 q, k, v and output, lse
  const int64_t narrowing = A /*dx*/ + 2 * A /*stream, h*/ + kept + Q + 2 * Kv /*normed q, k; v*/ + Q / 2;
  const int64_t mlp = A + 2 * A + kept + attention_state + chunk * (c.hidden + 3 * c.intermediate) * 4;
  const int64_t dout = A + A /*h*/ + kept + attention_state + lb /*dlogβ*/ + Q + Q / 2;
  const int64_t kernel = A + A + kept + attention_state + Q / 2 /*dout*/ + Q / 2 + Kv /*dq, dk, dv*/ + lb + lse;
  const int64_t plan = std::max({narrowing, mlp, dout, kernel});
  EXPECT_LE(added, plan + (64 << 10)) << "narrowing " << narrowing << ", MLP " << mlp << ", ∂attention " << dout
                                       << ", kernel " << kernel << " bytes";
  EXPECT_GE(added, plan - (16 << 10)) << "the plan counts more than the backward holds";
  const char* highest = plan == narrowing ? "narrowing" : plan == mlp ? "mlp" : plan == dout ? "dout" : "kernel";
  EXPECT_STREQ(highest, c.peak);
  std::printf("the forward holds %lld bytes (plan %lld); the backward adds %lld (plan: q narrowed %lld, MLP %lld, "
              "∂attention narrowed %lld, attention backward kernel %lld)\n",
              static_cast<long long>(held), static_cast<long long>(held_plan), static_cast<long long>(added),
              static_cast<long long>(narrowing), static_cast<long long>(mlp), static_cast<long long>(dout),
              static_cast<long long>(kernel));
}

// The teacher pass and the student's forward, each after a warm-up pass: what each adds to
// the pool at its highest (memory-plan.md items 2 and 3: the residual stream and one layer's
// temporaries; the student also its checkpoints so far, all L of them by the last layer, and
// logβ [L, T, K]) and what each keeps (the teacher its final hidden state only).
//   attention point:  x, h, q, k, v in F32 and q in bf16 (q narrowed before its F32 copy is
//                     freed), positions; the student also the layer's logβ [T, K]
//   MLP point:        x, h2 [c, D], gate and up [c, I] (SwiGLU in place), positions
TEST_P(StepCudaMemory, ForwardsHoldOneLayerAtATime) {
  const MemoryCase& c = c_;
  const int64_t T = c.T, L = opt_.layers;
  const auto [A, Q, Kv, lse, lb, gate, pos, chunk] = buffer_bytes(c);
  // Measures fn's pool high-water mark and what stays allocated afterwards (fn returns it).
  auto measure = [](auto fn) {
    { auto warm = fn(); }  // cuBLASLt's workspace and the GEMM staging grow here
    cuda::synchronize();
    const size_t before = cuda::device_memory_stats().in_use;
    cuda::reset_device_memory_peak();
    auto kept = fn();
    cuda::synchronize();
    const cuda::DeviceMemoryStats after = cuda::device_memory_stats();
    return std::pair<int64_t, int64_t>{static_cast<int64_t>(after.peak - before),
                                       static_cast<int64_t>(after.in_use - before)};
  };
  const auto teacher = measure([&] { return qwen3_hidden(*weights_, ids_, doc_); });
  const auto student = measure([&] { return student_forward(*weights_, *gates_, ids_, doc_); });

  const int64_t attention = 2 * A + Q + Q / 2 + 2 * Kv + pos;
  const int64_t mlp = A + chunk * c.hidden * 4 + 2 * chunk * c.intermediate * 4 + pos;
  const int64_t checkpoints = L * T * c.hidden * 2 + L * lb;  // bf16 layer inputs, logβ [L, T, K]
  const int64_t teacher_plan = std::max(attention, mlp), student_plan = std::max(attention + lb, mlp) + checkpoints;
  const int64_t student_keeps = L * T * c.hidden * 2 + 2 * A + L * lb + pos;  // + final input, hidden
  EXPECT_LE(teacher.first, teacher_plan + (64 << 10));
  EXPECT_GE(teacher.first, teacher_plan - (16 << 10));
  EXPECT_LE(teacher.second, A + (64 << 10)) << "the teacher keeps its final hidden state only";
  EXPECT_GE(teacher.second, A);
  EXPECT_LE(student.first, student_plan + (64 << 10));
  EXPECT_GE(student.first, student_plan - (16 << 10));
  EXPECT_LE(student.second, student_keeps + (64 << 10));
  EXPECT_GE(student.second, student_keeps);
  std::printf("teacher: peak %lld (plan %lld), keeps %lld; student forward: peak %lld (plan %lld), keeps %lld\n",
              static_cast<long long>(teacher.first), static_cast<long long>(teacher_plan),
              static_cast<long long>(teacher.second), static_cast<long long>(student.first),
              static_cast<long long>(student_plan), static_cast<long long>(student.second));
}

INSTANTIATE_TEST_SUITE_P(Tiny, StepCudaMemory,
                         ::testing::Values(MemoryCase{"mlp_peak", 96, 4, 1, 320, 40, 1024, "mlp", 0},
                                           MemoryCase{"mlp_chunked_peak", 96, 4, 1, 320, 40, 1024, "mlp", 384},
                                           MemoryCase{"narrowing_peak", 240, 4, 4, 16, 40, 1024, "narrowing", 0},
                                           MemoryCase{"dout_peak", 96, 32, 4, 192, 40, 256, "dout", 0},
                                           MemoryCase{"kernel_peak", 96, 4, 4, 64, 40, 1024, "kernel", 0}),
                         [](const ::testing::TestParamInfo<MemoryCase>& info) { return std::string(info.param.name); });


// Asking for the model on a GPU where there is none: one line, no crash.
TEST(StepCudaNoDevice, DeviceWeightsWithoutAGpuSayWhy) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present";
  const fs::path dir = fs::temp_directory_path() / fmt::format("retain_step_nodev_{}", ::getpid());
  TinyModelOptions opt;
  make_tiny_model(dir.string(), opt);
  auto ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(dir.string()));
  try {
    DeviceWeightProvider w(ckpt);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("no CUDA device"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  fs::remove_all(dir);
}

}  // namespace
