// KVPOP scorer parameters: init, views per head, and the safetensors file (docs/formats.md).
#include "model/kvpop/scorers.h"

#include <charconv>
#include <cmath>
#include <random>
#include <set>

#include <fmt/format.h>

#include "data/formats/safetensors.h"

namespace retain::kvpop {

namespace {

enum Slot { kQ, kK, kV, kWi, kBi, kWf, kBf, kWo, kBo, kTheta, kSlots };

Shape slot_shape(int slot, const ScorerDims& d) {
  const int64_t K = d.kv_heads, r = d.rank(), x = 2 * d.head_dim;
  switch (slot) {
    case kQ: case kK: case kV: return {K, r, x};
    case kWi: case kWf: return {K, x};
    case kWo: return {K, r};
    default: return {K};
  }
}

// A parsed non-negative integer from __metadata__, or an error naming the key.
int64_t meta_int(const std::string& source, const std::map<std::string, std::string>& meta, const std::string& key) {
  const std::string& s = meta.at(key);
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v < 0)
    fail("{}: __metadata__ {} = '{}' is not a non-negative integer", source, key, s);
  return v;
}

}  // namespace

std::map<std::string, std::string> decay_metadata(const Decay& d) {
  if (d == Decay{}) return {};
  return {{"decay_every", std::to_string(d.every)},
          {"decay_min", fmt::format("{}", d.gamma_min)},
          {"decay_max", fmt::format("{}", d.gamma_max)}};
}

Decay decay_from_metadata(const std::string& source, const std::map<std::string, std::string>& meta) {
  Decay d;
  if (meta.count("decay_every")) {
    d.every = meta_int(source, meta, "decay_every");
    if (d.every < 1) fail("{}: __metadata__ decay_every must be at least 1, got {}", source, d.every);
  }
  for (auto [key, out] : {std::pair{"decay_min", &d.gamma_min}, std::pair{"decay_max", &d.gamma_max}}) {
    const auto it = meta.find(key);
    if (it == meta.end()) continue;
    const std::string& v = it->second;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), *out);
    if (ec != std::errc() || end != v.data() + v.size())
      fail("{}: __metadata__ {} = '{}' is not a number", source, key, v);
  }
  if (const std::string problem = decay_problem(d); !problem.empty()) fail("{}: __metadata__ {}", source, problem);
  return d;
}

void Scorers::set_decay(const Decay& d) {
  if (const std::string problem = decay_problem(d); !problem.empty()) fail("kvpop scorers: {}", problem);
  decay_ = d;
}

std::string scorer_tensor_name(int64_t layer, std::string_view suffix) {
  return fmt::format("model.layers.{}.self_attn.kvpop.{}", layer, suffix);
}

const std::vector<std::string>& scorer_suffixes() {
  static const std::vector<std::string> kSuffixes = {"q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                     "igate.weight",  "igate.bias",    "fgate.weight",
                                                     "fgate.bias",    "out.weight",    "out.bias",
                                                     "decay"};
  return kSuffixes;
}

Scorers::Scorers(const ScorerDims& dims) : dims_(dims) {
  for (int64_t l = 0; l < dims.layers; ++l)
    for (int s = 0; s < kSlots; ++s) {
      const Shape shape = slot_shape(s, dims);
      params_.push_back({{scorer_tensor_name(l, scorer_suffixes()[static_cast<size_t>(s)])},
                         Tensor::zeros(shape, DType::F32), Tensor::zeros(shape, DType::F32)});
    }
}

ScorerDims Scorers::dims_for(const Qwen3Config& c) {
  if (c.head_dim < 2 || c.head_dim % 2 != 0)
    fail("kvpop scorers need an even head_dim (r = head_dim / 2), the model has head_dim {}", c.head_dim);
  return {c.num_hidden_layers, c.num_key_value_heads, c.head_dim};
}

Scorers Scorers::init(const ScorerDims& dims, const PolicyGeometry& geometry, uint64_t seed) {
  Scorers sc(dims);
  sc.geometry_ = geometry;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 0.02);
  for (size_t i = 0; i < sc.params_.size(); ++i) {
    const int slot = static_cast<int>(i % kSlots);
    float* x = sc.params_[i].value.data<float>();
    const int64_t n = sc.params_[i].value.numel();
    if (slot == kQ || slot == kK || slot == kV || slot == kWi || slot == kWf || slot == kWo)
      for (int64_t j = 0; j < n; ++j) x[j] = static_cast<float>(normal(rng));
    else if (slot == kBf)
      for (int64_t j = 0; j < n; ++j) x[j] = 3.0f;  // b_f = 3: forget gate σ(3) ≈ 0.95 at init
    // b_i, out.bias, θ stay 0
  }
  return sc;
}

