#include "model/qwen3.h"

#include <algorithm>
#include <atomic>
#include <cmath>

#include "kernels/ops.h"
#include "kernels/retention.h"

namespace retain {

void check_gates_fit(const Qwen3Config& c, const gates::GateDims& g) {
  const int64_t width = gates::gate_input_width(c, g.input);
  if (g.layers != c.num_hidden_layers || g.hidden != width || g.kv_heads != c.num_key_value_heads)
    fail("retention gates for {} layers, input width {} ({}), {} KV heads do not fit a model with {}, {}, {}", g.layers,
         g.hidden, gates::gate_input_name(g.input), g.kv_heads, c.num_hidden_layers, width, c.num_key_value_heads);
}

Tensor positions_of(const Tensor& doc) {
  if (doc.device() == Device::CPU) return ops::document_positions(doc);
  return ops::document_positions(doc.to(Device::CPU)).to(doc.device());
}

namespace {

// Attention of the layer: returns attn [T, H, d], F32 on the CPU and the kernel's bf16 output on
// CUDA (o_proj reads it as it is: an F32 copy would add T·H·d·4 B, 2.15 GB at Qwen3-4B's 128K,
// at the step's peak, and give the same product); retention-gated when log_beta is given
// (F32 [T, K]). q3, k3, v3 are consumed (reset here) so that on CUDA, whose kernels read and
// write bf16 q, k, v, out (kernels/retention.h), each F32 input is freed as soon as its bf16
// copy exists: at 128K the recomputation is where the step's memory peaks. The teacher there
// runs the gated kernel with logβ ≡ 0, which is plain attention. With `saved`, what the
// backward needs is kept in the dtype the backward reads (bf16 on CUDA). With `part` (a part of
// a longer sequence) the attention is the part's, the teacher's with logβ ≡ 0.
Tensor layer_attention(Tensor& q3, Tensor& k3, Tensor& v3, const Tensor* log_beta, const Tensor& doc, float scale,
                       int64_t layer, DecoderLayerSaved* saved, const SequencePart* part) {
  const int64_t T = q3.dim(0), H = q3.dim(1), K = k3.dim(1);
  const Device dev = q3.device();
  const bool cuda = dev == Device::CUDA;
  if (!cuda) {
    Tensor attn = Tensor::empty(q3.shape(), DType::F32, dev);
    Tensor lse;
    if (log_beta || part) {
      lse = Tensor::empty({T, H}, DType::F32, dev);
      const Tensor lb = log_beta ? *log_beta : Tensor::zeros({T, K}, DType::F32, dev);
      try {
        if (part)
          part->gated_attention(q3, k3, v3, lb, doc, scale, attn, lse);
        else
          ops::gated_attention(q3, k3, v3, lb, doc, scale, attn, lse);
      } catch (const Error& e) {  // a NaN logβ: say which layer's gate produced it
        fail("layer {}: {}", layer, e.what());
      }
      if (!log_beta && !saved) lse = Tensor();  // (a teacher keeps none, unless saved: KVPOP's targets read it)
    } else {
      ops::attention(q3, k3, v3, doc, scale, attn);
    }
    if (saved) saved->q = q3, saved->k = k3, saved->v = v3, saved->attn = attn, saved->lse = lse;
    q3 = k3 = v3 = Tensor();
    return attn;
  }
  auto narrow = [&](Tensor& t) {
    Tensor b = Tensor::empty(t.shape(), DType::BF16, dev);
    ops::cast(t, b);
    t = Tensor();
    return b;
  };
  const Tensor q = narrow(q3), k = narrow(k3), v = narrow(v3);
  Tensor out = Tensor::empty(q.shape(), DType::BF16, dev);
  const Tensor lb = log_beta ? *log_beta : Tensor::zeros({T, K}, DType::F32, dev);
  Tensor lse = Tensor::empty({T, H}, DType::F32, dev);
  try {
    if (part)
      part->gated_attention(q, k, v, lb, doc, scale, out, lse);
    else
      ops::gated_attention(q, k, v, lb, doc, scale, out, lse);
  } catch (const Error& e) {
    fail("layer {}: {}", layer, e.what());
  }
  if (saved) saved->q = q, saved->k = k, saved->v = v, saved->attn = out, saved->lse = lse;
  return out;
}

std::atomic<int64_t> g_mlp_chunk_tokens{kMlpChunkTokens};

}  // namespace

int64_t mlp_chunk_tokens() { return g_mlp_chunk_tokens.load(std::memory_order_relaxed); }

int64_t set_mlp_chunk_tokens(int64_t tokens) {
  RETAIN_CHECK(tokens >= 1, "set_mlp_chunk_tokens: {} tokens per MLP chunk", tokens);
  return g_mlp_chunk_tokens.exchange(tokens, std::memory_order_relaxed);
}

void qwen3_mlp(const Qwen3Config& c, const LayerWeights& w, Tensor& x) {
  const int64_t T = x.dim(0), D = c.hidden_size, I = c.intermediate_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  auto f32 = [&x](const Shape& shape) { return Tensor::empty(shape, DType::F32, x.device()); };
  const int64_t chunk = mlp_chunk_tokens();
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t n = std::min(T, t0 + chunk) - t0;
    Tensor xr = x.rows(t0, t0 + n);
    Tensor h2 = f32({n, D}), g = f32({n, I}), u = f32({n, I});
    ops::rmsnorm(xr, w.post_norm, eps, h2);
    ops::linear(h2, w.gate_proj, g);
    ops::linear(h2, w.up_proj, u);
    ops::swiglu(g, u, g);
    ops::linear(g, w.down_proj, xr, /*accumulate=*/true);  // the residual add in the GEMM
  }
}

