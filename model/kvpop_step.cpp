// The KVPOP scorer step (model/kvpop_step.h): the teacher's decoder layers one at a time (only
// the residual stream and the current layer's saved k, v, q are alive), then per (layer, head)
// project → mLSTM → pairwise loss and back.
#include "model/kvpop_step.h"

#include <cmath>

#include "kernels/ops.h"
#include "kernels/retention.h"
#include "model/qwen3.h"
#include "model/rope_params.h"

namespace retain::kvpop {

namespace {

// out += g (allocating out as zeros on first use).
void add_into(Tensor& out, const Tensor& g) {
  if (out.numel() == 0 || out.shape() != g.shape()) out = Tensor::zeros(g.shape(), DType::F32);
  for (int64_t i = 0; i < g.numel(); ++i) out.data<float>()[i] += g.data<float>()[i];
}

// t as F32 on its own device (bf16 q, k, v on CUDA are cast where they live).
Tensor f32(const Tensor& t) {
  if (t.dtype() == DType::F32) return t;
  Tensor f = Tensor::empty(t.shape(), DType::F32, t.device());
  ops::cast(t, f);
  return f;
}

Projected projected_to(const Projected& P, Device dev) {
  auto to = [dev](const Tensor& t) { return t.numel() == 0 ? t : t.on(dev); };
  return Projected{to(P.q), to(P.k), to(P.v), to(P.igate), to(P.log_f)};
}

}  // namespace

TeacherPass teacher_pass(WeightProvider& weights, const Tensor& ids, const Tensor& doc, const StepSettings& s,
                         const std::vector<std::vector<double>>* target_log_gamma, const SequencePart* part) {
  const Qwen3Config& c = weights.config();
  RETAIN_CHECK(s.topk >= 1 && s.window >= 1 && s.sinks >= 0, "kvpop::teacher_pass: window {} sinks {} topk {}",
               s.window, s.sinks, s.topk);
  RETAIN_CHECK(!s.effective_cutoff || target_log_gamma, "kvpop::teacher_pass: effective targets need log γ");
  const int64_t T = ids.dim(0), K = c.num_key_value_heads, hd = c.head_dim, H = c.num_attention_heads;
  // The frozen model and the targets run where the weights are (DESIGN §2); what the scorers
  // and the decisions need comes back to the host: k, v, log m, per layer.
  const Device dev = weights.device();
  TeacherPass pass;
  pass.doc = doc.on(Device::CPU);
  pass.device = dev;
  pass.doc_on_device = doc.on(dev);
  const Tensor& doc_d = pass.doc_on_device;
  Tensor x = Tensor::empty({T, c.hidden_size}, DType::F32, dev);
  ops::embedding(weights.embedding(), ids.on(dev), x);
  const Tensor positions = part ? part->positions() : positions_of(doc_d);
  const RopeParams rope = compute_rope_params(c, dev);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    DecoderLayerSaved saved;
    qwen3_decoder_layer(c, weights.layer(l), rope, positions, doc_d, nullptr, l, x, nullptr, &saved, part);
    // The dense LSE per query head. CUDA's teacher attention is the gated kernel with logβ ≡ 0
    // and keeps it, as does a part's; the CPU's plain attention does not, so there it is the
    // attention again.
    Tensor lse = saved.lse;
    if (lse.numel() == 0) {
      Tensor out = Tensor::empty({T, H, hd}, saved.q.dtype(), dev);
      lse = Tensor::empty({T, H}, DType::F32, dev);
      ops::gated_attention(saved.q, saved.k, saved.v, Tensor::zeros({T, K}, DType::F32, dev), doc_d, scale, out,
                           lse);
    }
    const Tensor log_m =
        f32(part ? part->future_attention_target(f32(saved.q), f32(saved.k), lse, doc_d, s.window, scale)
                 : future_attention_target(f32(saved.q), f32(saved.k), lse, doc_d, s.window, scale))
            .on(Device::CPU);
    const Tensor k_host = f32(saved.k).on(Device::CPU), v_host = f32(saved.v).on(Device::CPU);
    pass.log_m.push_back(log_m);
    pass.x.emplace_back();
    pass.decisions.emplace_back();
    for (int64_t kv = 0; kv < K; ++kv) {
      Tensor xk = Tensor::empty({T, 2 * hd}, DType::F32);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t e = 0; e < hd; ++e) {
          xk.data<float>()[t * 2 * hd + e] = k_host.data<float>()[(t * K + kv) * hd + e];
          xk.data<float>()[t * 2 * hd + hd + e] = v_host.data<float>()[(t * K + kv) * hd + e];
        }
      pass.x.back().push_back(xk);
    }
  }
  if (!part) add_decisions(pass, s, target_log_gamma);
  return pass;
}

