#include "model/infer/decoder.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include <omp.h>

#include "kernels/kv_attention.h"
#include "kernels/ops.h"
#include "model/qwen3.h"
#include "model/rope_params.h"

namespace retain::infer {

ResidentWeightProvider::ResidentWeightProvider(std::shared_ptr<const Qwen3Checkpoint> ckpt)
    : ckpt_(ckpt), local_(ckpt) {
  for (int64_t l = 0; l < ckpt_->config().num_hidden_layers; ++l) {
    LayerWeights w = local_.layer(l);
    for (Tensor* t : layer_fields(w)) *t = t->clone();  // own a copy: the next layer() call replaces the local one
    layers_.push_back(std::move(w));
  }
  local_.lm_head();  // converted now, not on first use: after construction every read is const (threads share it)
}

namespace {

// kvpop's window and sinks are the scorers'; oracle-m's those its targets were made with.
PolicyOptions with_scorers(PolicyOptions p, const kvpop::Scorers* scorers, const OracleScores* oracle) {
  if (p.kind == PolicyKind::oracle_m) {
    if (!oracle)
      fail("--policy oracle-m ranks tokens by the future attention of the whole sequence: only teacher-forced "
           "evaluation (retain-eval) can run it");
    p.window = oracle->window;
    p.sinks = oracle->sinks;
    p.decay_every = oracle->decay_every;  // the rank keys' q mod n correction, as kvpop's below
    p.log_gamma.clear();
    if (p.decay_every > 1)
      for (const auto& layer : oracle->log_gamma)
        for (double lg : layer) p.log_gamma.push_back(static_cast<float>(lg));
    return p;
  }
  if (p.kind != PolicyKind::kvpop) return p;
  if (!scorers) fail("--policy kvpop ranks tokens by KVPOP scorers: give --gates FILE (a kvpop scorer file)");
  if (!scorers->geometry()) fail("--policy kvpop: the scorers record no window/sinks/topk");
  p.window = scorers->geometry()->window;
  p.sinks = scorers->geometry()->sinks;
  p.decay_every = scorers->decay().every;
  p.log_gamma.clear();
  if (p.decay_every > 1)  // the same float32 log γ the rank keys were made with (kvpop_state.cpp, in float64)
    for (const auto& layer : scorers->head_values())
      for (const kvpop::HeadParams& h : layer)
        p.log_gamma.push_back(static_cast<float>(kvpop::log_gamma(h.theta.data<float>()[0], scorers->decay())));
  return p;
}

}  // namespace

Decoder::Decoder(WeightProvider& weights, const gates::RetentionGates* gates, const PolicyOptions& policy,
                 const kvpop::Scorers* scorers, const OracleScores* oracle)
    : w_(weights), gates_(gates), policy_(make_policy(with_scorers(policy, scorers, oracle))) {
  const Qwen3Config& c = w_.config();
  if (policy.kind == PolicyKind::kvpop) {
    const kvpop::ScorerDims want = kvpop::Scorers::dims_for(c), got = scorers->dims();
    if (got.layers != want.layers || got.kv_heads != want.kv_heads || got.head_dim != want.head_dim)
      fail("kvpop scorers for {} layers × {} KV heads × head_dim {}, the model has {} × {} × {}", got.layers,
           got.kv_heads, got.head_dim, want.layers, want.kv_heads, want.head_dim);
    kvpop_ = std::make_unique<KvpopState>(*scorers);
  }
  if (policy.kind == PolicyKind::oracle_m) {
    oracle_ = oracle;
    const int64_t L = static_cast<int64_t>(oracle_->log_m.size());
    if (L != c.num_hidden_layers || oracle_->log_m.front().dim(0) != c.num_key_value_heads)
      fail("oracle-m targets for {} layers × {} KV heads, the model has {} × {}", L, oracle_->log_m.front().dim(0),
           c.num_hidden_layers, c.num_key_value_heads);
  }
  if (gates_) check_gates_fit(c, gates_->dims());
  if (policy_needs_gates(policy.kind) && !gates_)
    fail("--policy {} ranks tokens by their retention gates: give --gates FILE", policy_name(policy.kind));
  rope_ = compute_rope_params(c);
  cache_ = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim);
  if (gates_) lb_hist_.resize(static_cast<size_t>(c.num_hidden_layers));
}

