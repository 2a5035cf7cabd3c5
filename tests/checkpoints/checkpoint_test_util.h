// What the checkpoint tests share: small random gates, a scratch directory, and an optimizer
// state whose every value is a known function of its flat index, so that any slice a rank
// loads can be checked exactly.
#pragma once
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <string>

#include <gtest/gtest.h>

#include "checkpoints/checkpoint.h"
#include "model/gates/gates.h"

namespace retain::ckpt::test {

namespace fs = std::filesystem;

inline Qwen3Config model_config() {
  Qwen3Config c;
  c.num_hidden_layers = 3;
  c.hidden_size = 8;
  c.num_key_value_heads = 2;
  return c;
}

// Gates for model_config() with every value random (not just the init's), G = 5.
inline gates::RetentionGates random_gates(gates::GateKind kind, uint64_t seed) {
  gates::RetentionGates g = gates::RetentionGates::init({kind, 3, 8, 5, 2}, 2.5, seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0, 1);
  for (gates::GateParameter& p : g.parameters())
    for (int64_t i = 0; i < p.value.numel(); ++i) p.value.data<float>()[i] = static_cast<float>(n(rng));
  return g;
}

inline bool same_values(const gates::RetentionGates& a, const gates::RetentionGates& b) {
  if (a.parameters().size() != b.parameters().size()) return false;
  for (size_t i = 0; i < a.parameters().size(); ++i) {
    const Tensor &x = a.parameters()[i].value, &y = b.parameters()[i].value;
    if (x.shape() != y.shape() || std::memcmp(x.raw(), y.raw(), x.nbytes()) != 0) return false;
  }
  return true;
}

// Exactly representable values, distinct per index and per step; zero in the padding.
inline float m_at(int64_t i, int64_t step, int64_t flat_size) { return i < flat_size ? 0.5f * float(i) - float(step) : 0.0f; }
inline float v_at(int64_t i, int64_t step, int64_t flat_size) { return i < flat_size ? 0.25f * float(i) + float(step) : 0.0f; }

// The padded slice rank `rank` of `world` owns.
inline std::pair<int64_t, int64_t> slice_of(int64_t flat_size, int rank, int world) {
  const int64_t per = (flat_size + world - 1) / world;
  return {rank * per, (rank + 1) * per};
}

inline OptimizerShard shard_for(int64_t flat_size, int rank, int world, int64_t step) {
  OptimizerShard o;
  o.t = step + 1000;  // distinct from the step, so a mix-up shows
  o.flat_size = flat_size;
  std::tie(o.begin, o.end) = slice_of(flat_size, rank, world);
  for (int64_t i = o.begin; i < o.end; ++i) {
    o.m.push_back(m_at(i, step, flat_size));
    o.v.push_back(v_at(i, step, flat_size));
  }
  return o;
}

// Checks a loaded slice value by value against the saved function.
inline void expect_slice(const OptimizerShard& o, int64_t begin, int64_t end, int64_t flat_size, int64_t step) {
  EXPECT_EQ(o.t, step + 1000);
  EXPECT_EQ(o.flat_size, flat_size);
  EXPECT_EQ(o.begin, begin);
  EXPECT_EQ(o.end, end);
  ASSERT_EQ(o.m.size(), size_t(end - begin));
  ASSERT_EQ(o.v.size(), size_t(end - begin));
  for (int64_t i = begin; i < end; ++i) {
    EXPECT_EQ(o.m[size_t(i - begin)], m_at(i, step, flat_size)) << "m[" << i << "]";
    EXPECT_EQ(o.v[size_t(i - begin)], v_at(i, step, flat_size)) << "v[" << i << "]";
  }
}

}  // namespace retain::ckpt::test
