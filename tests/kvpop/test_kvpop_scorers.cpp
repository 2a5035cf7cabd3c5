// KVPOP scorer parameters (model/kvpop/scorers.h): DESIGN §5 names, shapes and init; per-head
// views that alias the stacked tensors; the safetensors round trip and its one-line errors.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>

#include "model/kvpop/scorers.h"
#include "data/formats/safetensors.h"
#include "model/tiny.h"

namespace retain::kvpop {
namespace {

namespace fs = std::filesystem;

Qwen3Config small_config() {
  TinyModelOptions o;
  o.layers = 2;
  o.kv_heads = 2;
  o.head_dim = 8;
  return tiny_config(o);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

fs::path temp_file(const std::string& name) {
  return fs::temp_directory_path() / fmt::format("retain_scorers_{}_{}", ::getpid(), name);
}

TEST(KvpopScorers, InitHasDesignNamesShapesAndValues) {
  const Qwen3Config c = small_config();
  const Scorers sc = Scorers::init(Scorers::dims_for(c), {16, 4, 8}, 7);
  const auto named = sc.named_tensors();
  ASSERT_EQ(named.size(), 2u * 10u);
  std::map<std::string, Tensor> t(named.begin(), named.end());
  const std::string p = "model.layers.1.self_attn.kvpop.";
  EXPECT_EQ(t.at(p + "q_proj.weight").shape(), (Shape{2, 4, 16}));
  EXPECT_EQ(t.at(p + "v_proj.weight").shape(), (Shape{2, 4, 16}));
  EXPECT_EQ(t.at(p + "fgate.weight").shape(), (Shape{2, 16}));
  EXPECT_EQ(t.at(p + "fgate.bias").shape(), (Shape{2}));
  EXPECT_EQ(t.at(p + "out.weight").shape(), (Shape{2, 4}));
  EXPECT_EQ(t.at(p + "decay").shape(), (Shape{2}));
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(t.at(p + "fgate.bias").data<float>()[k], 3.0f);
    EXPECT_EQ(t.at(p + "igate.bias").data<float>()[k], 0.0f);
    EXPECT_EQ(t.at(p + "out.bias").data<float>()[k], 0.0f);
    EXPECT_EQ(t.at(p + "decay").data<float>()[k], 0.0f);
  }
  // The weights are N(0, 0.02): the sample std over all of them (6 tensors × 2 layers).
  double sq = 0;
  int64_t n = 0;
  for (const auto& [name, v] : named)
    if (name.ends_with("weight"))
      for (int64_t i = 0; i < v.numel(); ++i, ++n) sq += static_cast<double>(v.data<float>()[i]) * v.data<float>()[i];
  EXPECT_NEAR(std::sqrt(sq / static_cast<double>(n)), 0.02, 0.002) << n << " weights";
  // Seeded: the same seed gives the same draws, another seed others.
  const Scorers again = Scorers::init(Scorers::dims_for(c), {16, 4, 8}, 7), other = Scorers::init(Scorers::dims_for(c), {16, 4, 8}, 8);
  EXPECT_EQ(again.named_tensors()[0].second.data<float>()[5], named[0].second.data<float>()[5]);
  EXPECT_NE(other.named_tensors()[0].second.data<float>()[5], named[0].second.data<float>()[5]);
  EXPECT_EQ(sc.num_parameters(), 2 * (3 * 2 * 4 * 16 + 2 * 2 * 16 + 2 * 4 + 4 * 2));
}

TEST(KvpopScorers, HeadViewsAliasTheStackedTensors) {
  Scorers sc = Scorers::init(Scorers::dims_for(small_config()), {16, 4, 8}, 1);
  const auto values = sc.head_values();
  auto grads = sc.head_grads();
  // Layer 1, head 1's W_k[2, 3] is element ((1·4 + 2)·16 + 3) of layer 1's k_proj.weight.
  const Parameter& k1 = sc.parameters()[10 + 1];
  ASSERT_EQ(k1.name(), "model.layers.1.self_attn.kvpop.k_proj.weight");
  EXPECT_EQ(values[1][1].W_k.data<float>()[2 * 16 + 3], k1.value.data<float>()[(1 * 4 + 2) * 16 + 3]);
  grads[1][1].W_k.data<float>()[2 * 16 + 3] = 5.0f;
  grads[0][1].b_f.data<float>()[0] = 7.0f;
  EXPECT_EQ(k1.grad.data<float>()[(1 * 4 + 2) * 16 + 3], 5.0f);
  EXPECT_EQ(sc.parameters()[6].grad.data<float>()[1], 7.0f);  // layer 0 fgate.bias[1]
  EXPECT_EQ(values[0][1].b_f.data<float>()[0], 3.0f);
  sc.zero_grad();
  EXPECT_EQ(k1.grad.data<float>()[(1 * 4 + 2) * 16 + 3], 0.0f);
}

TEST(KvpopScorers, SaveLoadRoundTripWithMetadata) {
  const Qwen3Config c = small_config();
  const Scorers sc = Scorers::init(Scorers::dims_for(c), {16, 4, 8}, 3);
  const fs::path path = temp_file("rt.safetensors");
  sc.save(path.string(), {{"step", "12"}});
  const formats::SafetensorsFile f = formats::SafetensorsFile::open(path.string());
  EXPECT_EQ(f.metadata().at("gate_kind"), "kvpop");
  EXPECT_EQ(f.metadata().at("window"), "16");
  EXPECT_EQ(f.metadata().at("sinks"), "4");
  EXPECT_EQ(f.metadata().at("topk"), "8");
  EXPECT_EQ(f.metadata().at("step"), "12");
  const Scorers back = Scorers::load(path.string(), c);
  ASSERT_TRUE(back.geometry().has_value());
  EXPECT_EQ(*back.geometry(), (PolicyGeometry{16, 4, 8}));
  const auto a = sc.named_tensors(), b = back.named_tensors();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_EQ(std::memcmp(a[i].second.raw(), b[i].second.raw(), a[i].second.nbytes()), 0) << a[i].first;
  }
  fs::remove(path);
}

TEST(KvpopScorers, ChecksAgainstTheModelNamingTheTensor) {
  const Qwen3Config c = small_config();
  const Scorers sc = Scorers::init(Scorers::dims_for(c), {16, 4, 8}, 3);
  auto tensors = [&] {
    std::map<std::string, Tensor> m;
    for (auto& [n, t] : sc.named_tensors()) m.emplace(n, t.clone());
    return m;
  };
  const std::map<std::string, std::string> meta = {{"gate_kind", "kvpop"}};
  auto load = [&](const std::map<std::string, Tensor>& m, const std::map<std::string, std::string>& md,
                  const Qwen3Config& cfg) { return error_of([&] { Scorers::from_tensors("F", m, md, cfg); }); };
  EXPECT_EQ(load(tensors(), meta, c), "(no error)");

  auto m = tensors();
  m.erase("model.layers.1.self_attn.kvpop.decay");
  EXPECT_EQ(load(m, meta, c), "F: missing tensor 'model.layers.1.self_attn.kvpop.decay'");

  m = tensors();
  m["model.layers.0.self_attn.kvpop.out.weight"] = Tensor::zeros({2, 5}, DType::F32);
  EXPECT_EQ(load(m, meta, c),
            "F: tensor 'model.layers.0.self_attn.kvpop.out.weight' has shape [2, 5], expected [2, 4] "
            "(num_key_value_heads 2, head_dim 8)");

  m = tensors();
  m["model.layers.2.self_attn.kvpop.decay"] = Tensor::zeros({2}, DType::F32);
  EXPECT_NE(load(m, meta, c).find("F: unexpected tensor 'model.layers.2.self_attn.kvpop.decay'"), std::string::npos);

  m = tensors();
  m["model.layers.0.self_attn.kvpop.igate.bias"].data<float>()[1] = NAN;
  EXPECT_EQ(load(m, meta, c), "F: tensor 'model.layers.0.self_attn.kvpop.igate.bias' has a non-finite value (nan) at index 1");

  EXPECT_EQ(load(tensors(), {{"gate_kind", "trimkv"}}, c), "F: __metadata__ gate_kind is 'trimkv', not kvpop scorers");
  EXPECT_EQ(load(tensors(), {{"window", "4"}}, c), "F: __metadata__ has window/sinks/topk only in part (no sinks)");

  TinyModelOptions o;  // a model with more KV heads: every stacked shape is off
  o.layers = 2;
  o.kv_heads = 4;
  o.head_dim = 8;
  EXPECT_NE(load(tensors(), meta, tiny_config(o)).find("has shape [2, 4, 16], expected [4, 4, 16]"), std::string::npos);
  Qwen3Config odd = c;
  odd.head_dim = 7;
  EXPECT_EQ(error_of([&] { Scorers::dims_for(odd); }),
            "kvpop scorers need an even head_dim (r = head_dim / 2), the model has head_dim 7");
}

}  // namespace
}  // namespace retain::kvpop