namespace {

// A decoding step of a small model is a few microseconds of work per op: waking OpenMP's
// threads for each costs more than the op (and far more on a loaded machine, where a parked
// thread may miss its time slice: 60 ms instead of 0.1 ms per token with 2 threads on 2 busy
// cores). Below ~4 MFLOP per projection the step runs on the calling thread alone.
class ThreadScope {
 public:
  explicit ThreadScope(int64_t flops) : saved_(omp_get_max_threads()) {
    if (flops < (int64_t{1} << 22)) omp_set_num_threads(1);
  }
  ~ThreadScope() { omp_set_num_threads(saved_); }

 private:
  int saved_;
};

}  // namespace

Tensor Decoder::feed(std::span<const int32_t> ids, bool all_logits) {
  const auto start = std::chrono::steady_clock::now();
  const Qwen3Config& c = w_.config();
  const int64_t T = static_cast<int64_t>(ids.size()), D = c.hidden_size, H = c.num_attention_heads,
                K = c.num_key_value_heads, d = c.head_dim, I = c.intermediate_size;
  ThreadScope threads(2 * T * D * std::max({D, I, H * d}));
  RETAIN_CHECK(T > 0, "Decoder::feed: no tokens");
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const RopeParams& rope = rope_;

  Tensor id_t = Tensor::empty({T}, DType::I32), pos = Tensor::empty({T}, DType::I32);
  for (int64_t t = 0; t < T; ++t) {
    if (ids[t] < 0 || ids[t] >= c.vocab_size)
      fail("token id {} is outside the vocabulary [0, {})", ids[t], c.vocab_size);
    id_t.data<int32_t>()[t] = ids[t];
    pos.data<int32_t>()[t] = static_cast<int32_t>(seen_ + t);
  }
  Tensor x = Tensor::empty({T, D}, DType::F32);
  ops::embedding(w_.embedding(), id_t, x);
  // The layer of model/qwen3.cpp (qwen3_decoder_layer) with the attention over the cache in
  // place of the full causal attention; test_decoder checks that the full policy gives
  // retain-forward's logits.
  Tensor h = Tensor::empty({T, D}, DType::F32), q = Tensor::empty({T, H * d}, DType::F32),
         k = Tensor::empty({T, K * d}, DType::F32), v = Tensor::empty({T, K * d}, DType::F32),
         attn = Tensor::empty({T, H, d}, DType::F32), proj = Tensor::empty({T, D}, DType::F32);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& w = w_.layer(l);
    ops::rmsnorm(x, w.input_norm, eps, h);
    ops::linear(h, w.q_proj, q);
    ops::linear(h, w.k_proj, k);
    ops::linear(h, w.v_proj, v);
    Tensor qh = q.reshape({T * H, d}), kh = k.reshape({T * K, d});
    ops::rmsnorm(qh, w.q_norm, eps, qh);
    ops::rmsnorm(kh, w.k_norm, eps, kh);
    Tensor q3 = q.reshape({T, H, d}), k3 = k.reshape({T, K, d}), v3 = v.reshape({T, K, d});
    ops::rope(q3, pos, rope.inv_freq, rope.attention_factor);
    ops::rope(k3, pos, rope.inv_freq, rope.attention_factor);
    Tensor log_beta;
    if (gates_) {
      log_beta = gates_->forward(l, gates_->input_of(h, k3, v3));  // h, or [k ‖ v] after RoPE
      const float* lb = log_beta.data<float>();
      lb_hist_[static_cast<size_t>(l)].insert(lb_hist_[static_cast<size_t>(l)].end(), lb, lb + T * K);
    }
    if (kvpop_ || oracle_) {  // no rank key until scored
      log_beta = Tensor::empty({T, K}, DType::F32);
      std::fill_n(log_beta.data<float>(), T * K, std::nanf(""));
    }
    cache_.append(l, k3, v3, pos, gates_ || kvpop_ || oracle_ ? &log_beta : nullptr);
    KVCache::Layer& cl = cache_.layer(l);
    if (kvpop_) {
      // Tokens leaving the window get their rank key in their entry's logβ slot.
      const auto keys = kvpop_->feed(l, k3, v3);
      for (int64_t hh = 0; hh < K; ++hh) {
        const int32_t* p = cache_.positions(l, hh);
        float* slot = cl.log_beta.data<float>() + hh * cl.log_beta.dim(1);
        for (const auto& [u, key] : keys[static_cast<size_t>(hh)]) {
          const int64_t n = cache_.size(l, hh);
          int64_t j = n - 1;  // recent entries sit near the end; eviction moves only survivors into holes
          while (j >= 0 && p[j] != u) --j;
          RETAIN_CHECK(j >= 0, "kvpop: position {} left the window after it was evicted", u);
          slot[j] = key;
        }
      }
    }
    if (oracle_) {
      // The same moment as kvpop: feeding position t, token u = t − w + 1 leaves the window.
      for (int64_t hh = 0; hh < K; ++hh) {
        const int32_t* p = cache_.positions(l, hh);
        float* slot = cl.log_beta.data<float>() + hh * cl.log_beta.dim(1);
        for (int64_t t = seen_; t < seen_ + T; ++t) {
          const int64_t u = t - oracle_->window + 1;
          if (u < 0) continue;
          int64_t j = cache_.size(l, hh) - 1;
          while (j >= 0 && p[j] != u) --j;
          RETAIN_CHECK(j >= 0, "oracle-m: position {} left the window after it was evicted", u);
          slot[j] = oracle_->rank_key(l, hh, u);
        }
      }
    }
    ops::kv_attention(q3, pos, cl.keys, cl.values, cl.pos, cl.lens, scale, attn,
                      policy_->needs_attention_sums() ? &cl.attn_sum : nullptr);
    ops::linear(attn.reshape({T, H * d}), w.o_proj, proj);
    ops::add_inplace(x, proj);
    qwen3_mlp(c, w, x);
  }
  seen_ += T;
  Tensor last = all_logits ? x : x.rows(T - 1, T).clone();
  ops::rmsnorm(last, w_.final_norm(), eps, last);
  Tensor logits = Tensor::empty({last.dim(0), c.vocab_size}, DType::F32);
  ops::linear(last, w_.lm_head(), logits);
  // A model with NaN or Inf weights (or gates) gives non-finite logits: nothing evaluated or
  // generated from them means anything, so it stops here instead of writing "nll": null.
  const float* lg = logits.data<float>();
  for (int64_t i = 0; i < logits.numel(); ++i)
    if (!std::isfinite(lg[i]))
      fail("the model's logits are not finite ({} at token {} of position {}): its weights or gates hold NaN or Inf",
           lg[i], i % c.vocab_size, seen_ - last.dim(0) + i / c.vocab_size);

  if (before_evict_) before_evict_(cache_, seen_);
  const auto ev = std::chrono::steady_clock::now();
  policy_->evict(cache_, seen_);
  const auto end = std::chrono::steady_clock::now();
  evict_s_ += std::chrono::duration<double>(end - ev).count();
  feed_s_ += std::chrono::duration<double>(end - start).count();
  return logits;
}