void qwen3_decoder_layer(const Qwen3Config& c, const LayerWeights& w, const RopeParams& rope, const Tensor& positions,
                         const Tensor& doc, const gates::RetentionGates* gates, int64_t layer, Tensor& x,
                         Tensor* log_beta_out, DecoderLayerSaved* saved, const SequencePart* part) {
  const int64_t T = x.dim(0), D = c.hidden_size, H = c.num_attention_heads, K = c.num_key_value_heads,
                d = c.head_dim;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const Device dev = x.device();  // every buffer lives where the residual stream does
  auto f32 = [dev](const Shape& shape) { return Tensor::empty(shape, DType::F32, dev); };
  // Without `saved`, buffers are reused in place (the teacher's memory); with it, each
  // intermediate gets its own buffer. The ops give the same values either way.

  // Attention block.
  Tensor h = f32({T, D});
  ops::rmsnorm(x, w.input_norm, eps, h);
  Tensor q = f32({T, H * d}), k = f32({T, K * d}), v = f32({T, K * d});
  ops::linear(h, w.q_proj, q);
  ops::linear(h, w.k_proj, k);
  ops::linear(h, w.v_proj, v);
  Tensor qn = saved ? f32(q.shape()) : q;
  Tensor kn = saved ? f32(k.shape()) : k;
  Tensor qnh = qn.reshape({T * H, d}), knh = kn.reshape({T * K, d});
  ops::rmsnorm(q.reshape({T * H, d}), w.q_norm, eps, qnh);  // per-head norm, before RoPE (as HF)
  ops::rmsnorm(k.reshape({T * K, d}), w.k_norm, eps, knh);
  Tensor q3 = qn.reshape({T, H, d}), k3 = kn.reshape({T, K, d}), v3 = v.reshape({T, K, d});
  ops::rope(q3, positions, rope.inv_freq, rope.attention_factor);
  ops::rope(k3, positions, rope.inv_freq, rope.attention_factor);
  // From here q3, k3, v3 are the only handles on the attention inputs (q and k stay only as
  // the saved pre-norm projections), so layer_attention can free them as it goes.
  if (!saved) q = k = Tensor();
  qn = kn = v = qnh = knh = Tensor();
  Tensor attn;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  if (gates) {
    // logβ [T, K] from the q/k/v input h, or from [k ‖ v] after RoPE (GateInput::kv).
    const Tensor gate_input = gates->input_of(h, k3, v3);
    const Tensor log_beta = gates->forward(layer, gate_input, saved ? &saved->gate : nullptr);
    if (saved) saved->gate_input = gate_input;
    attn = layer_attention(q3, k3, v3, &log_beta, doc, scale, layer, saved, part);
    if (log_beta_out) {
      RETAIN_CHECK(log_beta_out->dtype() == DType::F32 && log_beta_out->shape() == log_beta.shape(),
                   "decoder layer: log_beta_out {} for logβ {}", shape_str(log_beta_out->shape()),
                   shape_str(log_beta.shape()));
      log_beta_out->copy_from(log_beta);
    }
    if (saved) saved->log_beta = log_beta;
  } else {
    attn = layer_attention(q3, k3, v3, nullptr, doc, scale, layer, saved, part);
  }
  ops::linear(attn.reshape({T, H * d}), w.o_proj, x, /*accumulate=*/true);  // the residual add in the GEMM
  attn = Tensor();
  if (saved) {
    saved->q_raw = q, saved->k_raw = k;
    if (saved->attention_only) {  // x ends here: x_mid is x itself, not a copy
      saved->x_mid = x;
      return;
    }
    saved->x_mid = x.clone();
  }

  h = Tensor(), q = Tensor(), k = Tensor();
  qwen3_mlp(c, w, x);
}

Tensor qwen3_hidden(WeightProvider& weights, const Tensor& ids, const Tensor& doc_ids, const LayerProgress& on_layer,
                    const gates::RetentionGates* gates, const SequencePart* part) {
  const Qwen3Config& c = weights.config();
  if (gates) check_gates_fit(c, gates->dims());
  RETAIN_CHECK(ids.dtype() == DType::I32 && ids.ndim() == 1 && doc_ids.dtype() == DType::I32 &&
                   doc_ids.shape() == ids.shape(),
               "qwen3_hidden: ids {} doc_ids {}", shape_str(ids.shape()), shape_str(doc_ids.shape()));
  const int64_t T = ids.dim(0);
  Tensor x = Tensor::empty({T, c.hidden_size}, DType::F32, ids.device());
  ops::embedding(weights.embedding(), ids, x);
  const Tensor positions = part ? part->positions() : positions_of(doc_ids);
  const RopeParams rope = compute_rope_params(c, x.device());
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    qwen3_decoder_layer(c, weights.layer(l), rope, positions, doc_ids, gates, l, x, nullptr, nullptr, part);
    if (on_layer) on_layer(l + 1, c.num_hidden_layers);
  }
  ops::rmsnorm(x, weights.final_norm(), static_cast<float>(c.rms_norm_eps), x);
  return x;
}

Tensor qwen3_forward(WeightProvider& weights, const Tensor& ids, const Tensor& doc_ids, const LayerProgress& on_layer,
                     const gates::RetentionGates* gates) {
  const Tensor hidden = qwen3_hidden(weights, ids, doc_ids, on_layer, gates);
  Tensor logits = Tensor::empty({hidden.dim(0), weights.config().vocab_size}, DType::F32, hidden.device());
  ops::linear(hidden, weights.lm_head(), logits);
  return logits;
}

}  // namespace retain
