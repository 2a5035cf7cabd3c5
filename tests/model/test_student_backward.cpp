// The student's checkpointed forward and its backward (model/student.h) on tiny random Qwen3
// models (both gate kinds, GQA, YaRN so RoPE has an attention factor, several documents and
// padding). The loss is L(θ) = ⟨R, hidden⟩ + ⟨Q, logβ⟩ for fixed random R, Q; the gradient
// student_backward gives for every gate parameter is checked against central differences of
// the float32 forward (in a random direction over all parameters, and entry by entry), the
// independent reference a frozen float32 model allows. Also: the forward is bit-identical to
// qwen3_hidden / qwen3_forward, padding rows of ∂L/∂hidden change nothing, every parameter
// tensor gets a gradient from each loss term, layers are requested in the promised order, the
// backward holds one layer's buffers at a time (counted by host_tensor_memory), and the MLP's
// token chunks (several, the last one partial) equal one chunk.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "model/gates/gates.h"
#include "model/qwen3.h"
#include "model/rope_params.h"
#include "model/student.h"
#include "model/tiny.h"
#include "model/weights.h"

using namespace retain;
namespace fs = std::filesystem;

namespace {

bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// A LocalWeightProvider that records which layers were asked for, in order.
class RecordingProvider : public WeightProvider {
 public:
  explicit RecordingProvider(std::shared_ptr<const Qwen3Checkpoint> ckpt) : inner_(std::move(ckpt)) {}
  const Qwen3Config& config() const override { return inner_.config(); }
  const LayerWeights& layer(int64_t l) override {
    asked.push_back(l);
    return inner_.layer(l);
  }
  const Tensor& embedding() override { return inner_.embedding(); }
  const Tensor& final_norm() override { return inner_.final_norm(); }
  const Tensor& lm_head() override { return inner_.lm_head(); }
  std::vector<int64_t> asked;