Tensor Decoder::prefill(std::span<const int32_t> ids, int64_t chunk) {
  RETAIN_CHECK(!ids.empty(), "Decoder::prefill: empty prompt");
  const size_t step = chunk > 0 ? static_cast<size_t>(chunk) : ids.size();
  Tensor logits;
  for (size_t at = 0; at < ids.size(); at += step)
    logits = feed(ids.subspan(at, std::min(step, ids.size() - at)), false);
  return logits;
}

int32_t pick_token(const float* logits, int64_t V, double temperature, std::mt19937_64& rng) {
  if (temperature <= 0) return static_cast<int32_t>(std::max_element(logits, logits + V) - logits);
  const float mx = *std::max_element(logits, logits + V);
  std::vector<double> p(static_cast<size_t>(V));
  double z = 0;
  for (int64_t i = 0; i < V; ++i) z += p[i] = std::exp((logits[i] - mx) / temperature);
  // Inverse-CDF with a 53-bit uniform: independent of the standard library's distributions,
  // so a seed gives the same tokens everywhere.
  const double r = static_cast<double>(rng() >> 11) * 0x1.0p-53 * z;
  double acc = 0;
  for (int64_t i = 0; i < V; ++i)
    if ((acc += p[i]) > r) return static_cast<int32_t>(i);
  return static_cast<int32_t>(V - 1);
}

}  // namespace retain::infer
