#include "model/student.h"

#include <algorithm>
#include <cmath>

#include "kernels/ops.h"
#include "kernels/retention.h"
#include "model/qwen3.h"

namespace retain {

namespace {

void check_ids(const Tensor& ids, const Tensor& doc_ids, const char* what) {
  RETAIN_CHECK(ids.dtype() == DType::I32 && ids.ndim() == 1 && doc_ids.dtype() == DType::I32 &&
                   doc_ids.shape() == ids.shape(),
               "{}: ids {} doc_ids {}", what, shape_str(ids.shape()), shape_str(doc_ids.shape()));
}

// The activation checkpoint of a layer input: F32 on the CPU (the exact reference); bf16 on
// CUDA, half the bytes of the largest thing the step keeps (Qwen3-4B at 128K: 24 GB instead of
// 48), so the backward recomputes each layer from its input rounded to bf16.
Tensor checkpoint_of(const Tensor& x) {
  if (x.device() == Device::CPU) return x.clone();
  Tensor b = Tensor::empty(x.shape(), DType::BF16, x.device());
  ops::cast(x, b);
  return b;
}

// A checkpoint back as the F32 layer input (on the CPU the checkpoint itself: do not write it).
Tensor layer_input(const Tensor& checkpoint) {
  if (checkpoint.dtype() == DType::F32) return checkpoint;
  Tensor x = Tensor::empty(checkpoint.shape(), DType::F32, checkpoint.device());
  ops::cast(checkpoint, x);
  return x;
}

// The F32 layer input as a buffer of its own, which the recomputation overwrites in place.
Tensor writable_layer_input(const Tensor& checkpoint) {
  return checkpoint.dtype() == DType::F32 ? checkpoint.clone() : layer_input(checkpoint);
}

// The gated attention's backward: dq [T, H, d], dk, dv [T, K, d] F32 and dlog_beta F32 [T, K]
// from dout (F32 [T, H, d], consumed: reset here). s.q, s.k, s.v, s.attn and s.lse are consumed
// too: nothing after this reads them. On the CPU the F32 reference. On CUDA the kernels take
// bf16 dout, dq, dk, dv (s.q, s.k, s.v, s.attn are bf16 there); each buffer is allocated as
// late and freed as early as the conversions allow, since at 128K this is where the step's
// memory peaks (docs/memory-plan.md).
void attention_backward(DecoderLayerSaved& s, const Tensor& doc, float scale, const SequencePart* part, Tensor& dout,
                        Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dlog_beta) {
  const Device dev = dout.device();
  const int64_t T = s.q.dim(0), H = s.q.dim(1), K = s.k.dim(1), d = s.q.dim(2);
  auto make = [dev](const Shape& shape, DType dt) { return Tensor::empty(shape, dt, dev); };
  dlog_beta = make({T, K}, DType::F32);
  if (dev == Device::CPU) {
    dq = make({T, H, d}, DType::F32), dk = make({T, K, d}, DType::F32), dv = make({T, K, d}, DType::F32);
    if (part)
      part->gated_attention_backward(s.q, s.k, s.v, s.log_beta, doc, scale, s.attn, s.lse, dout, dq, dk, dv,
                                     dlog_beta);
    else
      ops::gated_attention_backward(s.q, s.k, s.v, s.log_beta, doc, scale, s.attn, s.lse, dout, dq, dk, dv, dlog_beta);
    dout = Tensor();
    s.q = s.k = s.v = s.attn = s.lse = Tensor();
    return;
  }
  Tensor dout_b = make(dout.shape(), DType::BF16);
  ops::cast(dout, dout_b);
  dout = Tensor();
  Tensor dq_b = make({T, H, d}, DType::BF16), dk_b = make({T, K, d}, DType::BF16), dv_b = make({T, K, d}, DType::BF16);
  if (part)
    part->gated_attention_backward(s.q, s.k, s.v, s.log_beta, doc, scale, s.attn, s.lse, dout_b, dq_b, dk_b, dv_b,
                                   dlog_beta);
  else
    ops::gated_attention_backward(s.q, s.k, s.v, s.log_beta, doc, scale, s.attn, s.lse, dout_b, dq_b, dk_b, dv_b,
                                  dlog_beta);
  dout_b = Tensor();
  s.q = s.k = s.v = s.attn = s.lse = Tensor();  // before dq, dk, dv widen to F32
  auto widen = [&](Tensor& narrow, Tensor& wide) {
    wide = make(narrow.shape(), DType::F32);
    ops::cast(narrow, wide);
    narrow = Tensor();
  };
  widen(dq_b, dq);
  widen(dk_b, dk);
  widen(dv_b, dv);
}

// Layer l's backward: on entry dx = ∂loss/∂x_{l+1} (the layer's output), on return
// ∂loss/∂x_l. `s` is the layer's recomputed forward (consumed: each part is freed once used),
// checkpoint its input's checkpoint, extra_dlog_beta the capacity loss's ∂/∂logβ [T, K] for
// this layer (or null). Adds the gate's parameter grads. Buffers are allocated as late and
// freed as early as the order allows: at 128K on a GPU this is where the step's memory peaks.
void layer_backward(const Qwen3Config& c, const LayerWeights& w, const RopeParams& rope, const StudentPass& pass,
                    gates::RetentionGates& gates, int64_t layer, const Tensor& checkpoint, DecoderLayerSaved& s,
                    const Tensor* extra_dlog_beta, Tensor& dx) {
  const int64_t T = dx.dim(0), D = c.hidden_size, H = c.num_attention_heads, K = c.num_key_value_heads,
                d = c.head_dim, I = c.intermediate_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const Device dev = dx.device();
  auto f32 = [dev](const Shape& shape) { return Tensor::empty(shape, DType::F32, dev); };

  // MLP block: x_out = x_mid + down(silu(g)·u), g, u = gate/up(post_norm(x_mid)), recomputed
  // from x_mid mlp_chunk_tokens() tokens at a time (the forward's chunks): every step is row-wise.
  const int64_t chunk = mlp_chunk_tokens();
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t n = std::min(T, t0 + chunk) - t0;
    const Tensor xm = s.x_mid.rows(t0, t0 + n);
    Tensor dxr = dx.rows(t0, t0 + n);
    Tensor h2 = f32({n, D}), g = f32({n, I}), u = f32({n, I}), dm = f32({n, I});
    ops::rmsnorm(xm, w.post_norm, eps, h2);
    ops::linear(h2, w.gate_proj, g);
    ops::linear(h2, w.up_proj, u);
    ops::linear_backward_input(dxr, w.down_proj, dm);
    ops::swiglu_backward(g, u, dm, g, u);  // dg, du overwrite g, u
    ops::linear_backward_input(g, w.gate_proj, h2);
    ops::linear_backward_input(u, w.up_proj, h2, /*accumulate=*/true);
    ops::rmsnorm_backward(xm, w.post_norm, eps, h2, dxr, /*accumulate=*/true);  // dx = ∂loss/∂x_mid (residual + MLP)
  }
  s.x_mid = Tensor();