 private:
  LocalWeightProvider inner_;
};

struct Case {
  const char* name;
  gates::GateKind kind;
  double yarn_factor;
  uint64_t seed;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }  // readable CTest names

constexpr int64_t kLayers = 2, kHidden = 32, kHeads = 4, kKv = 2, kHeadDim = 16, kInter = 48, kVocab = 259,
                  kGateHidden = 12;

class StudentBackward : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const Case& c = GetParam();
    dir_ = fs::temp_directory_path() / ("retain_student_bwd_" + std::to_string(::getpid()) + "_" + c.name);
    TinyModelOptions opt;
    opt.layers = kLayers, opt.hidden = kHidden, opt.heads = kHeads, opt.kv_heads = kKv, opt.head_dim = kHeadDim;
    opt.intermediate = kInter, opt.vocab = kVocab, opt.yarn_factor = c.yarn_factor, opt.seed = c.seed;
    opt.tie = c.kind == gates::GateKind::trimkv;
    make_tiny_model(dir_.string(), opt);
    ckpt_ = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(dir_.string()));
    weights_ = std::make_unique<RecordingProvider>(ckpt_);

    // Gates whose every parameter matters: O(1) pre-activations (weights 1/sqrt(fan_in), random
    // b1, b2) and logit biases around 2 (β ≈ 0.88, a visible decay over ~40 tokens).
    gates_ = gates::RetentionGates::init({c.kind, kLayers, kHidden, kGateHidden, kKv}, 2.0, c.seed + 7);
    std::mt19937_64 rng(c.seed + 11);
    for (gates::GateParameter& p : gates_.parameters()) {
      float* v = p.value.data<float>();
      const bool logit_bias = p.name().ends_with("retention_gate.bias");
      const double std = p.value.ndim() == 2 ? 1.0 / std::sqrt(double(p.value.dim(1))) : (logit_bias ? 0.7 : 0.5);
      std::normal_distribution<double> n(logit_bias ? 2.0 : 0.0, std);
      for (int64_t i = 0; i < p.value.numel(); ++i) v[i] = static_cast<float>(n(rng));
    }

    // 40 tokens: three documents (the first continues from an earlier sequence; it still starts
    // at position 0) then padding.
    std::vector<int32_t> doc;
    for (auto [id, len] : std::vector<std::pair<int32_t, int>>{{7, 13}, {8, 15}, {9, 7}, {-1, 5}})
      doc.insert(doc.end(), static_cast<size_t>(len), id);
    T_ = static_cast<int64_t>(doc.size());
    std::uniform_int_distribution<int32_t> tok(0, kVocab - 1);
    std::vector<int32_t> ids(doc.size());
    for (int32_t& t : ids) t = tok(rng);
    ids_ = Tensor::from_vector(ids, {T_});
    doc_ = Tensor::from_vector(doc, {T_});
    R_ = random({T_, kHidden}, rng);
    Q_ = random({kLayers, T_, kKv}, rng);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  static Tensor random(const Shape& shape, std::mt19937_64& rng) {
    std::normal_distribution<double> n(0, 1);
    Tensor t = Tensor::empty(shape, DType::F32);
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(n(rng));
    return t;
  }
  static double dot(const Tensor& a, const Tensor& b) {
    double s = 0;
    for (int64_t i = 0; i < a.numel(); ++i) s += double(a.data<float>()[i]) * b.data<float>()[i];
    return s;
  }

  // L(θ) in float64 from the float32 forward; `with_q` adds the ⟨Q, logβ⟩ term.
  double loss(bool with_q) {
    const StudentPass pass = student_forward(*weights_, gates_, ids_, doc_);
    return dot(R_, pass.hidden) + (with_q ? dot(Q_, pass.log_beta) : 0.0);
  }
  // Gradients (a copy of each parameter's grad, in parameters() order) from student_backward.
  std::vector<Tensor> gradients(const Tensor& d_hidden, const Tensor& d_log_beta) {
    gates_.zero_grad();
    const StudentPass pass = student_forward(*weights_, gates_, ids_, doc_);
    student_backward(*weights_, gates_, pass, d_hidden, d_log_beta);
    std::vector<Tensor> out;
    for (const gates::GateParameter& p : gates_.parameters()) out.push_back(p.grad.clone());
    return out;
  }
  // θ += step·u for every parameter (u in parameters() order).
  void shift(const std::vector<Tensor>& u, double step) {
    auto& ps = gates_.parameters();
    for (size_t k = 0; k < ps.size(); ++k)
      for (int64_t i = 0; i < ps[k].value.numel(); ++i)
        ps[k].value.data<float>()[i] += static_cast<float>(step * u[k].data<float>()[i]);
  }
  std::vector<Tensor> snapshot() const {
    std::vector<Tensor> v;
    for (const gates::GateParameter& p : gates_.parameters()) v.push_back(p.value.clone());
    return v;
  }
  void restore(const std::vector<Tensor>& v) {
    auto& ps = gates_.parameters();
    for (size_t k = 0; k < ps.size(); ++k) std::memcpy(ps[k].value.raw(), v[k].raw(), v[k].nbytes());
  }

  // Central difference of L along u with Richardson extrapolation (error O(ε⁴)):
  // D(ε) = (L(θ+εu) − L(θ−εu))/2ε, result (4·D(ε/2) − D(ε))/3. θ is restored exactly.
  double directional_fd(const std::vector<Tensor>& u, double eps, bool with_q) {
    const std::vector<Tensor> theta = snapshot();
    auto central = [&](double e) {
      restore(theta), shift(u, e);
      const double plus = loss(with_q);
      restore(theta), shift(u, -e);
      const double minus = loss(with_q);
      restore(theta);
      return (plus - minus) / (2 * e);
    };
    return (4 * central(eps / 2) - central(eps)) / 3;
  }

  fs::path dir_;
  std::shared_ptr<const Qwen3Checkpoint> ckpt_;
  std::unique_ptr<RecordingProvider> weights_;
  gates::RetentionGates gates_;
  int64_t T_ = 0;
  Tensor ids_, doc_, R_, Q_;
};

}  // namespace

