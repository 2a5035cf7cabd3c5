// Gate files: safetensors with the DESIGN §4 names (docs/formats.md, "Retention gate files").
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <set>

#include <fmt/format.h>

#include "model/gates/gates.h"
#include "model/layer_names.h"
#include "data/formats/safetensors.h"

namespace retain::gates {

namespace {

constexpr std::string_view kPrefix = "model.layers.";
constexpr std::string_view kGate = ".self_attn.retention_gate.";

// "model.layers.{l}.self_attn.retention_gate.{suffix}" -> (l, suffix); nullopt for other names.
std::optional<std::pair<int64_t, std::string>> split_gate_name(const std::string& name) {
  const auto parts = split_layer_name(name, kPrefix, kGate);
  if (!parts) return std::nullopt;
  const std::string_view digits = parts->first;
  int64_t l = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), l);
  if (ec != std::errc() || end != digits.data() + digits.size() || (digits[0] == '0' && digits.size() > 1))
    return std::nullopt;
  return std::make_pair(l, std::string(parts->second));
}

Tensor as_f32(const std::string& source, const std::string& name, const Tensor& t) {
  if (t.dtype() != DType::F32 && t.dtype() != DType::BF16 && t.dtype() != DType::F16 && t.dtype() != DType::F64)
    fail("{}: tensor '{}' has dtype {}; gate tensors must be F32, BF16, F16 or F64", source, printable(name), dtype_name(t.dtype()));
  Tensor out = t.dtype() == DType::F32 ? t.clone() : t.to_dtype(DType::F32);
  const float* v = out.data<float>();
  for (int64_t i = 0; i < out.numel(); ++i)
    if (!std::isfinite(v[i])) fail("{}: tensor '{}' has a non-finite value ({}) at index {}", source, name, v[i], i);
  return out;
}

}  // namespace

RetentionGates RetentionGates::load(const std::string& path, const Qwen3Config& config, std::optional<GateKind> expect) {
  const formats::SafetensorsFile f = formats::SafetensorsFile::open(path);
  std::map<std::string, Tensor> tensors;
  for (const std::string& n : f.names()) tensors.emplace(n, f.tensor(n));
  return from_tensors(path, tensors, f.metadata(), config, expect);
}

