// retain-eval's oracle-m policy (model/infer/oracle.h): kvpop's cache ranked by the KVPOP
// training target log m of the whole teacher-forced sequence. Checked against a float64 brute
// force written here: the dense model's q, k per layer (the forward is checked against
// transformers elsewhere), explicit causal softmax rows p_{d→t}, m_t = max over the group's query
// heads of Σ_{d ≥ t+w} p_{d→t}, and a from-scratch simulation of the whole bounded cache (after
// each forward: add the fed tokens; at B + buffer entries keep the sinks, the window and the best
// others by ŝ_i(q) = log m_i + (q − i)·log γ). No code of the trainer's target pass, the policy or
// the decoder is shared with the reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <set>

#include "kernels/kvpop.h"
#include "kernels/ops.h"
#include "model/infer/decoder.h"
#include "model/infer/oracle.h"
#include "model/kvpop/scorers.h"
#include "model/qwen3.h"
#include "model/rope_params.h"

namespace retain::infer {
namespace {

const std::string kModel = std::string(RETAIN_FIXTURES_DIR) + "/trainer/model";
const std::string kScorers = std::string(RETAIN_FIXTURES_DIR) + "/kvpop/step/scorers.safetensors";
constexpr int64_t kSinks = 2, kWindow = 6;  // the fixture scorers' geometry (topk 3)

struct Fixture {
  std::shared_ptr<const Qwen3Checkpoint> ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(kModel));
  ResidentWeightProvider weights{ckpt};
  kvpop::Scorers scorers = kvpop::Scorers::load(kScorers, ckpt->config());
};

std::vector<int32_t> random_ids(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 256);
  return ids;
}

// log m [L][K][T] in float64 from explicit attention rows; −inf where no d ≥ t + w exists.
std::vector<std::vector<std::vector<double>>> brute_force_log_m(Fixture& s, const std::vector<int32_t>& ids) {
  const Qwen3Config& c = s.ckpt->config();
  const int64_t T = static_cast<int64_t>(ids.size()), H = c.num_attention_heads, K = c.num_key_value_heads,
                d = c.head_dim, G = H / K;
  const Tensor doc = Tensor::zeros({T}, DType::I32);
  const RopeParams rope = compute_rope_params(c);
  Tensor x = Tensor::empty({T, c.hidden_size}, DType::F32);
  ops::embedding(s.weights.embedding(), Tensor::from_vector(ids, {T}), x);
  std::vector<std::vector<std::vector<double>>> out(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    DecoderLayerSaved saved;
    qwen3_decoder_layer(c, s.weights.layer(l), rope, positions_of(doc), doc, nullptr, l, x, nullptr, &saved);
    const float* q = saved.q.data<float>();
    const float* k = saved.k.data<float>();
    out[l].assign(static_cast<size_t>(K), std::vector<double>(static_cast<size_t>(T), -INFINITY));
    for (int64_t kv = 0; kv < K; ++kv)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kv * G + g;
        std::vector<double> mass(static_cast<size_t>(T), 0.0);
        for (int64_t dq = 0; dq < T; ++dq) {
          std::vector<double> logit(static_cast<size_t>(dq + 1));
          double mx = -INFINITY, z = 0;
          for (int64_t t = 0; t <= dq; ++t) {
            double dot = 0;
            for (int64_t e = 0; e < d; ++e) dot += double(q[(dq * H + h) * d + e]) * double(k[(t * K + kv) * d + e]);
            logit[t] = dot / std::sqrt(double(d));
            mx = std::max(mx, logit[t]);
          }
          for (int64_t t = 0; t <= dq; ++t) z += std::exp(logit[t] - mx);
          for (int64_t t = 0; t + kWindow <= dq; ++t) mass[t] += std::exp(logit[t] - mx) / z;
        }
        for (int64_t t = 0; t + kWindow < T; ++t) out[l][kv][t] = std::max(out[l][kv][t], std::log(mass[t]));
      }
  }
  return out;
}

TEST(OraclePolicy, TargetsEqualAFloat64BruteForce) {
  Fixture s;
  const std::vector<int32_t> ids = random_ids(70, 3);
  const auto want = brute_force_log_m(s, ids);
  const OracleScores o = oracle_scores(s.weights, ids, s.scorers);
  ASSERT_EQ(o.window, kWindow);
  ASSERT_EQ(o.sinks, kSinks);
  ASSERT_EQ(o.length(), 70);
  double worst = 0;
  for (size_t l = 0; l < want.size(); ++l)
    for (size_t kv = 0; kv < want[l].size(); ++kv)
      for (size_t t = 0; t < ids.size(); ++t) {
        const double got = o.log_m[l].data<float>()[kv * ids.size() + t], w = want[l][kv][t];
        if (std::isinf(w)) {
          EXPECT_TRUE(std::isinf(got) && got < 0) << l << " " << kv << " " << t;
          EXPECT_GE(t + kWindow, ids.size());  // only the last w tokens have no target
          EXPECT_EQ(o.rank_key(int64_t(l), int64_t(kv), int64_t(t)), std::numeric_limits<float>::lowest());
        } else {
          worst = std::max(worst, std::abs(got - w));
        }
      }
  EXPECT_LE(worst, 1e-4);
  RecordProperty("worst_log_m_error", std::to_string(worst));
  // The decay is the scorers' own, per layer and KV head.
  const auto heads = s.scorers.head_values();
  for (size_t l = 0; l < heads.size(); ++l)
    for (size_t kv = 0; kv < heads[l].size(); ++kv)
      EXPECT_EQ(o.log_gamma[l][kv], kvpop::log_gamma(heads[l][kv].theta.data<float>()[0]));
}