TEST_P(StudentBackward, ForwardIsBitIdenticalToQwen3) {
  // qwen3_forward = linear(qwen3_hidden, lm_head), teacher and student.
  const gates::RetentionGates* const with_gates = &gates_;
  for (const gates::RetentionGates* g : {static_cast<const gates::RetentionGates*>(nullptr), with_gates}) {
    const Tensor hidden = qwen3_hidden(*weights_, ids_, doc_, {}, g);
    Tensor logits = Tensor::empty({T_, kVocab}, DType::F32);
    ops::linear(hidden, weights_->lm_head(), logits);
    EXPECT_TRUE(bit_equal(logits, qwen3_forward(*weights_, ids_, doc_, {}, g))) << (g ? "student" : "teacher");
  }
  weights_->asked.clear();
  const StudentPass pass = student_forward(*weights_, gates_, ids_, doc_);
  EXPECT_EQ(weights_->asked, (std::vector<int64_t>{0, 1}));
  EXPECT_TRUE(bit_equal(pass.hidden, qwen3_hidden(*weights_, ids_, doc_, {}, &gates_)));
  EXPECT_TRUE(bit_equal(pass.positions, ops::document_positions(doc_)));
  ASSERT_EQ(pass.layer_inputs.size(), static_cast<size_t>(kLayers));
  ASSERT_EQ(pass.log_beta.shape(), (Shape{kLayers, T_, kKv}));

  // The checkpoints chain: layer l (recomputed, with and without saving intermediates) maps
  // x_l to x_{l+1} exactly, and logβ_l is the gate on the input-RMSNorm of x_l.
  const Qwen3Config& c = weights_->config();
  const RopeParams rope = compute_rope_params(c);
  for (int64_t l = 0; l < kLayers; ++l) {
    const LayerWeights& w = weights_->layer(l);
    const Tensor& next = l + 1 < kLayers ? pass.layer_inputs[static_cast<size_t>(l + 1)] : pass.final_input;
    Tensor x = pass.layer_inputs[static_cast<size_t>(l)].clone();
    qwen3_decoder_layer(c, w, rope, pass.positions, doc_, &gates_, l, x);
    EXPECT_TRUE(bit_equal(x, next)) << "layer " << l;
    x = pass.layer_inputs[static_cast<size_t>(l)].clone();
    DecoderLayerSaved saved;
    qwen3_decoder_layer(c, w, rope, pass.positions, doc_, &gates_, l, x, nullptr, &saved);
    EXPECT_TRUE(bit_equal(x, next)) << "layer " << l << " with saved intermediates";
    EXPECT_TRUE(bit_equal(saved.log_beta, pass.log_beta.rows(l, l + 1).reshape({T_, kKv}))) << "layer " << l;
    Tensor h = Tensor::empty({T_, kHidden}, DType::F32);
    ops::rmsnorm(pass.layer_inputs[static_cast<size_t>(l)], w.input_norm, static_cast<float>(c.rms_norm_eps), h);
    EXPECT_TRUE(bit_equal(gates_.forward(l, h), saved.log_beta)) << "layer " << l;
  }
}