RetentionGates RetentionGates::from_tensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                                            const std::map<std::string, std::string>& meta, const Qwen3Config& config,
                                            std::optional<GateKind> expect) {
  std::vector<std::string> names;
  for (const auto& kv : tensors) names.push_back(kv.first);

  // Kind: linear3 exists only in dbtrimkv gates; "linear.weight" only in the linear gate (G = 0).
  bool has_linear3 = false, has_linear = false;
  std::set<int64_t> layers;
  for (const std::string& n : names) {
    const auto parts = split_gate_name(n);
    if (!parts) fail("{}: unexpected tensor '{}' (not a retention gate tensor)", path, printable(n));
    layers.insert(parts->first);
    has_linear3 = has_linear3 || parts->second == "linear3.weight";
    has_linear = has_linear || parts->second == "linear.weight";
  }
  if (names.empty()) fail("{}: holds no tensors (not a retention gate file)", path);
  if (has_linear && has_linear3)
    fail("{}: holds both linear.weight (a linear trimkv gate) and linear3.weight (dbtrimkv gates)", path);
  const GateKind kind = has_linear3 ? GateKind::dbtrimkv : GateKind::trimkv;
  if (auto it = meta.find("gate_kind"); it != meta.end()) {
    const GateKind declared = parse_gate_kind(it->second, path + ": __metadata__ gate_kind");
    if (declared != kind)
      fail("{}: __metadata__ says gate_kind {} but the tensors are {} gates ({} linear3.weight)", path, it->second,
           gate_kind_name(kind), has_linear3 ? "with" : "without");
  }
  if (expect && *expect != kind)
    fail("{}: holds {} gates ({} linear3.weight), but {} gates were asked for", path, gate_kind_name(kind),
         has_linear3 ? "with" : "no", gate_kind_name(*expect));

  // Layers and shapes against the model.
  const int64_t L = config.num_hidden_layers;
  const int64_t present = static_cast<int64_t>(layers.size());
  if (*layers.rbegin() >= L || present != L)
    fail("{}: has gates for {} layers (layer indices {}..{}), the model has {} (num_hidden_layers)", path, present,
         *layers.begin(), *layers.rbegin(), L);
  // The input: __metadata__ gate_input ("kv": [k ‖ v] after RoPE, 2·K·head_dim wide), else h.
  GateInput input = GateInput::hidden;
  if (auto it = meta.find("gate_input"); it != meta.end())
    input = parse_gate_input(it->second, path + ": __metadata__ gate_input");
  const int64_t width = gate_input_width(config, input);
  const std::string width_is = input == GateInput::hidden
                                   ? fmt::format("{} the model's hidden_size", width)
                                   : fmt::format("{} = 2·num_key_value_heads·head_dim, gate_input kv", width);
  int64_t G = 0;
  if (!has_linear) {
    const std::string w1_name = gate_tensor_name(0, "linear1.weight");
    if (!tensors.count(w1_name)) fail("{}: missing tensor '{}'", path, w1_name);
    const Shape& w1_shape = tensors.at(w1_name).shape();
    if (w1_shape.size() != 2 || w1_shape[0] <= 0 || w1_shape[1] != width)
      fail("{}: tensor '{}' has shape {}, expected [G, {}] (G the gate width, {})", path, w1_name, shape_str(w1_shape),
           width, width_is);
    G = w1_shape[0];
  }
  if (auto it = meta.find("gate_hidden"); it != meta.end() && (it->second == "0") != has_linear)
    fail("{}: __metadata__ says gate_hidden {} but the tensors are {}", path, printable(it->second),
         has_linear ? "a linear gate (linear.weight, G = 0)" : "MLP gates (linear1.weight)");
  RetentionGates g({kind, L, width, G, config.num_key_value_heads, input});

  // Every expected name present with its shape; then nothing else.
  std::set<std::string> expected;
  for (GateParameter& p : g.params_) {
    for (size_t c = 0; c < p.file_names.size(); ++c) {
      const std::string& n = p.file_names[c];
      expected.insert(n);
      if (!tensors.count(n)) fail("{}: missing tensor '{}'", path, n);
      const Shape& shape = tensors.at(n).shape();
      if (shape != p.value.shape())
        fail("{}: tensor '{}' has shape {}, expected {} (G {}, input width {}, num_key_value_heads {})", path, n,
             shape_str(shape), shape_str(p.value.shape()), g.dims_.gate_hidden, width_is,
             config.num_key_value_heads);
      const Tensor v = as_f32(path, n, tensors.at(n));
      if (c == 0) {
        p.value = v;
      } else if (std::memcmp(v.raw(), p.value.raw(), v.nbytes()) != 0) {
        fail("{}: shared tensor '{}' differs from '{}' (a dbtrimkv shared tensor must have the same value under "
             "every layer's name)",
             path, n, p.file_names[0]);
      }
    }
  }
  for (const std::string& n : names)
    if (!expected.count(n)) fail("{}: unexpected tensor '{}'", path, printable(n));

  if (auto it = meta.find("bias_init"); it != meta.end()) {
    double b = 0;
    const auto [end, ec] = std::from_chars(it->second.data(), it->second.data() + it->second.size(), b);
    if (ec == std::errc() && end == it->second.data() + it->second.size()) g.bias_init_ = b;
  }
  return g;
}

std::vector<std::pair<std::string, Tensor>> RetentionGates::named_tensors() const {
  // File order: layer by layer, each layer's tensors in DESIGN order (a shared tensor repeated
  // under every layer's name, after that layer's own tensors).
  struct Item {
    int64_t layer;
    int order;
    std::string name;
    Tensor value;
  };
  auto rank = [](const std::string& suffix) {
    static const char* kOrder[] = {"linear.weight",  "linear1.weight", "linear1.bias", "linear2.weight",
                                   "linear2.bias", "linear3.weight", "bias"};
    for (int i = 0; i < 7; ++i)
      if (suffix == kOrder[i]) return i;
    return 7;
  };
  std::vector<Item> items;
  for (const GateParameter& p : params_)
    for (const std::string& n : p.file_names) {
      const auto parts = split_gate_name(n);
      RETAIN_CHECK(parts.has_value(), "gate name {}", n);
      items.push_back({parts->first, rank(parts->second), n, p.value});
    }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return std::tie(a.layer, a.order) < std::tie(b.layer, b.order); });
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (Item& it : items) tensors.emplace_back(std::move(it.name), std::move(it.value));
  return tensors;
}

void RetentionGates::save(const std::string& path, const std::map<std::string, std::string>& extra) const {
  std::map<std::string, std::string> meta = {
      {"format", "pt"},
      {"gate_kind", std::string(gate_kind_name(dims_.kind))},
      {"gate_hidden", std::to_string(dims_.gate_hidden)},
      {"num_hidden_layers", std::to_string(dims_.layers)},
      {"num_key_value_heads", std::to_string(dims_.kv_heads)},
      {"hidden_size", std::to_string(dims_.hidden)},
  };
  if (bias_init_) meta["bias_init"] = fmt::format("{}", *bias_init_);
  if (reads_kv()) meta["gate_input"] = "kv";  // absent: h, as every file before it
  for (const auto& [k, v] : extra) meta[k] = v;
  formats::write_safetensors(path, named_tensors(), meta);
}

}  // namespace retain::gates