  // Attention block: x_mid = x_in + o_proj(attn), attn = gated_attention(q, k, v, logβ(h)).
  Tensor dattn = f32({T, H * d});
  ops::linear_backward_input(dx, w.o_proj, dattn);
  dattn = dattn.reshape({T, H, d});
  Tensor dq, dk, dv, dlog_beta;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  attention_backward(s, pass.doc, scale, pass.part, dattn, dq, dk, dv, dlog_beta);
  if (extra_dlog_beta) ops::add_inplace(dlog_beta, *extra_dlog_beta);
  if (gates.reads_kv()) {  // the gate read [k ‖ v] after RoPE: its input gradient joins dk and dv here
    Tensor dx = Tensor::zeros(s.gate_input.shape(), DType::F32, dev);
    gates.backward(layer, s.gate_input, s.gate, dlog_beta, &dx);
    Tensor dk2 = dk.reshape({T, K * d}), dv2 = dv.reshape({T, K * d});
    ops::split_columns_add(dx, dk2, dv2);
  }
  ops::rope_backward(dq, pass.positions, rope.inv_freq, rope.attention_factor);
  ops::rope_backward(dk, pass.positions, rope.inv_freq, rope.attention_factor);
  {
    Tensor dqh = dq.reshape({T * H, d}), dkh = dk.reshape({T * K, d});
    ops::rmsnorm_backward(s.q_raw.reshape({T * H, d}), w.q_norm, eps, dqh, dqh);
    ops::rmsnorm_backward(s.k_raw.reshape({T * K, d}), w.k_norm, eps, dkh, dkh);
  }
  s.q_raw = s.k_raw = Tensor();
  // ∂loss/∂h: the q, k, v projections, then (gates reading h) the gate's path (RetentionGates::backward adds it).
  Tensor dh = f32({T, D});
  ops::linear_backward_input(dq.reshape({T, H * d}), w.q_proj, dh);
  ops::linear_backward_input(dk.reshape({T, K * d}), w.k_proj, dh, /*accumulate=*/true);
  ops::linear_backward_input(dv.reshape({T, K * d}), w.v_proj, dh, /*accumulate=*/true);
  dq = dk = dv = Tensor();
  if (!gates.reads_kv()) gates.backward(layer, s.gate_input, s.gate, dlog_beta, &dh);
  s = DecoderLayerSaved();
  ops::rmsnorm_backward(layer_input(checkpoint), w.input_norm, eps, dh, dx, /*accumulate=*/true);  // ∂loss/∂x_in
}

}  // namespace

