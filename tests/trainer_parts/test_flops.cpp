// The step's FLOP count (trainer/flops.h) against a count built another way: every matmul of
// the layer from the checkpoint's weight shapes (model/weights.h's layer_tensors) and the
// gates' own parameter shapes, and every attention pair enumerated one by one from the
// document ids; and the MFU peak table (exact names only).
#include <gtest/gtest.h>

#include <vector>

#include "model/gates/gates.h"
#include "model/weights.h"
#include "trainer/flops.h"

using namespace retain;
using namespace retain::trainer;

namespace {

Qwen3Config small_config() {
  Qwen3Config c;
  c.vocab_size = 97;
  c.hidden_size = 24;
  c.intermediate_size = 40;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  return c;
}

// 2·out·in per token for every 2-d weight of layer 0 (projections and MLP), from the names
// and shapes a checkpoint must have.
double layer_matmul_flops_per_token(const Qwen3Config& c) {
  double f = 0;
  for (const auto& [name, shape] : layer_tensors(c, 0))
    if (shape.size() == 2) f += 2.0 * static_cast<double>(shape[0] * shape[1]);
  return f;
}

// 2·out·in per token for every weight matrix the gate of layer 0 applies (a shared dbtrimkv
// matrix is applied by every layer, so it counts per layer).
double gate_flops_per_token(const gates::GateDims& dims) {
  const gates::RetentionGates g = gates::RetentionGates::init(dims, 18.0, 1);
  double f = 0;
  for (const auto& [name, t] : g.named_tensors())
    if (name.rfind("model.layers.0.", 0) == 0 && t.ndim() == 2) f += 2.0 * static_cast<double>(t.numel());
  return f;
}

// Allowed (t, i) pairs counted one by one: i ≤ t in one document (doc ≥ 0).
double pairs_by_enumeration(const std::vector<int>& doc) {
  double n = 0;
  for (size_t t = 0; t < doc.size(); ++t)
    for (size_t i = 0; i <= t; ++i) n += doc[t] >= 0 && doc[i] == doc[t];
  return n;
}

MicroBatchShape shape_of(const std::vector<int>& doc, int64_t loss_positions) {
  MicroBatchShape s;
  for (size_t t = 0; t < doc.size(); ++t) {
    if (doc[t] < 0) continue;
    if (t == 0 || doc[t - 1] != doc[t]) s.doc_lengths.push_back(0);
    ++s.doc_lengths.back();
  }
  s.loss_positions = loss_positions;
  return s;
}

// G = 0: the linear gate; kv: gates reading [k ‖ v] (input width 2·K·head_dim).
void expect_count(gates::GateKind kind, int64_t G = 6, bool kv = false) {
  const Qwen3Config c = small_config();
  const gates::GateInput input = kv ? gates::GateInput::kv : gates::GateInput::hidden;
  const gates::GateDims dims{kind, c.num_hidden_layers, gates::gate_input_width(c, input), G, c.num_key_value_heads,
                             input};
  const std::vector<int> doc_a{0, 0, 0, 1, 1, 2, 2, 2, 2, -1, -1};
  const std::vector<int> doc_b{5, 5, 5, 5, 5, 5, 7};
  const std::vector<std::vector<int>> docs{doc_a, doc_b};
  const std::vector<int64_t> loss{5, 4};

  const double L = static_cast<double>(c.num_hidden_layers);
  const double dense = layer_matmul_flops_per_token(c), gate = gate_flops_per_token(dims);
  const double per_pair = 2.0 * 2.0 * static_cast<double>(c.head_dim * c.num_attention_heads);  // q·k, p·v
  for (size_t n = 1; n <= 2; ++n) {
    std::vector<MicroBatchShape> shapes;
    double teacher = 0, student = 0, backward = 0, lm = 0;
    for (size_t m = 0; m < n; ++m) {
      double tokens = 0;
      for (int d : docs[m]) tokens += d >= 0;
      const double attention = pairs_by_enumeration(docs[m]) * per_pair;
      teacher += L * (tokens * dense + attention);
      student += L * (tokens * (dense + gate) + attention);
      backward += L * (tokens * dense + 2.5 * attention + 2 * tokens * gate);
      lm += 3 * 2.0 * static_cast<double>(c.hidden_size * c.vocab_size * loss[m]);
      shapes.push_back(shape_of(docs[m], loss[m]));
    }
    const StepFlops f = step_flops(c, dims, shapes);
    EXPECT_DOUBLE_EQ(f.teacher, teacher);
    EXPECT_DOUBLE_EQ(f.student, student);
    EXPECT_DOUBLE_EQ(f.recompute, student);
    EXPECT_DOUBLE_EQ(f.backward, backward);
    EXPECT_DOUBLE_EQ(f.loss, lm);
    EXPECT_DOUBLE_EQ(f.count_pass, n > 1 ? student : 0.0);  // accumulation's counting forward
    EXPECT_DOUBLE_EQ(f.total(), teacher + 2 * student + backward + lm + (n > 1 ? student : 0.0));
  }
}

}  // namespace

TEST(StepFlops, TrimkvMatchesACountFromShapesAndPairs) { expect_count(gates::GateKind::trimkv); }
TEST(StepFlops, DbtrimkvMatchesACountFromShapesAndPairs) { expect_count(gates::GateKind::dbtrimkv); }
TEST(StepFlops, AblationGatesMatchACountFromShapesAndPairs) {
  expect_count(gates::GateKind::trimkv, 0);                // the linear gate
  expect_count(gates::GateKind::dbtrimkv, 6, /*kv=*/true);  // [k ‖ v]
}

// Qwen3-4B (36 layers, D 2560, 32/8 heads, d 128, I 9728): a forward costs 2 FLOPs per
// non-embedding matmul weight per token, ≈ 2 × 3.6e9 (Qwen's model card: 3.6B non-embedding
// parameters, of which the norms are a negligible 0.2M).
TEST(StepFlops, Qwen3_4BForwardIsTwiceItsNonEmbeddingParameters) {
  Qwen3Config c;
  c.vocab_size = 151936, c.hidden_size = 2560, c.intermediate_size = 9728, c.num_hidden_layers = 36;
  c.num_attention_heads = 32, c.num_key_value_heads = 8, c.head_dim = 128;
  const gates::GateDims dims{gates::GateKind::trimkv, 36, 2560, 512, 8};
  MicroBatchShape one_token;
  one_token.doc_lengths = {1};
  const StepFlops f = step_flops(c, dims, {one_token});
  const double attention = 36 * 4.0 * 128 * 32;  // the single pair
  EXPECT_NEAR((f.teacher - attention) / 2, 3.6e9, 0.05e9);
}

TEST(PeakTable, KnownGpusByTheirExactDriverNames) {
  EXPECT_EQ(bf16_peak_tflops("NVIDIA H100 80GB HBM3"), 989.4);
  EXPECT_EQ(bf16_peak_tflops("NVIDIA H200"), 989.4);
  EXPECT_EQ(bf16_peak_tflops("NVIDIA H100 PCIe"), 756.0);
  EXPECT_EQ(bf16_peak_tflops("NVIDIA A100-SXM4-80GB"), 312.0);
}

TEST(PeakTable, NearMissesAndUnknownGpusHaveNoPeak) {
  for (const char* name : {"NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA H800", "nvidia h100 80gb hbm3", "NVIDIA H100",
                           "NVIDIA GeForce RTX 4090", "", "cpu"})
    EXPECT_FALSE(bf16_peak_tflops(name).has_value()) << name;
}
