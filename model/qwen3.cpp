#include "model/qwen3.h"

#include <cmath>

#include "kernels/ops.h"
#include "kernels/retention.h"
#include "model/rope_params.h"

namespace retain {

namespace {

// One decoder layer, in place on the residual stream x [T, D]; retention-gated when `gates`.
void decoder_layer(const Qwen3Config& c, const LayerWeights& w, const RopeParams& rope, const Tensor& positions,
                   const Tensor& doc, const gates::RetentionGates* gates, int64_t layer, Tensor& x) {
  const int64_t T = x.dim(0), D = c.hidden_size, H = c.num_attention_heads, K = c.num_key_value_heads,
                d = c.head_dim, I = c.intermediate_size;
  const float eps = static_cast<float>(c.rms_norm_eps);

  // Attention block.
  Tensor h = Tensor::empty({T, D}, DType::F32);
  ops::rmsnorm(x, w.input_norm, eps, h);
  Tensor q = Tensor::empty({T, H * d}, DType::F32), k = Tensor::empty({T, K * d}, DType::F32),
         v = Tensor::empty({T, K * d}, DType::F32);
  ops::linear(h, w.q_proj, q);
  ops::linear(h, w.k_proj, k);
  ops::linear(h, w.v_proj, v);
  Tensor qh = q.reshape({T * H, d}), kh = k.reshape({T * K, d});
  ops::rmsnorm(qh, w.q_norm, eps, qh);  // per-head norm, before RoPE (as HF)
  ops::rmsnorm(kh, w.k_norm, eps, kh);
  Tensor q3 = q.reshape({T, H, d}), k3 = k.reshape({T, K, d});
  ops::rope(q3, positions, rope.inv_freq, rope.attention_factor);
  ops::rope(k3, positions, rope.inv_freq, rope.attention_factor);
  Tensor attn = Tensor::empty({T, H, d}, DType::F32);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  if (gates) {
    const Tensor log_beta = gates->forward(layer, h);  // [T, K], from the q/k/v input
    Tensor lse = Tensor::empty({T, H}, DType::F32);
    ops::gated_attention(q3, k3, v.reshape({T, K, d}), log_beta, doc, scale, attn, lse);
  } else {
    ops::attention(q3, k3, v.reshape({T, K, d}), doc, scale, attn);
  }
  Tensor proj = Tensor::empty({T, D}, DType::F32);
  ops::linear(attn.reshape({T, H * d}), w.o_proj, proj);
  ops::add_inplace(x, proj);

  // MLP block: down(silu(gate(h)) * up(h)).
  ops::rmsnorm(x, w.post_norm, eps, h);
  Tensor g = Tensor::empty({T, I}, DType::F32), u = Tensor::empty({T, I}, DType::F32);
  ops::linear(h, w.gate_proj, g);
  ops::linear(h, w.up_proj, u);
  ops::swiglu(g, u, g);
  ops::linear(g, w.down_proj, proj);
  ops::add_inplace(x, proj);
}

}  // namespace

Tensor qwen3_forward(WeightProvider& weights, const Tensor& ids, const Tensor& doc_ids, const LayerProgress& on_layer,
                     const gates::RetentionGates* gates) {
  const Qwen3Config& c = weights.config();
  if (gates) {
    const gates::GateDims& g = gates->dims();
    if (g.layers != c.num_hidden_layers || g.hidden != c.hidden_size || g.kv_heads != c.num_key_value_heads)
      fail("retention gates for {} layers, hidden size {}, {} KV heads do not fit a model with {}, {}, {}", g.layers,
           g.hidden, g.kv_heads, c.num_hidden_layers, c.hidden_size, c.num_key_value_heads);
  }
  RETAIN_CHECK(ids.dtype() == DType::I32 && ids.ndim() == 1 && doc_ids.dtype() == DType::I32 &&
                   doc_ids.shape() == ids.shape(),
               "qwen3_forward: ids {} doc_ids {}", shape_str(ids.shape()), shape_str(doc_ids.shape()));
  const int64_t T = ids.dim(0);
  Tensor x = Tensor::empty({T, c.hidden_size}, DType::F32);
  ops::embedding(weights.embedding(), ids, x);
  const Tensor positions = ops::document_positions(doc_ids);
  const RopeParams rope = compute_rope_params(c);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    decoder_layer(c, weights.layer(l), rope, positions, doc_ids, gates, l, x);
    if (on_layer) on_layer(l + 1, c.num_hidden_layers);
  }
  ops::rmsnorm(x, weights.final_norm(), static_cast<float>(c.rms_norm_eps), x);
  Tensor logits = Tensor::empty({T, c.vocab_size}, DType::F32);
  ops::linear(x, weights.lm_head(), logits);
  return logits;
}

}  // namespace retain