// Every (layer, KV head)'s kept positions after every forward, from the brute-force targets.
TEST(OraclePolicy, EveryEvictionEqualsAFromScratchSimulation) {  // 24 settings
  Fixture s;
  const int64_t T = 90;
  const std::vector<int32_t> ids = random_ids(T, 5);
  const auto log_m = brute_force_log_m(s, ids);
  const OracleScores learned = oracle_scores(s.weights, ids, s.scorers);
  // The fixture's decays move ŝ by < 0.1 over 90 tokens; a strong one (0.05 per token, differing
  // per head) makes the age term decide many evictions too.
  OracleScores strong = learned;
  for (size_t l = 0; l < strong.log_gamma.size(); ++l)
    for (size_t h = 0; h < strong.log_gamma[l].size(); ++h) strong.log_gamma[l][h] = -0.05 * double(1 + l + 2 * h);
  // The same in steps of n = 3 (retain-train --decay-every 3): ⌊(q − i)/3⌋·log γ.
  OracleScores stepped = strong;
  stepped.decay_every = 3;
  int64_t evicted = 0;
  for (const OracleScores* o : std::initializer_list<const OracleScores*>{&learned, &strong, &stepped})
  for (const int64_t budget : {int64_t{9}, int64_t{14}})
    for (const int64_t buffer : {int64_t{1}, int64_t{3}})
      for (const int64_t chunk : {int64_t{1}, int64_t{7}}) {
        SCOPED_TRACE(testing::Message() << (o == &stepped ? "strong decay every 3" : o == &strong ? "strong decay" : "learned decay") << " budget " << budget
                                        << " buffer " << buffer << " chunk " << chunk);
        const OracleScores& oracle = *o;
        Decoder dec(s.weights, nullptr, {PolicyKind::oracle_m, budget, buffer, 4, 0}, &s.scorers, &oracle);
        std::vector<std::vector<std::set<int32_t>>> kept(2, std::vector<std::set<int32_t>>(2));
        // Teacher-forced: every token but the last is fed (the last is only predicted).
        for (int64_t at = 0; at < T - 1; at += chunk) {
          const int64_t m = std::min(chunk, T - 1 - at);
          dec.feed(std::span<const int32_t>(ids).subspan(static_cast<size_t>(at), static_cast<size_t>(m)));
          const int64_t q = at + m;  // tokens seen = the next query's position
          for (int64_t l = 0; l < 2; ++l)
            for (int64_t h = 0; h < 2; ++h) {
              std::set<int32_t>& keep = kept[l][h];
              for (int64_t t = at; t < at + m; ++t) keep.insert(static_cast<int32_t>(t));
              if (static_cast<int64_t>(keep.size()) >= budget + buffer) {
                std::set<int32_t> next;
                std::vector<std::pair<double, int32_t>> ranked;
                for (int32_t i : keep) {
                  if (i < kSinks || i > q - kWindow) next.insert(i);
                  else ranked.emplace_back(log_m[l][h][i] + double((q - i) / oracle.decay_every) * oracle.log_gamma[l][h], i);
                }
                std::sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) {
                  return a.first != b.first ? a.first > b.first : a.second > b.second;
                });
                for (size_t r = 0; static_cast<int64_t>(next.size()) < budget && r < ranked.size(); ++r)
                  next.insert(ranked[r].second);
                evicted += static_cast<int64_t>(keep.size() - next.size());
                keep = next;
              }
              const std::vector<int32_t> got = dec.cache().kept_positions(l, h);
              ASSERT_EQ(std::set<int32_t>(got.begin(), got.end()), keep) << "layer " << l << " head " << h << " after " << q;
            }
        }
      }
  EXPECT_GT(evicted, 3000);
}

TEST(OraclePolicy, MisuseIsOneLineError) {
  Fixture s;
  auto error_of = [&](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  const std::vector<int32_t> ids = random_ids(20, 1);
  const OracleScores oracle = oracle_scores(s.weights, ids, s.scorers);
  // No targets: generation (and anything not teacher-forced) cannot run it.
  EXPECT_NE(error_of([&] { Decoder(s.weights, nullptr, {PolicyKind::oracle_m, 12, 1, 4, 0}, &s.scorers); })
                .find("only teacher-forced evaluation (retain-eval) can run it"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { Decoder(s.weights, nullptr, {PolicyKind::oracle_m, 8, 1, 4, 0}, &s.scorers, &oracle); }),
            "--budget 8 is below the minimum 9 of policy oracle-m (2 sinks + a window of 6 + 1 top-k entry, from the "
            "scorers)");
  // Fed past the sequence the targets were computed for.
  Decoder dec(s.weights, nullptr, {PolicyKind::oracle_m, 12, 1, 4, 0}, &s.scorers, &oracle);
  dec.prefill(ids);
  const int32_t more[6] = {1, 2, 3, 4, 5, 6};
  const std::string e = error_of([&] { dec.feed(more); });
  EXPECT_NE(e.find("beyond the 20 tokens of the sequence its targets were computed for"), std::string::npos) << e;
  EXPECT_EQ(std::count(e.begin(), e.end(), '\n'), 0);
  EXPECT_EQ(parse_policy("oracle-m"), PolicyKind::oracle_m);
  EXPECT_EQ(policy_name(PolicyKind::oracle_m), "oracle-m");
}

}  // namespace
}  // namespace retain::infer
