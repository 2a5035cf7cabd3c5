// The flat view of the gate parameters (trainer/flat_params.h): its size against the closed
// form of DESIGN §4's shapes (dbtrimkv's shared tensors counted once), its order, and the
// flatten/unflatten round trips (values and gradients) for both gate kinds.
#include <gtest/gtest.h>

#include <vector>

#include "model/gates/gates.h"
#include "trainer/flat_params.h"

using namespace retain;
using namespace retain::gates;
using namespace retain::trainer;

namespace {

// Scalars by DESIGN §4: trimkv W1 [G,D] b1 [G] W2 [K,G] b [K] per layer; dbtrimkv W1, b1,
// W2 [G,G], b2 [G] per layer plus one W3 [K,G] and one b [K] for all layers.
int64_t expected_size(const GateDims& d) {
  const int64_t L = d.layers, D = d.hidden, G = d.gate_hidden, K = d.kv_heads;
  if (d.kind == GateKind::trimkv) return L * (G * D + G + K * G + K);
  return L * (G * D + G + G * G + G) + K * G + K;
}

void round_trip(GateKind kind) {
  const GateDims dims{kind, 3, 8, 5, 2};
  RetentionGates g = RetentionGates::init(dims, 18.0, 42);
  const int64_t n = flat_size(g);
  EXPECT_EQ(n, expected_size(dims));
  EXPECT_EQ(n, g.num_parameters());

  // Values: layer 0's linear1.weight first, row-major; the last K scalars are the bias b
  // (trimkv: the last layer's; dbtrimkv: the shared one, once).
  std::vector<float> flat(static_cast<size_t>(n), -1.0f);
  flatten_values(g, flat.data());
  const GateParameter& first = g.parameters().front();
  EXPECT_EQ(first.name(), gate_tensor_name(0, "linear1.weight"));
  for (int64_t i = 0; i < first.value.numel(); ++i) ASSERT_EQ(flat[static_cast<size_t>(i)], first.value.data<float>()[i]);
  for (int64_t k = 0; k < dims.kv_heads; ++k) EXPECT_EQ(flat[static_cast<size_t>(n - dims.kv_heads + k)], 18.0f);
  if (kind == GateKind::dbtrimkv) {
    int shared = 0;
    for (const GateParameter& p : g.parameters()) shared += p.shared() ? 1 : 0;
    EXPECT_EQ(shared, 2);  // linear3.weight and bias, each listed once
    EXPECT_TRUE(g.parameters().back().shared());
  }

  // New values in, the same values out, landing in the right tensors.
  for (int64_t i = 0; i < n; ++i) flat[static_cast<size_t>(i)] = 0.001f * static_cast<float>(i) - 1.0f;
  unflatten_values(g, flat.data());
  int64_t offset = 0;
  for (const GateParameter& p : g.parameters()) {
    for (int64_t i = 0; i < p.value.numel(); ++i)
      ASSERT_EQ(p.value.data<float>()[i], flat[static_cast<size_t>(offset + i)]) << p.name() << " " << i;
    offset += p.value.numel();
  }
  std::vector<float> back(static_cast<size_t>(n));
  flatten_values(g, back.data());
  EXPECT_EQ(back, flat);

  // Gradients flatten in the same order.
  int64_t j = 0;
  for (GateParameter& p : g.parameters())
    for (int64_t i = 0; i < p.grad.numel(); ++i) p.grad.data<float>()[i] = static_cast<float>(j++) * 0.5f;
  flatten_grads(g, back.data());
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(back[static_cast<size_t>(i)], static_cast<float>(i) * 0.5f);
  // unflatten_grads is its inverse, and leaves the values alone.
  std::vector<float> values(static_cast<size_t>(n)), grads(static_cast<size_t>(n)), after(static_cast<size_t>(n));
  flatten_values(g, values.data());
  for (int64_t i = 0; i < n; ++i) grads[static_cast<size_t>(i)] = static_cast<float>(i) - 7.25f;
  unflatten_grads(g, grads.data());
  flatten_grads(g, back.data());
  EXPECT_EQ(back, grads);
  flatten_values(g, after.data());
  EXPECT_EQ(after, values);
}

}  // namespace

TEST(FlatParams, RoundTripTrimkv) { round_trip(GateKind::trimkv); }
TEST(FlatParams, RoundTripDbtrimkvSharedOnce) { round_trip(GateKind::dbtrimkv); }