StudentPass student_forward(WeightProvider& weights, const gates::RetentionGates& gates, const Tensor& ids,
                            const Tensor& doc_ids, const SequencePart* part) {
  const Qwen3Config& c = weights.config();
  check_gates_fit(c, gates.dims());
  check_ids(ids, doc_ids, "student_forward");
  const int64_t T = ids.dim(0), L = c.num_hidden_layers, K = c.num_key_value_heads;
  StudentPass pass;
  pass.ids = ids, pass.doc = doc_ids;
  const Device dev = ids.device();  // the pass runs where the token ids are
  pass.positions = part ? part->positions() : positions_of(doc_ids);
  pass.part = part;
  pass.log_beta = Tensor::empty({L, T, K}, DType::F32, dev);
  Tensor x = Tensor::empty({T, c.hidden_size}, DType::F32, dev);
  ops::embedding(weights.embedding(), ids, x);
  const RopeParams rope = compute_rope_params(c, dev);
  pass.layer_inputs.reserve(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    pass.layer_inputs.push_back(checkpoint_of(x));
    Tensor log_beta = pass.log_beta.rows(l, l + 1).reshape({T, K});
    qwen3_decoder_layer(c, weights.layer(l), rope, pass.positions, doc_ids, &gates, l, x, &log_beta, nullptr, part);
  }
  pass.final_input = x;
  pass.hidden = Tensor::empty(x.shape(), DType::F32, dev);
  ops::rmsnorm(x, weights.final_norm(), static_cast<float>(c.rms_norm_eps), pass.hidden);
  return pass;
}

void student_backward(WeightProvider& weights, gates::RetentionGates& gates, const StudentPass& pass,
                      const Tensor& d_hidden, const Tensor& d_log_beta) {
  const Qwen3Config& c = weights.config();
  check_gates_fit(c, gates.dims());
  check_ids(pass.ids, pass.doc, "student_backward");
  const int64_t T = pass.ids.dim(0), D = c.hidden_size, L = c.num_hidden_layers, K = c.num_key_value_heads;
  RETAIN_CHECK(static_cast<int64_t>(pass.layer_inputs.size()) == L && pass.final_input.shape() == Shape({T, D}) &&
                   pass.positions.shape() == pass.ids.shape(),
               "student_backward: the pass has {} layer inputs and final input {} for {} layers, T {}, D {}",
               pass.layer_inputs.size(), shape_str(pass.final_input.shape()), L, T, D);
  RETAIN_CHECK(d_hidden.dtype() == DType::F32 && d_hidden.shape() == Shape({T, D}),
               "student_backward: d_hidden {} {}, expected F32 [{}, {}]", dtype_name(d_hidden.dtype()),
               shape_str(d_hidden.shape()), T, D);
  const bool has_extra = d_log_beta.numel() > 0;
  RETAIN_CHECK(!has_extra || (d_log_beta.dtype() == DType::F32 && d_log_beta.shape() == Shape({L, T, K})),
               "student_backward: d_log_beta {} {}, expected F32 [{}, {}, {}] or none", dtype_name(d_log_beta.dtype()),
               shape_str(d_log_beta.shape()), L, T, K);

  const RopeParams rope = compute_rope_params(c, d_hidden.device());
  Tensor dx = Tensor::empty({T, D}, DType::F32, d_hidden.device());  // ∂loss/∂x_l, from l = L down
  ops::rmsnorm_backward(pass.final_input, weights.final_norm(), static_cast<float>(c.rms_norm_eps), d_hidden, dx);
  for (int64_t l = L - 1; l >= 0; --l) {
    const LayerWeights& w = weights.layer(l);
    const Tensor& checkpoint = pass.layer_inputs[static_cast<size_t>(l)];
    // The recomputation runs in place on a copy (the checkpoint stays intact); the layer's
    // input is formed again from the checkpoint where its backward needs it, at the end.
    Tensor x = writable_layer_input(checkpoint);
    DecoderLayerSaved saved;
    saved.attention_only = true;  // layer_backward recomputes the MLP chunk by chunk
    qwen3_decoder_layer(c, w, rope, pass.positions, pass.doc, &gates, l, x, nullptr, &saved, pass.part);
    x = Tensor();  // lives on as saved.x_mid
    const Tensor extra = has_extra ? d_log_beta.rows(l, l + 1).reshape({T, K}) : Tensor();
    layer_backward(c, w, rope, pass, gates, l, checkpoint, saved, has_extra ? &extra : nullptr, dx);
  }
}

}  // namespace retain