std::vector<std::vector<HeadParams>> Scorers::heads(bool grad) const {
  std::vector<std::vector<HeadParams>> out(static_cast<size_t>(dims_.layers));
  const int64_t r = dims_.rank(), x = 2 * dims_.head_dim;
  for (int64_t l = 0; l < dims_.layers; ++l)
    for (int64_t k = 0; k < dims_.kv_heads; ++k) {
      auto t = [&](int slot, const Shape& shape) {
        const Parameter& p = params_[static_cast<size_t>(l * kSlots + slot)];
        return (grad ? p.grad : p.value).rows(k, k + 1).reshape(shape);
      };
      out[static_cast<size_t>(l)].push_back({t(kQ, {r, x}), t(kK, {r, x}), t(kV, {r, x}), t(kWi, {x}), t(kWf, {x}),
                                             t(kBi, {1}), t(kBf, {1}), t(kWo, {r}), t(kBo, {1}), t(kTheta, {1})});
    }
  return out;
}

std::vector<std::pair<std::string, Tensor>> Scorers::named_tensors() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const Parameter& p : params_) out.emplace_back(p.name(), p.value);
  return out;
}

void Scorers::save(const std::string& path, const std::map<std::string, std::string>& extra) const {
  std::map<std::string, std::string> meta = {
      {"format", "pt"},
      {"gate_kind", "kvpop"},
      {"num_hidden_layers", std::to_string(dims_.layers)},
      {"num_key_value_heads", std::to_string(dims_.kv_heads)},
      {"head_dim", std::to_string(dims_.head_dim)},
  };
  if (geometry_) {
    meta["window"] = std::to_string(geometry_->window);
    meta["sinks"] = std::to_string(geometry_->sinks);
    meta["topk"] = std::to_string(geometry_->topk);
  }
  for (const auto& [k, v] : decay_metadata(decay_)) meta[k] = v;
  for (const auto& [k, v] : extra) meta[k] = v;
  formats::write_safetensors(path, named_tensors(), meta);
}

Scorers Scorers::load(const std::string& path, const Qwen3Config& config) {
  const formats::SafetensorsFile f = formats::SafetensorsFile::open(path);
  std::map<std::string, Tensor> tensors;
  for (const std::string& n : f.names()) tensors.emplace(n, f.tensor(n));
  return from_tensors(path, tensors, f.metadata(), config);
}

Scorers Scorers::from_tensors(const std::string& source, const std::map<std::string, Tensor>& tensors,
                              const std::map<std::string, std::string>& meta, const Qwen3Config& config) {
  if (auto it = meta.find("gate_kind"); it != meta.end() && it->second != "kvpop")
    fail("{}: __metadata__ gate_kind is '{}', not kvpop scorers", source, it->second);
  if (tensors.empty()) fail("{}: holds no tensors (not a kvpop scorer file)", source);
  Scorers sc(dims_for(config));
  std::set<std::string> expected;
  for (Parameter& p : sc.params_) {
    const std::string& n = p.name();
    expected.insert(n);
    const auto it = tensors.find(n);
    if (it == tensors.end()) fail("{}: missing tensor '{}'", source, n);
    const Tensor& t = it->second;
    if (t.shape() != p.value.shape())
      fail("{}: tensor '{}' has shape {}, expected {} (num_key_value_heads {}, head_dim {})", source, n,
           shape_str(t.shape()), shape_str(p.value.shape()), config.num_key_value_heads, config.head_dim);
    if (t.dtype() != DType::F32 && t.dtype() != DType::BF16 && t.dtype() != DType::F16 && t.dtype() != DType::F64)
      fail("{}: tensor '{}' has dtype {}; scorer tensors must be F32, BF16, F16 or F64", source, n,
           dtype_name(t.dtype()));
    p.value = t.dtype() == DType::F32 ? t.clone() : t.to_dtype(DType::F32);
    const float* v = p.value.data<float>();
    for (int64_t i = 0; i < p.value.numel(); ++i)
      if (!std::isfinite(v[i])) fail("{}: tensor '{}' has a non-finite value ({}) at index {}", source, n, v[i], i);
  }
  for (const auto& kv : tensors)
    if (!expected.count(kv.first))
      fail("{}: unexpected tensor '{}' (the model has {} layers; kvpop scorer names are {})", source, kv.first,
           config.num_hidden_layers, scorer_tensor_name(0, "…"));
  if (meta.count("window") || meta.count("sinks") || meta.count("topk")) {
    for (const char* key : {"window", "sinks", "topk"})
      if (!meta.count(key)) fail("{}: __metadata__ has window/sinks/topk only in part (no {})", source, key);
    PolicyGeometry g{meta_int(source, meta, "window"), meta_int(source, meta, "sinks"), meta_int(source, meta, "topk")};
    if (g.window < 1) fail("{}: __metadata__ window must be at least 1, got {}", source, g.window);
    sc.geometry_ = g;
  }
  sc.decay_ = decay_from_metadata(source, meta);
  return sc;
}

}  // namespace retain::kvpop