TEST_P(StudentBackward, GradientMatchesFiniteDifferencesInARandomDirection) {
  std::mt19937_64 rng(GetParam().seed + 99);
  std::vector<Tensor> u;
  for (const gates::GateParameter& p : gates_.parameters()) u.push_back(random(p.value.shape(), rng));
  for (const bool with_q : {true, false}) {
    const std::vector<Tensor> g = gradients(R_, with_q ? Q_ : Tensor());
    double analytic = 0, scale = 0;  // Σ grad·u, and Σ |grad·u| (the size of the terms)
    for (size_t k = 0; k < g.size(); ++k)
      for (int64_t i = 0; i < g[k].numel(); ++i) {
        analytic += double(g[k].data<float>()[i]) * u[k].data<float>()[i];
        scale += std::fabs(double(g[k].data<float>()[i]) * u[k].data<float>()[i]);
      }
    // ε by experiment: the float32 rounding of L (~1e-5 absolute over its 1280 + 160 terms)
    // over 2ε and the extrapolated O(ε⁴) truncation balance near ε = 1e-2 (‖εu‖ ≈ 0.3, each
    // parameter moved by ~1e-2), where FD and analytic agreed to < 1e-5 relative on both
    // cases, against ~1e-4 at ε = 2e-3 or 3e-2. 1e-3 leaves a wide margin for other BLAS
    // builds yet catches any dropped path or wrong factor (those change Σ grad·u by far more).
    const double fd = directional_fd(u, 1e-2, with_q);
    EXPECT_NEAR(analytic, fd, 1e-3 * std::fabs(analytic)) << (with_q ? "R and Q" : "R only") << ": analytic "
                                                           << analytic << " fd " << fd << " Σ|grad·u| " << scale;
    EXPECT_GT(std::fabs(analytic), 1e-2 * scale);  // not a sum that cancels to noise
  }
}

TEST_P(StudentBackward, LargestGradientEntryOfEveryTensorMatchesFiniteDifferences) {
  const std::vector<Tensor> g = gradients(R_, Q_);
  const auto params = gates_.parameters();  // copies of the names and shapes
  for (size_t k = 0; k < params.size(); ++k) {
    int64_t best = 0;
    for (int64_t i = 0; i < g[k].numel(); ++i)
      if (std::fabs(g[k].data<float>()[i]) > std::fabs(g[k].data<float>()[best])) best = i;
    std::vector<Tensor> e;
    for (const gates::GateParameter& p : params) e.push_back(Tensor::zeros(p.value.shape(), DType::F32));
    e[k].data<float>()[best] = 1.0f;
    const double analytic = g[k].data<float>()[best];
    // One entry moves L far less than a direction over all of them, so the float32 noise of L
    // matters more: ε = 5e-2 (extrapolated truncation O(ε⁴) still negligible) gave errors up to
    // ~1e-4 absolute / 3e-4 relative on these models (1e-2: up to 2e-3). Tolerance 1e-3·|g| + 1e-3.
    const double fd = directional_fd(e, 5e-2, true);
    EXPECT_NEAR(analytic, fd, 1e-3 * std::fabs(analytic) + 1e-3)
        << params[k].name() << (params[k].shared() ? " (shared by all layers)" : "") << "[" << best << "]";
  }
}

TEST_P(StudentBackward, EveryParameterTensorGetsAGradientFromEachTerm) {
  // ⟨R, hidden⟩ alone reaches the gates only through the gated attention; ⟨Q, logβ⟩ alone
  // only through the direct path. Each must reach every tensor (no silently dropped path).
  const std::vector<Tensor> from_hidden = gradients(R_, Tensor());
  const std::vector<Tensor> from_log_beta = gradients(Tensor::zeros({T_, kHidden}, DType::F32), Q_);
  const std::vector<Tensor> both = gradients(R_, Q_);
  const auto& params = gates_.parameters();
  for (size_t k = 0; k < params.size(); ++k) {
    auto max_abs = [](const Tensor& t) {
      double m = 0;
      for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(double(t.data<float>()[i])));
      return m;
    };
    EXPECT_GT(max_abs(from_hidden[k]), 1e-6) << params[k].name() << " from ⟨R, hidden⟩";
    EXPECT_GT(max_abs(from_log_beta[k]), 1e-6) << params[k].name() << " from ⟨Q, logβ⟩";
    // The backward is linear in (d_hidden, d_log_beta).
    for (int64_t i = 0; i < both[k].numel(); ++i)
      EXPECT_NEAR(both[k].data<float>()[i], from_hidden[k].data<float>()[i] + from_log_beta[k].data<float>()[i],
                  1e-5 * (max_abs(both[k]) + 1e-6))
          << params[k].name() << "[" << i << "]";
  }
  // An explicit zero d_log_beta is the same as none.
  const std::vector<Tensor> zero_q = gradients(R_, Tensor::zeros({kLayers, T_, kKv}, DType::F32));
  for (size_t k = 0; k < params.size(); ++k) EXPECT_TRUE(bit_equal(zero_q[k], from_hidden[k])) << params[k].name();
}

