// Gate files: save → load round trip (names, values, metadata, the shared dbtrimkv tensor
// under every layer's name), 16-bit files, and one clear error line for every bad file.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <random>

#include "kernels/base/half.h"
#include "model/gates/gates.h"
#include "data/formats/safetensors.h"

using namespace retain;
using namespace retain::gates;
namespace fs = std::filesystem;

namespace {

Qwen3Config model_config(int64_t layers, int64_t hidden, int64_t kv_heads) {
  Qwen3Config c;
  c.num_hidden_layers = layers;
  c.hidden_size = hidden;
  c.num_key_value_heads = kv_heads;
  return c;
}

fs::path scratch() {
  const fs::path d = fs::path(::testing::TempDir()) / ("retain_gate_file." + std::to_string(::getpid()));
  fs::create_directories(d);
  return d;
}

RetentionGates randomized(GateKind kind, uint64_t seed) {
  RetentionGates g = RetentionGates::init({kind, 3, 8, 5, 2}, 2.5, seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0, 1);
  for (GateParameter& p : g.parameters())
    for (int64_t i = 0; i < p.value.numel(); ++i) p.value.data<float>()[i] = static_cast<float>(n(rng));
  return g;
}

// The file's tensors as (name, F32 tensor), to edit and write back.
using Tensors = std::vector<std::pair<std::string, Tensor>>;
Tensors read_all(const std::string& path) {
  const formats::SafetensorsFile f = formats::SafetensorsFile::open(path);
  Tensors out;
  for (const std::string& n : f.names()) out.emplace_back(n, f.tensor(n).clone());
  return out;
}

std::string load_error(const std::string& path, const Qwen3Config& c, std::optional<GateKind> kind = std::nullopt) {
  try {
    RetentionGates::load(path, c, kind);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

class GateFile : public ::testing::TestWithParam<GateKind> {
 protected:
  void SetUp() override {
    dir_ = scratch();
    good_ = (dir_ / "good.safetensors").string();
    randomized(GetParam(), 7).save(good_, {{"memory", "128"}});
  }
  void TearDown() override { fs::remove_all(dir_); }
  // Writes `tensors` to a new file and returns its load error.
  std::string error_of(const Tensors& tensors, const std::map<std::string, std::string>& meta = {},
                       std::optional<GateKind> kind = std::nullopt) {
    const std::string p = (dir_ / "bad.safetensors").string();
    formats::write_safetensors(p, tensors, meta);
    return load_error(p, cfg_, kind);
  }
  fs::path dir_;
  std::string good_;
  Qwen3Config cfg_ = model_config(3, 8, 2);
};

bool contains(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

}  // namespace

TEST_P(GateFile, RoundTrip) {
  const RetentionGates orig = randomized(GetParam(), 7);
  const RetentionGates back = RetentionGates::load(good_, cfg_, GetParam());
  EXPECT_EQ(back.kind(), GetParam());
  EXPECT_EQ(back.dims().gate_hidden, 5);
  EXPECT_EQ(back.bias_init(), 2.5);
  ASSERT_EQ(back.parameters().size(), orig.parameters().size());
  for (size_t i = 0; i < orig.parameters().size(); ++i) {
    const GateParameter &a = orig.parameters()[i], &b = back.parameters()[i];
    EXPECT_EQ(a.file_names, b.file_names);
    ASSERT_EQ(a.value.shape(), b.value.shape());
    EXPECT_EQ(std::memcmp(a.value.raw(), b.value.raw(), a.value.nbytes()), 0) << a.name();
  }
  // The file itself: DESIGN names, F32, the shared tensor under every layer's name, metadata.
  const formats::SafetensorsFile f = formats::SafetensorsFile::open(good_);
  const bool db = GetParam() == GateKind::dbtrimkv;
  EXPECT_EQ(f.names().size(), db ? 3u * 6 : 3u * 4);
  for (int64_t l = 0; l < 3; ++l) {
    EXPECT_EQ(f.entry(gate_tensor_name(l, "linear1.weight")).shape, (Shape{5, 8}));
    EXPECT_EQ(f.entry(gate_tensor_name(l, "linear1.bias")).shape, (Shape{5}));
    EXPECT_EQ(f.entry(gate_tensor_name(l, "linear2.weight")).shape, (db ? Shape{5, 5} : Shape{2, 5}));
    EXPECT_EQ(f.entry(gate_tensor_name(l, "bias")).shape, (Shape{2}));
    EXPECT_EQ(f.entry(gate_tensor_name(l, "bias")).dtype, DType::F32);
    if (db) {
      EXPECT_EQ(f.entry(gate_tensor_name(l, "linear2.bias")).shape, (Shape{5}));
      const Tensor w3 = f.tensor(gate_tensor_name(l, "linear3.weight")), w30 = f.tensor(gate_tensor_name(0, "linear3.weight"));
      EXPECT_EQ(w3.shape(), (Shape{2, 5}));
      EXPECT_EQ(std::memcmp(w3.raw(), w30.raw(), w3.nbytes()), 0);
    }
  }
  const auto& m = f.metadata();
  EXPECT_EQ(m.at("gate_kind"), gate_kind_name(GetParam()));
  EXPECT_EQ(m.at("gate_hidden"), "5");
  EXPECT_EQ(m.at("num_hidden_layers"), "3");
  EXPECT_EQ(m.at("num_key_value_heads"), "2");
  EXPECT_EQ(m.at("hidden_size"), "8");
  EXPECT_EQ(m.at("bias_init"), "2.5");
  EXPECT_EQ(m.at("memory"), "128");
  // Without --gate-kind the kind is read from the tensor names.
  EXPECT_EQ(RetentionGates::load(good_, cfg_).kind(), GetParam());
}

TEST_P(GateFile, SixteenBitFilesAreConverted) {
  for (DType dt : {DType::BF16, DType::F16}) {
    Tensors t = read_all(good_);
    for (auto& [n, v] : t) v = v.to_dtype(dt);
    const std::string p = (dir_ / "half.safetensors").string();
    formats::write_safetensors(p, t);  // no metadata: the kind comes from the names
    const RetentionGates g = RetentionGates::load(p, cfg_);
    const formats::SafetensorsFile f = formats::SafetensorsFile::open(p);
    for (const GateParameter& q : g.parameters()) {
      ASSERT_EQ(f.entry(q.name()).dtype, dt);
      const Tensor stored = f.tensor(q.name());
      const uint16_t* bits = static_cast<const uint16_t*>(stored.raw());
      for (int64_t i = 0; i < stored.numel(); ++i)
        EXPECT_EQ(q.value.data<float>()[i], dt == DType::BF16 ? bf16_to_f32(bits[i]) : f16_to_f32(bits[i])) << q.name();
    }
    EXPECT_FALSE(g.bias_init().has_value());
  }
}

TEST_P(GateFile, BadFilesGiveOneClearLine) {
  const bool db = GetParam() == GateKind::dbtrimkv;
  const Tensors good = read_all(good_);
  auto without = [&](const std::string& name) {
    Tensors t;
    for (const auto& e : good)
      if (e.first != name) t.push_back(e);
    return t;
  };
  auto replaced = [&](const std::string& name, Tensor v) {
    Tensors t = good;
    for (auto& e : t)
      if (e.first == name) e.second = v;
    return t;
  };
  const std::string w2 = gate_tensor_name(1, "linear2.weight");
  std::string e = error_of(without(w2));
  EXPECT_TRUE(contains(e, "bad.safetensors: missing tensor '" + w2 + "'")) << e;

  Tensors extra = good;
  extra.emplace_back(gate_tensor_name(1, "linear9.weight"), Tensor::zeros({2}, DType::F32));
  e = error_of(extra);
  EXPECT_TRUE(contains(e, "unexpected tensor 'model.layers.1.self_attn.retention_gate.linear9.weight'")) << e;
  extra = good;
  extra.emplace_back("lm_head.weight", Tensor::zeros({2}, DType::F32));
  e = error_of(extra);
  EXPECT_TRUE(contains(e, "unexpected tensor 'lm_head.weight'")) << e;

  e = error_of(replaced(gate_tensor_name(2, "linear1.bias"), Tensor::zeros({6}, DType::F32)));
  EXPECT_TRUE(contains(e, "tensor 'model.layers.2.self_attn.retention_gate.linear1.bias' has shape [6], expected [5]"))
      << e;
  e = error_of(replaced(gate_tensor_name(0, "linear1.weight"), Tensor::zeros({5, 9}, DType::F32)));
  EXPECT_TRUE(contains(e, "has shape [5, 9], expected [G, 8]")) << e;

  e = error_of(replaced(gate_tensor_name(1, "linear1.bias"), Tensor::zeros({5}, DType::I32)));
  EXPECT_TRUE(contains(e, "has dtype I32; gate tensors must be F32, BF16, F16 or F64")) << e;

  Tensor nan = Tensor::zeros({5}, DType::F32);
  nan.data<float>()[3] = std::nanf("");
  e = error_of(replaced(gate_tensor_name(1, "linear1.bias"), nan));
  EXPECT_TRUE(contains(e, "non-finite value (nan) at index 3")) << e;

  // The model has a different layer count or KV-head count.
  e = load_error(good_, model_config(4, 8, 2));
  EXPECT_TRUE(contains(e, "has gates for 3 layers (layer indices 0..2), the model has 4")) << e;
  e = load_error(good_, model_config(2, 8, 2));
  EXPECT_TRUE(contains(e, "has gates for 3 layers (layer indices 0..2), the model has 2")) << e;
  e = load_error(good_, model_config(3, 8, 4));
  EXPECT_TRUE(contains(e, "has shape [2, 5], expected [4, 5]")) << e;
  EXPECT_TRUE(contains(e, "num_key_value_heads 4")) << e;
  e = load_error(good_, model_config(3, 16, 2));
  EXPECT_TRUE(contains(e, "expected [G, 16]")) << e;

  // The kind: asked for the other one; metadata contradicting the names.
  const GateKind other = db ? GateKind::trimkv : GateKind::dbtrimkv;
  e = load_error(good_, cfg_, other);
  EXPECT_TRUE(contains(e, fmt::format("holds {} gates", gate_kind_name(GetParam())))) << e;
  EXPECT_TRUE(contains(e, fmt::format("but {} gates were asked for", gate_kind_name(other)))) << e;
  e = error_of(good, {{"gate_kind", std::string(gate_kind_name(other))}});
  EXPECT_TRUE(contains(e, "__metadata__ says gate_kind")) << e;
  e = error_of(good, {{"gate_kind", "mlstm"}});
  EXPECT_TRUE(contains(e, "unknown gate kind 'mlstm'")) << e;

  e = error_of({});
  EXPECT_TRUE(contains(e, "holds no tensors")) << e;

  if (db) {
    // A shared tensor whose copies differ (even by one bit), or is missing under one layer's name.
    const std::string w3 = gate_tensor_name(2, "linear3.weight");
    Tensor changed;
    for (const auto& [n, v] : good)
      if (n == w3) changed = v.clone();
    changed.data<float>()[1] = std::nextafter(changed.data<float>()[1], 100.0f);
    e = error_of(replaced(w3, changed));
    EXPECT_TRUE(contains(e, "shared tensor '" + w3 + "' differs from 'model.layers.0.self_attn.retention_gate.linear3.weight'"))
        << e;
    e = error_of(without(gate_tensor_name(1, "bias")));
    EXPECT_TRUE(contains(e, "missing tensor 'model.layers.1.self_attn.retention_gate.bias'")) << e;
  } else {
    // trimkv with a stray linear3 is dbtrimkv-looking: the names decide, and the rest must then fit.
    Tensors t = good;
    t.emplace_back(gate_tensor_name(0, "linear3.weight"), Tensor::zeros({2, 5}, DType::F32));
    e = error_of(t, {}, GateKind::trimkv);
    EXPECT_TRUE(contains(e, "holds dbtrimkv gates (with linear3.weight), but trimkv gates were asked for")) << e;
  }
  // Every message is one line naming the file.
  EXPECT_EQ(e.find('\n'), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Kinds, GateFile, ::testing::Values(GateKind::trimkv, GateKind::dbtrimkv),
                         [](const auto& info) { return std::string(gate_kind_name(info.param)); });

TEST(GateFileErrors, NotASafetensorsFile) {
  const fs::path d = scratch();
  const std::string e = load_error((d / "nope.safetensors").string(), model_config(1, 4, 1));
  EXPECT_TRUE(contains(e, "nope.safetensors")) << e;
  fs::remove_all(d);
}

// The linear gate (G = 0, TRIM-KV Fig. 10): linear.weight [K, D] and bias [K] per layer, read back
// bit for bit as a trimkv gate with gate_hidden 0; files mixing it with the MLP gates' tensors,
// a wrong shape or metadata that contradicts the tensors are one line naming the file.
TEST(GateFileLinear, RoundTripAndOneLineErrors) {
  const fs::path d = scratch();
  const Qwen3Config cfg = model_config(3, 8, 2);
  RetentionGates g = RetentionGates::init({GateKind::trimkv, 3, 8, 0, 2}, 2.5, 9);
  const std::string good = (d / "linear.safetensors").string();
  g.save(good);
  const RetentionGates back = RetentionGates::load(good, cfg, GateKind::trimkv);
  EXPECT_TRUE(back.is_linear());
  EXPECT_EQ(back.dims().gate_hidden, 0);
  ASSERT_EQ(back.parameters().size(), g.parameters().size());
  for (size_t i = 0; i < g.parameters().size(); ++i)
    EXPECT_EQ(std::memcmp(g.parameters()[i].value.raw(), back.parameters()[i].value.raw(),
                          g.parameters()[i].value.nbytes()),
              0)
        << g.parameters()[i].name();
  const formats::SafetensorsFile f = formats::SafetensorsFile::open(good);
  EXPECT_EQ(f.names().size(), 3u * 2);
  EXPECT_EQ(f.entry(gate_tensor_name(2, "linear.weight")).shape, (Shape{2, 8}));
  EXPECT_EQ(f.metadata().at("gate_hidden"), "0");
  EXPECT_EQ(f.metadata().at("gate_kind"), "trimkv");

  auto error_of = [&](Tensors t, const std::map<std::string, std::string>& meta, std::optional<GateKind> kind) {
    const std::string p = (d / "bad.safetensors").string();
    formats::write_safetensors(p, t, meta);
    return load_error(p, cfg, kind);
  };
  const Tensors tensors = read_all(good);
  std::vector<std::pair<std::string, std::string>> cases;  // (error, expected part)
  cases.emplace_back(error_of(tensors, {{"gate_hidden", "5"}}, std::nullopt),
                     "__metadata__ says gate_hidden 5 but the tensors are a linear gate");
  cases.emplace_back(error_of(tensors, {}, GateKind::dbtrimkv), "holds trimkv gates");
  Tensors extra = tensors;
  extra.emplace_back(gate_tensor_name(0, "linear1.bias"), Tensor::zeros({2}, DType::F32));
  cases.emplace_back(error_of(extra, {}, std::nullopt), "unexpected tensor 'model.layers.0.self_attn.retention_gate.linear1.bias'");
  Tensors mixed = tensors;
  mixed.emplace_back(gate_tensor_name(0, "linear3.weight"), Tensor::zeros({2, 5}, DType::F32));
  cases.emplace_back(error_of(mixed, {}, std::nullopt), "holds both linear.weight");
  Tensors shape = tensors;
  for (auto& [n, t] : shape)
    if (n == gate_tensor_name(1, "linear.weight")) t = Tensor::zeros({3, 8}, DType::F32);
  cases.emplace_back(error_of(shape, {}, std::nullopt), "has shape [3, 8], expected [2, 8]");
  Tensors missing;
  for (auto& [n, t] : tensors)
    if (n != gate_tensor_name(2, "linear.weight")) missing.emplace_back(n, t);
  cases.emplace_back(error_of(missing, {}, std::nullopt), "missing tensor 'model.layers.2.self_attn.retention_gate.linear.weight'");
  for (const auto& [e, want] : cases) {
    EXPECT_TRUE(contains(e, want)) << e << "\n  expected: " << want;
    EXPECT_TRUE(contains(e, "bad.safetensors")) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  // An MLP file whose metadata claims the linear gate.
  const std::string mlp = (d / "mlp.safetensors").string();
  RetentionGates::init({GateKind::trimkv, 3, 8, 5, 2}, 1, 1).save(mlp, {{"gate_hidden", "0"}});
  EXPECT_TRUE(contains(load_error(mlp, cfg), "__metadata__ says gate_hidden 0 but the tensors are MLP gates"))
      << load_error(mlp, cfg);
  fs::remove_all(d);
}

// Gates reading [k ‖ v] (--gate-input kv): linear1.weight [G, 2·K·head_dim], __metadata__
// gate_input "kv" written and required to read them; a width that fits neither input, or an unknown
// gate_input, is one line naming the file.
TEST(GateFileKv, RoundTripAndOneLineErrors) {
  const fs::path d = scratch();
  Qwen3Config cfg = model_config(3, 8, 2);
  cfg.head_dim = 6;  // 2·K·d = 24
  const RetentionGates g = RetentionGates::init({GateKind::dbtrimkv, 3, 24, 5, 2, GateInput::kv}, 2.5, 9);
  const std::string good = (d / "kv.safetensors").string();
  g.save(good);
  const formats::SafetensorsFile f = formats::SafetensorsFile::open(good);
  EXPECT_EQ(f.metadata().at("gate_input"), "kv");
  EXPECT_EQ(f.entry(gate_tensor_name(0, "linear1.weight")).shape, (Shape{5, 24}));
  const RetentionGates back = RetentionGates::load(good, cfg);
  EXPECT_TRUE(back.reads_kv());
  EXPECT_EQ(back.dims().hidden, 24);
  for (size_t i = 0; i < g.parameters().size(); ++i)
    EXPECT_EQ(std::memcmp(g.parameters()[i].value.raw(), back.parameters()[i].value.raw(),
                          g.parameters()[i].value.nbytes()),
              0);
  // A gates file for h has no gate_input key (files before the option read as before).
  const std::string hidden = (d / "hidden.safetensors").string();
  RetentionGates::init({GateKind::trimkv, 3, 8, 5, 2}, 1, 1).save(hidden);
  EXPECT_EQ(formats::SafetensorsFile::open(hidden).metadata().count("gate_input"), 0u);
  EXPECT_FALSE(RetentionGates::load(hidden, cfg).reads_kv());

  const Tensors tensors = read_all(good);
  const std::string bad = (d / "bad.safetensors").string();
  formats::write_safetensors(bad, tensors, {});  // no gate_input: read as h, 8 wide
  std::string e = load_error(bad, cfg);
  EXPECT_TRUE(contains(e, "has shape [5, 24], expected [G, 8] (G the gate width, 8 the model's hidden_size)")) << e;
  formats::write_safetensors(bad, tensors, {{"gate_input", "keys"}});
  e = load_error(bad, cfg);
  EXPECT_TRUE(contains(e, "__metadata__ gate_input: unknown gate input 'keys' (expected hidden or kv)")) << e;
  cfg.head_dim = 4;  // 2·K·d = 16
  e = load_error(good, cfg);
  EXPECT_TRUE(contains(e, "expected [G, 16] (G the gate width, 16 = 2·num_key_value_heads·head_dim, gate_input kv)"))
      << e;
  for (const std::string& m : {load_error(bad, cfg), e}) {
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    EXPECT_EQ(m.rfind(d.string(), 0), 0u) << m;
  }
  fs::remove_all(d);
}
