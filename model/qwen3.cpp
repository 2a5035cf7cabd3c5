#include "model/qwen3.h"

#include <cmath>
#include <cstring>

#include "kernels/ops.h"
#include "kernels/retention.h"

namespace retain {

void check_gates_fit(const Qwen3Config& c, const gates::GateDims& g) {
  if (g.layers != c.num_hidden_layers || g.hidden != c.hidden_size || g.kv_heads != c.num_key_value_heads)
    fail("retention gates for {} layers, hidden size {}, {} KV heads do not fit a model with {}, {}, {}", g.layers,
         g.hidden, g.kv_heads, c.num_hidden_layers, c.hidden_size, c.num_key_value_heads);
}

void qwen3_decoder_layer(const Qwen3Config& c, const LayerWeights& w, const RopeParams& rope, const Tensor& positions,
                         const Tensor& doc, const gates::RetentionGates* gates, int64_t layer, Tensor& x,
                         Tensor* log_beta_out, DecoderLayerSaved* saved) {
  const int64_t T = x.dim(0), D = c.hidden_size, H = c.num_attention_heads, K = c.num_key_value_heads,
                d = c.head_dim, I = c.intermediate_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  // Without `saved`, buffers are reused in place (the teacher's memory); with it, each
  // intermediate gets its own buffer. The ops give the same values either way.

  // Attention block.
  Tensor h = Tensor::empty({T, D}, DType::F32);
  ops::rmsnorm(x, w.input_norm, eps, h);
  Tensor q = Tensor::empty({T, H * d}, DType::F32), k = Tensor::empty({T, K * d}, DType::F32),
         v = Tensor::empty({T, K * d}, DType::F32);
  ops::linear(h, w.q_proj, q);
  ops::linear(h, w.k_proj, k);
  ops::linear(h, w.v_proj, v);
  Tensor qn = saved ? Tensor::empty(q.shape(), DType::F32) : q;
  Tensor kn = saved ? Tensor::empty(k.shape(), DType::F32) : k;
  Tensor qnh = qn.reshape({T * H, d}), knh = kn.reshape({T * K, d});
  ops::rmsnorm(q.reshape({T * H, d}), w.q_norm, eps, qnh);  // per-head norm, before RoPE (as HF)
  ops::rmsnorm(k.reshape({T * K, d}), w.k_norm, eps, knh);
  Tensor q3 = qn.reshape({T, H, d}), k3 = kn.reshape({T, K, d}), v3 = v.reshape({T, K, d});
  ops::rope(q3, positions, rope.inv_freq, rope.attention_factor);
  ops::rope(k3, positions, rope.inv_freq, rope.attention_factor);
  Tensor attn = Tensor::empty({T, H, d}, DType::F32);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  if (gates) {
    // logβ [T, K] from the q/k/v input.
    const Tensor log_beta = gates->forward(layer, h, saved ? &saved->gate : nullptr);
    Tensor lse = Tensor::empty({T, H}, DType::F32);
    try {
      ops::gated_attention(q3, k3, v3, log_beta, doc, scale, attn, lse);
    } catch (const Error& e) {  // a NaN logβ: say which layer's gate produced it
      fail("layer {}: {}", layer, e.what());
    }
    if (log_beta_out) {
      RETAIN_CHECK(log_beta_out->dtype() == DType::F32 && log_beta_out->shape() == log_beta.shape(),
                   "decoder layer: log_beta_out {} for logβ {}", shape_str(log_beta_out->shape()),
                   shape_str(log_beta.shape()));
      std::memcpy(log_beta_out->raw(), log_beta.raw(), log_beta.nbytes());
    }
    if (saved) saved->log_beta = log_beta, saved->lse = lse;
  } else {
    ops::attention(q3, k3, v3, doc, scale, attn);
  }
  Tensor proj = Tensor::empty({T, D}, DType::F32);
  ops::linear(attn.reshape({T, H * d}), w.o_proj, proj);
  ops::add_inplace(x, proj);
  if (saved) {
    saved->h = h;
    saved->q_raw = q, saved->k_raw = k;
    saved->q = q3, saved->k = k3, saved->v = v3;
    saved->attn = attn;
    saved->x_mid = x.clone();
  }

  // MLP block: down(silu(gate(h)) * up(h)).
  Tensor h2 = saved ? Tensor::empty({T, D}, DType::F32) : h;
  ops::rmsnorm(x, w.post_norm, eps, h2);
  Tensor g = Tensor::empty({T, I}, DType::F32), u = Tensor::empty({T, I}, DType::F32);
  ops::linear(h2, w.gate_proj, g);
  ops::linear(h2, w.up_proj, u);
  Tensor m = saved ? Tensor::empty({T, I}, DType::F32) : g;
  ops::swiglu(g, u, m);
  ops::linear(m, w.down_proj, proj);
  ops::add_inplace(x, proj);
  if (saved) saved->mlp_gate = g, saved->mlp_up = u;
}

Tensor qwen3_hidden(WeightProvider& weights, const Tensor& ids, const Tensor& doc_ids, const LayerProgress& on_layer,
                    const gates::RetentionGates* gates) {
  const Qwen3Config& c = weights.config();
  if (gates) check_gates_fit(c, gates->dims());
  RETAIN_CHECK(ids.dtype() == DType::I32 && ids.ndim() == 1 && doc_ids.dtype() == DType::I32 &&
                   doc_ids.shape() == ids.shape(),
               "qwen3_hidden: ids {} doc_ids {}", shape_str(ids.shape()), shape_str(doc_ids.shape()));
  const int64_t T = ids.dim(0);
  Tensor x = Tensor::empty({T, c.hidden_size}, DType::F32);
  ops::embedding(weights.embedding(), ids, x);
  const Tensor positions = ops::document_positions(doc_ids);
  const RopeParams rope = compute_rope_params(c);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    qwen3_decoder_layer(c, weights.layer(l), rope, positions, doc_ids, gates, l, x);
    if (on_layer) on_layer(l + 1, c.num_hidden_layers);
  }
  ops::rmsnorm(x, weights.final_norm(), static_cast<float>(c.rms_norm_eps), x);
  return x;
}

Tensor qwen3_forward(WeightProvider& weights, const Tensor& ids, const Tensor& doc_ids, const LayerProgress& on_layer,
                     const gates::RetentionGates* gates) {
  const Tensor hidden = qwen3_hidden(weights, ids, doc_ids, on_layer, gates);
  Tensor logits = Tensor::empty({hidden.dim(0), weights.config().vocab_size}, DType::F32);
  ops::linear(hidden, weights.lm_head(), logits);
  return logits;
}

}  // namespace retain