void add_decisions(TeacherPass& pass, const StepSettings& s, const std::vector<std::vector<double>>* target_log_gamma) {
  RETAIN_CHECK(!s.effective_cutoff || target_log_gamma, "kvpop::add_decisions: effective targets need log γ");
  const int64_t T = pass.doc.numel();
  pass.decisions.resize(pass.x.size());
  for (size_t l = 0; l < pass.x.size(); ++l) {
    pass.decisions[l].resize(pass.x[l].size());
    for (size_t kv = 0; kv < pass.x[l].size(); ++kv) {
      if (pass.x[l][kv].numel() == 0) continue;
      TargetRule rule;
      if (s.effective_cutoff) rule = {true, target_log_gamma->at(l).at(kv), s.decay.every};
      const auto k = static_cast<int64_t>(kv);
      std::vector<Decision>& ds = pass.decisions[l][kv];
      ds = select_decisions(pass.log_m[l].rows(k, k + 1).reshape({T}), pass.doc, s.window, s.sinks, s.topk, rule);
      for (const Decision& dc : ds) pass.margin_sum += dc.margin;
      pass.num_decisions += static_cast<int64_t>(ds.size());
    }
  }
}

double scorer_step(const TeacherPass& pass, const std::vector<std::vector<HeadParams>>& params, const StepSettings& s,
                   double margin_scale, double grad_scale, std::vector<std::vector<HeadParams>>& grads,
                   int64_t* agreed) {
  RETAIN_CHECK(params.size() == pass.x.size(), "kvpop::scorer_step: {} layers of parameters for {} layers",
               params.size(), pass.x.size());
  grads.resize(params.size());
  double loss = 0;
  for (size_t l = 0; l < params.size(); ++l) {
    RETAIN_CHECK(params[l].size() == pass.x[l].size(), "kvpop::scorer_step: layer {} has {} heads of parameters, not {}",
                 l, params[l].size(), pass.x[l].size());
    grads[l].resize(params[l].size());
    for (size_t kv = 0; kv < params[l].size(); ++kv) {
      if (pass.x[l][kv].numel() == 0) continue;  // another rank's head (context parallelism)
      const HeadParams& p = params[l][kv];
      const std::vector<Decision>& ds = pass.decisions[l][kv];
      const Projected P = project(pass.x[l][kv], p);
      // The mLSTM (the O(T·d·r) part, float64 on both devices) runs where the teacher ran; the
      // projections, the pairwise loss and the accumulation stay on the host (small).
      const Projected P_run = projected_to(P, pass.device);
      const Tensor w_o = p.w_o.on(pass.device), b_o = p.b_o.on(pass.device);
      const Tensor score = mlstm_scores(P_run, pass.doc_on_device, s.window, w_o, b_o).on(Device::CPU);
      loss += grad_scale * pair_loss(score, p.theta, ds, margin_scale, s.tau, s.decay);
      if (agreed) {
        // ŝ_new(q) − ŝ_b(q) = score[t_new] − score[b] + (⌊(q − t_new)/n⌋ − ⌊(q − b)/n⌋)·log γ
        const double lg = log_gamma(p.theta.data<float>()[0], s.decay);
        const float* sc = score.data<float>();
        const int64_t n = s.decay.every;
        for (const Decision& dc : ds) {
          const double diff = static_cast<double>(sc[dc.t_new]) - sc[dc.b] +
                              static_cast<double>(decay_steps(dc.q, dc.t_new, n) - decay_steps(dc.q, dc.b, n)) * lg;
          if ((dc.y > 0 && diff > 0) || (dc.y < 0 && diff < 0)) ++*agreed;
        }
      }
      Tensor dscore, dtheta, dw_o, db_o;
      pair_loss_backward(score, p.theta, ds, margin_scale, s.tau, grad_scale, dscore, dtheta, s.decay);
      const Projected dP_run =
          mlstm_scores_backward(P_run, pass.doc_on_device, s.window, w_o, b_o, dscore.on(pass.device), dw_o, db_o);
      const Projected dP = projected_to(dP_run, Device::CPU);
      dw_o = dw_o.on(Device::CPU), db_o = db_o.on(Device::CPU);
      // b_o is added to every score, so it cancels in each ŝ_new − ŝ_b: its gradient is exactly 0.
      // The summed ±dscore leaves float rounding (~1e-9), which AdamW would normalize into
      // lr-sized random steps; the exact value is used instead.
      db_o.data<float>()[0] = 0.0f;
      HeadParams g;
      project_backward(pass.x[l][kv], p, dP, g);
      HeadParams& acc = grads[l][kv];
      for (auto [out, in] : {std::pair{&acc.W_q, &g.W_q}, std::pair{&acc.W_k, &g.W_k}, std::pair{&acc.W_v, &g.W_v},
                             std::pair{&acc.w_i, &g.w_i}, std::pair{&acc.w_f, &g.w_f}, std::pair{&acc.b_i, &g.b_i},
                             std::pair{&acc.b_f, &g.b_f}, std::pair{&acc.w_o, &dw_o}, std::pair{&acc.b_o, &db_o},
                             std::pair{&acc.theta, &dtheta}})
        add_into(*out, *in);
    }
  }
  return loss;
}

}  // namespace retain::kvpop