TEST_P(StudentBackward, PaddingRowsOfDHiddenChangeNothing) {
  Tensor other = R_.clone();
  std::mt19937_64 rng(5);
  std::normal_distribution<double> n(0, 10);
  const int32_t* doc = doc_.data<int32_t>();
  int64_t padded = 0;
  for (int64_t t = 0; t < T_; ++t)
    if (doc[t] < 0) {
      ++padded;
      for (int64_t j = 0; j < kHidden; ++j) other.data<float>()[t * kHidden + j] = static_cast<float>(n(rng));
    }
  ASSERT_GT(padded, 0);
  const std::vector<Tensor> a = gradients(R_, Q_), b = gradients(other, Q_);
  for (size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(bit_equal(a[k], b[k])) << gates_.parameters()[k].name();
}

TEST_P(StudentBackward, AsksForLayersInReverseAndAddsIntoGrads) {
  gates_.zero_grad();
  const StudentPass pass = student_forward(*weights_, gates_, ids_, doc_);
  weights_->asked.clear();
  student_backward(*weights_, gates_, pass, R_, Q_);
  EXPECT_EQ(weights_->asked, (std::vector<int64_t>{1, 0}));
  std::vector<Tensor> once;
  for (const gates::GateParameter& p : gates_.parameters()) once.push_back(p.grad.clone());
  student_backward(*weights_, gates_, pass, R_, Q_);  // adds: twice the gradient
  const auto& params = gates_.parameters();
  for (size_t k = 0; k < params.size(); ++k)
    for (int64_t i = 0; i < once[k].numel(); ++i)
      EXPECT_NEAR(params[k].grad.data<float>()[i], 2 * once[k].data<float>()[i],
                  1e-6 * std::fabs(once[k].data<float>()[i]) + 1e-12);
  // Wrong shapes are internal errors, not crashes.
  EXPECT_THROW(student_backward(*weights_, gates_, pass, Tensor::zeros({T_, kHidden + 1}, DType::F32), Q_), Error);
  EXPECT_THROW(student_backward(*weights_, gates_, pass, R_, Tensor::zeros({kLayers, T_, kKv + 1}, DType::F32)),
               Error);
}

// The backward holds one layer's buffers at a time, each no longer than the order needs
// (docs/memory-plan.md is this order on a GPU): on a sequence long enough that the per-token
// buffers dominate, the live CPU tensors it adds on top of what the caller holds stay within the
// two high points of a layer, counted from the shapes —
//   recomputation + MLP chunk: dx, x_mid, h, q/k before their norms, q, k, v, attention output,
//                              gate activations, logβ, lse, one MLP chunk;
//   attention backward:        dx, h, q/k before their norms, q, k, v, output, gate activations,
//                              logβ, lse, dout, dq, dk, dv, dlogβ —
// plus 64 KiB for small tensors; and the recomputation alone (a layer's forward up to x_mid,
// from a copy of its input) adds no more than h, q/k before and after their norms, v, the
// attention output, gate activations, logβ and lse. Holding one more [T, D] (the layer input
// beside its copy, a separate o_proj product, an x_mid copy, dh during the attention backward)
// breaks a bound.
TEST_P(StudentBackward, BackwardHoldsOneLayerAtATime) {
  const int64_t T = 4096;
  std::vector<int32_t> ids(T), doc(T);
  std::mt19937_64 rng(GetParam().seed + 3);
  std::uniform_int_distribution<int32_t> tok(0, kVocab - 1);
  for (int64_t t = 0; t < T; ++t) ids[t] = tok(rng), doc[t] = static_cast<int32_t>(t / 1500);
  const Tensor id = Tensor::from_vector(ids, {T}), dc = Tensor::from_vector(doc, {T});
  const Tensor d_hidden = random({T, kHidden}, rng), d_log_beta = random({kLayers, T, kKv}, rng);
  const StudentPass pass = student_forward(*weights_, gates_, id, dc);

  const RopeParams rope = compute_rope_params(ckpt_->config());
  Tensor x = pass.layer_inputs.back().clone();
  DecoderLayerSaved saved;
  saved.attention_only = true;
  size_t before = host_tensor_memory().in_use;
  reset_host_tensor_peak();
  qwen3_decoder_layer(ckpt_->config(), weights_->layer(kLayers - 1), rope, pass.positions, dc, &gates_, kLayers - 1,
                      x, nullptr, &saved);
  const size_t added_recompute = host_tensor_memory().peak - before;
  x = Tensor(), saved = DecoderLayerSaved();

  before = host_tensor_memory().in_use;
  reset_host_tensor_peak();
  student_backward(*weights_, gates_, pass, d_hidden, d_log_beta);
  const size_t added = host_tensor_memory().peak - before;
  EXPECT_EQ(host_tensor_memory().in_use, before) << "the backward left tensors behind";

  const int64_t f = 4, A = T * kHidden * f, Q = T * kHeads * kHeadDim * f, Kv = T * kKv * kHeadDim * f;
  const int64_t gate = T * kGateHidden * f * (GetParam().kind == gates::GateKind::dbtrimkv ? 2 : 1) + T * kKv * f;
  const int64_t lb = T * kKv * f, lse = T * kHeads * f, chunk = T * (kHidden + 3 * kInter) * f;
  const int64_t recompute_alone = A + 3 * Q + 3 * Kv + gate + lb + lse + (64 << 10);
  EXPECT_LE(static_cast<int64_t>(added_recompute), recompute_alone);
  const int64_t recompute = 3 * A + 3 * Q + 3 * Kv + gate + lb + lse + chunk;
  const int64_t attention_backward = 2 * A + 5 * Q + 5 * Kv + gate + 2 * lb + lse;
  const int64_t bound = std::max(recompute, attention_backward) + (64 << 10);
  EXPECT_LE(static_cast<int64_t>(added), bound)
      << "recomputation " << recompute << ", attention backward " << attention_backward << " bytes";
  std::printf("recomputation adds %zu bytes of tensors (bound %lld), the backward %zu (bound %lld); one [T, D] is %lld\n",
              added_recompute, static_cast<long long>(recompute_alone), added, static_cast<long long>(bound),
              static_cast<long long>(A));
}

// The MLP's token chunks (mlp_chunk_tokens(), 8,192 in the tools: every T > 8,192 runs
// several) change nothing but the buffers' size: with a chunk of 64, T = 300 runs four full
// chunks and a partial one of 44, and the teacher's and the student's hidden states, logβ, the
// checkpoints and every gate gradient equal the one-chunk run's within float32 rounding (2e-6 of
// the largest entry forward, 1e-5 for the gradients; every step is row-wise, so only the GEMMs'
// rounding can differ). The chunk
// in use is also what qwen3_mlp allocates: its [c, D] + 2 [c, I] buffers at c = 64, not 300.
TEST_P(StudentBackward, MlpChunksMatchOneChunk) {
  struct ChunkGuard {
    explicit ChunkGuard(int64_t n) : previous(set_mlp_chunk_tokens(n)) {}
    ~ChunkGuard() { set_mlp_chunk_tokens(previous); }
    int64_t previous;
  };
  ASSERT_EQ(mlp_chunk_tokens(), kMlpChunkTokens) << "the tools' chunk is the default";
  const int64_t T = 300, chunk = 64;
  std::vector<int32_t> ids(T), doc(T);
  std::mt19937_64 rng(GetParam().seed + 5);
  std::uniform_int_distribution<int32_t> tok(0, kVocab - 1);
  for (int64_t t = 0; t < T; ++t) ids[t] = tok(rng), doc[t] = t < 120 ? 0 : t < 250 ? 1 : t < 290 ? 2 : -1;
  const Tensor id = Tensor::from_vector(ids, {T}), dc = Tensor::from_vector(doc, {T});
  const Tensor d_hidden = random({T, kHidden}, rng), d_log_beta = random({kLayers, T, kKv}, rng);

  struct Run {
    Tensor teacher, student, log_beta;
    std::vector<Tensor> inputs, grads;
    size_t mlp_peak = 0;
  };
  auto run = [&] {
    Run r;
    r.teacher = qwen3_hidden(*weights_, id, dc);
    gates_.zero_grad();
    const StudentPass pass = student_forward(*weights_, gates_, id, dc);
    r.student = pass.hidden, r.log_beta = pass.log_beta, r.inputs = pass.layer_inputs;
    student_backward(*weights_, gates_, pass, d_hidden, d_log_beta);
    for (const gates::GateParameter& p : gates_.parameters()) r.grads.push_back(p.grad.clone());
    Tensor x = pass.final_input.clone();
    const size_t before = host_tensor_memory().in_use;
    reset_host_tensor_peak();
    qwen3_mlp(ckpt_->config(), weights_->layer(0), x);
    r.mlp_peak = host_tensor_memory().peak - before;
    return r;
  };
  const Run one = run();
  Run chunked;
  {
    ChunkGuard guard(chunk);
    ASSERT_EQ(mlp_chunk_tokens(), chunk);
    chunked = run();
  }
  EXPECT_EQ(mlp_chunk_tokens(), kMlpChunkTokens);

  double worst = 0;
  auto expect_close = [&](const Tensor& a, const Tensor& b, const std::string& what, double tolerance) {
    ASSERT_EQ(a.shape(), b.shape()) << what;
    double diff = 0, scale = 0;
    for (int64_t i = 0; i < b.numel(); ++i) {
      diff = std::max(diff, std::fabs(double(a.data<float>()[i]) - b.data<float>()[i]));
      scale = std::max(scale, std::fabs(double(b.data<float>()[i])));
    }
    ASSERT_GT(scale, 0) << what << " is all zeros";
    worst = std::max(worst, diff / scale);
    EXPECT_LE(diff, tolerance * scale) << what << ": chunk " << chunk << " vs one chunk of " << T;
  };
  // The GEMMs' rounding differs with the rows they are given (measured: up to 6e-7 of the
  // largest entry forward, 1.8e-6 in the gradients, sums over 300 tokens); a dropped, repeated
  // or misplaced row would move them by O(1).
  constexpr double kForward = 2e-6, kGradient = 1e-5;
  expect_close(chunked.teacher, one.teacher, "teacher hidden state", kForward);
  expect_close(chunked.student, one.student, "student hidden state", kForward);
  expect_close(chunked.log_beta, one.log_beta, "logβ", kForward);
  for (size_t l = 0; l < one.inputs.size(); ++l)
    expect_close(chunked.inputs[l], one.inputs[l], "layer " + std::to_string(l) + " input", kForward);
  const auto& params = gates_.parameters();
  for (size_t k = 0; k < params.size(); ++k)
    expect_close(chunked.grads[k], one.grads[k], params[k].name() + " grad", kGradient);

  const int64_t per_token = (kHidden + 2 * kInter) * 4;  // h2 [c, D], gate and up [c, I]
  EXPECT_LE(static_cast<int64_t>(chunked.mlp_peak), chunk * per_token + (4 << 10));
  EXPECT_GE(static_cast<int64_t>(one.mlp_peak), T * per_token);
  std::printf("chunk %lld vs one chunk at T %lld: largest difference %.3g of the largest entry; qwen3_mlp holds %zu "
              "bytes chunked, %zu in one chunk\n",
              static_cast<long long>(chunk), static_cast<long long>(T), worst, chunked.mlp_peak, one.mlp_peak);
}

INSTANTIATE_TEST_SUITE_P(TinyModels, StudentBackward,
                         ::testing::Values(Case{"trimkv", gates::GateKind::trimkv, 0.0, 31},
                                           Case{"dbtrimkv_yarn", gates::GateKind::dbtrimkv, 4.0, 47}),
                         [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });
