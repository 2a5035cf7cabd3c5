#include "model/weights.h"

#include <filesystem>
#include <set>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace retain {

namespace fs = std::filesystem;

std::string names::layer(int64_t l, const char* suffix) { return fmt::format("model.layers.{}.{}", l, suffix); }

namespace {

// Per-layer tensor suffixes with their shapes, in LayerWeights order.
std::vector<std::pair<const char*, Shape>> layer_shapes(const Qwen3Config& c) {
  const int64_t D = c.hidden_size, d = c.head_dim, H = c.num_attention_heads, K = c.num_key_value_heads,
                I = c.intermediate_size;
  return {
      {"input_layernorm.weight", {D}},
      {"self_attn.q_proj.weight", {H * d, D}},
      {"self_attn.k_proj.weight", {K * d, D}},
      {"self_attn.v_proj.weight", {K * d, D}},
      {"self_attn.o_proj.weight", {D, H * d}},
      {"self_attn.q_norm.weight", {d}},
      {"self_attn.k_norm.weight", {d}},
      {"post_attention_layernorm.weight", {D}},
      {"mlp.gate_proj.weight", {I, D}},
      {"mlp.up_proj.weight", {I, D}},
      {"mlp.down_proj.weight", {D, I}},
  };
}

Tensor* layer_slots(LayerWeights& w, size_t i) { return layer_fields(w)[i]; }

}  // namespace

std::vector<std::pair<std::string, Shape>> layer_tensors(const Qwen3Config& c, int64_t l) {
  std::vector<std::pair<std::string, Shape>> out;
  for (const auto& [suffix, shape] : layer_shapes(c)) out.emplace_back(names::layer(l, suffix), shape);
  return out;
}

std::array<Tensor*, 11> layer_fields(LayerWeights& w) {
  return {&w.input_norm, &w.q_proj, &w.k_proj,    &w.v_proj,  &w.o_proj,   &w.q_norm,
          &w.k_norm,     &w.post_norm, &w.gate_proj, &w.up_proj, &w.down_proj};
}

namespace {

bool is_float(DType dt) { return dt == DType::F32 || dt == DType::BF16 || dt == DType::F16; }

// F32 view if the stored tensor is F32, otherwise a converted copy.
Tensor as_f32(const Tensor& t) { return t.dtype() == DType::F32 ? t : t.to_dtype(DType::F32); }

}  // namespace

std::vector<std::pair<std::string, Shape>> expected_tensors(const Qwen3Config& c) {
  std::vector<std::pair<std::string, Shape>> out;
  out.emplace_back(names::kEmbed, Shape{c.vocab_size, c.hidden_size});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    for (const auto& [suffix, shape] : layer_shapes(c)) out.emplace_back(names::layer(l, suffix), shape);
  out.emplace_back(names::kFinalNorm, Shape{c.hidden_size});
  if (!c.tie_word_embeddings) out.emplace_back(names::kLmHead, Shape{c.vocab_size, c.hidden_size});
  return out;
}

Qwen3Checkpoint Qwen3Checkpoint::open(const std::string& dir) {
  if (!fs::is_directory(dir)) fail("{}: not a model directory", dir);
  Qwen3Checkpoint ck;
  ck.dir_ = dir;
  const std::string config_path = (fs::path(dir) / "config.json").string();
  if (!fs::exists(config_path)) fail("{}: missing config.json", dir);
  ck.config_ = Qwen3Config::load(config_path);
  ck.files_ = formats::SafetensorsSet::open_dir(dir);

  std::set<std::string> expected;
  for (const auto& [name, shape] : expected_tensors(ck.config_)) {
    expected.insert(name);
    if (!ck.files_.contains(name))
      fail("{}: missing tensor '{}' required by config.json", dir, name);
    const formats::SafetensorsEntry& e = ck.files_.entry(name);
    if (e.shape != shape)
      fail("{}: tensor '{}' has shape {}, config.json implies {}", ck.files_.file_of(name), name,
           shape_str(e.shape), shape_str(shape));
    if (!is_float(e.dtype))
      fail("{}: tensor '{}' has dtype {}; weights must be BF16, F16 or F32", ck.files_.file_of(name), name,
           dtype_name(e.dtype));
  }
  for (const std::string& name : ck.files_.names()) {
    if (expected.count(name)) continue;
    if (name == names::kLmHead && ck.config_.tie_word_embeddings) {
      // transformers drops it too: with tied embeddings the head is the embedding.
      spdlog::warn("{}: ignoring '{}' because tie_word_embeddings is true", dir, name);
      continue;
    }
    fail("{}: unexpected tensor '{}' in {} (not part of Qwen3 with this config.json)", dir, name,
         ck.files_.file_of(name));
  }
  return ck;
}

LocalWeightProvider::LocalWeightProvider(std::shared_ptr<const Qwen3Checkpoint> ckpt) : ckpt_(std::move(ckpt)) {
  embedding_ = ckpt_->tensor(names::kEmbed);
  final_norm_ = as_f32(ckpt_->tensor(names::kFinalNorm));
}

const LayerWeights& LocalWeightProvider::layer(int64_t l) {
  const auto shapes = layer_shapes(config());
  for (size_t i = 0; i < shapes.size(); ++i) *layer_slots(layer_, i) = as_f32(ckpt_->tensor(names::layer(l, shapes[i].first)));
  return layer_;
}

const Tensor& LocalWeightProvider::lm_head() {
  if (!lm_head_.numel())
    lm_head_ = as_f32(ckpt_->tensor(config().tie_word_embeddings ? names::kEmbed : names::kLmHead));
  return lm_head_;
}

}  // namespace retain
