// The bounded-KV decoder on tiny random models: the full policy equals the full forward
// (model/qwen3.cpp, what retain-forward runs); every policy with a budget ≥ the sequence equals
// full; the kept sets after every forward equal a brute-force simulation of DESIGN §8's
// schedule from the logβ the decoder saw; bad combinations fail with one line.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "model/infer/decoder.h"
#include "model/qwen3.h"
#include "model/student.h"
#include "model/tiny.h"

using namespace retain;
using namespace retain::infer;
namespace fs = std::filesystem;

namespace {

struct Tiny {
  std::shared_ptr<const Qwen3Checkpoint> ckpt;
  gates::RetentionGates gates;
};

// linear: the linear trimkv gate (G = 0) instead of the MLP (G = 16); kv: gates reading [k ‖ v].
const Tiny& tiny(gates::GateKind kind, bool linear = false, bool kv = false) {
  static std::map<std::tuple<gates::GateKind, bool, bool>, Tiny> cache;
  auto it = cache.find({kind, linear, kv});
  if (it != cache.end()) return it->second;
  const fs::path dir = fs::path(::testing::TempDir()) /
                       (std::string("retain_decoder_") + std::string(gates::gate_kind_name(kind)) +
                        (linear ? "_linear" : "") + (kv ? "_kv." : ".") + std::to_string(::getpid()));
  TinyModelOptions opt;
  opt.layers = 2, opt.heads = 4, opt.kv_heads = 2, opt.head_dim = 16, opt.hidden = 32, opt.intermediate = 64;
  opt.vocab = 300, opt.seed = 5, opt.gate_kind = kind, opt.gate_bias_init = 1.0;
  if (linear) opt.gate_hidden = 0;
  if (kv) opt.gate_input = gates::GateInput::kv;
  make_tiny_model(dir.string(), opt);
  Tiny t;
  t.ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(dir.string()));
  t.gates = gates::RetentionGates::load((dir / "gates.safetensors").string(), t.ckpt->config());
  fs::remove_all(dir);  // the weights stay mapped; nothing is left in the temp folder
  return cache.emplace(std::tuple{kind, linear, kv}, std::move(t)).first->second;
}

std::vector<int32_t> random_ids(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& x : ids) x = static_cast<int32_t>(rng() % 300);
  return ids;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  double m = 0;
  for (int64_t i = 0; i < std::min(a.numel(), b.numel()); ++i)
    m = std::max(m, static_cast<double>(std::fabs(a.data<float>()[i] - b.data<float>()[i])));
  return m;
}

PolicyOptions policy(PolicyKind kind, int64_t budget) {
  PolicyOptions o;
  o.kind = kind, o.budget = budget;
  return o;
}

}  // namespace

TEST(Decoder, FullPolicyEqualsFullForward) {
  const Tiny& t = tiny(gates::GateKind::trimkv);
  ResidentWeightProvider w(t.ckpt);
  const std::vector<int32_t> ids = random_ids(37, 1);
  Tensor ids_t = Tensor::from_vector(ids, {37}), doc = Tensor::zeros({37}, DType::I32);
  LocalWeightProvider lw(t.ckpt);
  const Tensor want = qwen3_forward(lw, ids_t, doc);  // the teacher: what retain-forward writes
  const int64_t V = want.dim(1);
  // Whole prompt at once, in chunks of 5, and token by token.
  for (int64_t chunk : {37, 5, 1}) {
    Decoder dec(w, &t.gates, policy(PolicyKind::full, 0));
    for (int64_t at = 0; at < 37; at += chunk) {
      const int64_t n = std::min<int64_t>(chunk, 37 - at);
      const Tensor got = dec.feed(std::span(ids).subspan(static_cast<size_t>(at), static_cast<size_t>(n)), true);
      EXPECT_LT(max_abs_diff(got, want.rows(at, at + n)), 2e-5) << "chunk " << chunk << " at " << at;
    }
    EXPECT_EQ(dec.cache().total(), 37 * 2 * 2);
    EXPECT_EQ(V, 300);
  }
}

// The logβ the decoder ranks by is the training forward's (student_forward, whose loss and gradients
// tests/trainer/test_dump_grads.cpp checks against float64 autograd) for every gate input: h, the
// linear gate, and [k ‖ v] after RoPE at the token's position — whole prompt, chunks of 5, token by
// token. Layer 0 only: from layer 1 on the inputs differ by design (training biases attention by
// (t − i)·logβ_i, the decoder attends its cache without the bias).
TEST(Decoder, LogBetaIsTheTrainingForwardsForEveryGate) {
  for (auto [kind, linear, kv] : {std::tuple{gates::GateKind::trimkv, false, false},
                                  std::tuple{gates::GateKind::trimkv, true, false},
                                  std::tuple{gates::GateKind::dbtrimkv, false, true}}) {
    const Tiny& t = tiny(kind, linear, kv);
    ResidentWeightProvider w(t.ckpt);
    const std::vector<int32_t> ids = random_ids(23, 4);
    const StudentPass pass =
        student_forward(w, t.gates, Tensor::from_vector(ids, {23}), Tensor::zeros({23}, DType::I32));
    for (int64_t chunk : {23, 5, 1}) {
      Decoder dec(w, &t.gates, policy(PolicyKind::full, 0));
      for (int64_t at = 0; at < 23; at += chunk)
        dec.feed(std::span(ids).subspan(static_cast<size_t>(at), static_cast<size_t>(std::min<int64_t>(chunk, 23 - at))));
      for (int64_t i = 0; i < 23 * 2; ++i)
        EXPECT_NEAR(dec.log_beta_history()[0][static_cast<size_t>(i)], pass.log_beta.data<float>()[i], 2e-6)
            << "linear " << linear << " kv " << kv << " chunk " << chunk << " entry " << i;
    }
  }
}

TEST(Decoder, BudgetAtLeastSequenceEqualsFull) {
  for (auto kind : {gates::GateKind::trimkv, gates::GateKind::dbtrimkv}) {
    const Tiny& t = tiny(kind);
    ResidentWeightProvider w(t.ckpt);
    const std::vector<int32_t> ids = random_ids(30, 2);
    Decoder full(w, &t.gates, policy(PolicyKind::full, 0));
    std::vector<Tensor> want;
    want.push_back(full.feed(std::span(ids).subspan(0, 10), true));
    for (size_t i = 10; i < ids.size(); ++i) want.push_back(full.feed(std::span(ids).subspan(i, 1), true));
    for (PolicyKind p : {PolicyKind::window, PolicyKind::h2o, PolicyKind::trimkv, PolicyKind::dbtrimkv}) {
      Decoder dec(w, &t.gates, policy(p, 30));
      EXPECT_EQ(max_abs_diff(dec.feed(std::span(ids).subspan(0, 10), true), want[0]), 0.0);
      for (size_t i = 10; i < ids.size(); ++i)
        ASSERT_EQ(max_abs_diff(dec.feed(std::span(ids).subspan(i, 1), true), want[i - 9]), 0.0)
            << policy_name(p) << " token " << i;
      EXPECT_EQ(dec.cache().total(), 30 * 4) << policy_name(p);
    }
  }
}

namespace {

// DESIGN §8's schedule, simulated with sets and the brute-force "fewer than k entries beat it"
// rule, from the logβ the decoder computed for every token.
struct Simulation {
  PolicyOptions opt;
  int64_t L, K;
  std::vector<std::vector<int32_t>> kept;  // per stream (l·K + h), positions ascending

  void step(int64_t seen, int64_t fed, const Decoder& dec) {
    for (auto& s : kept)
      for (int64_t p = seen - fed; p < seen; ++p) s.push_back(static_cast<int32_t>(p));
    auto score = [&](int64_t stream, int32_t pos) {
      const int64_t l = stream / K, h = stream % K;
      const float lb = dec.log_beta_history()[static_cast<size_t>(l)][static_cast<size_t>(pos * K + h)];
      return trimkv_score(lb, seen + opt.lookahead, pos);
    };
    auto beats = [](float sa, int32_t pa, int64_t a, float sb, int32_t pb, int64_t b) {
      return sa > sb || (sa == sb && (pa > pb || (pa == pb && a < b)));
    };
    if (opt.kind == PolicyKind::dbtrimkv) {
      int64_t total = 0;
      for (auto& s : kept) total += static_cast<int64_t>(s.size());
      if (total < L * K * (opt.budget + opt.buffer)) return;
      std::vector<std::vector<int32_t>> next(kept.size());
      for (size_t a = 0; a < kept.size(); ++a)
        for (int32_t pa : kept[a]) {
          int64_t n = 0;
          for (size_t b = 0; b < kept.size(); ++b)
            for (int32_t pb : kept[b])
              if (beats(score(b, pb), pb, b, score(a, pa), pa, a)) ++n;
          if (n < L * K * opt.budget) next[a].push_back(pa);
        }
      kept = next;
      return;
    }
    for (size_t a = 0; a < kept.size(); ++a) {
      auto& s = kept[a];
      if (static_cast<int64_t>(s.size()) < opt.budget + opt.buffer) continue;
      std::vector<int32_t> next;
      const int64_t n = static_cast<int64_t>(s.size());
      for (int64_t j = 0; j < n; ++j) {
        if (opt.kind == PolicyKind::window) {
          if (j < opt.sinks || n - j <= opt.budget - opt.sinks) next.push_back(s[j]);
          continue;
        }
        int64_t beaten = 0;
        for (int32_t p : s)
          if (beats(score(a, p), p, 0, score(a, s[j]), s[j], 0)) ++beaten;
        if (beaten < opt.budget) next.push_back(s[j]);
      }
      s = next;
    }
  }
};

}  // namespace

TEST(Decoder, KeptSetsMatchBruteForceSchedule) {
  // trimkv, dbtrimkv, the linear trimkv gate (G = 0), and dbtrimkv gates reading [k ‖ v]
  for (auto [kind, linear, kv] : {std::tuple{gates::GateKind::trimkv, false, false},
                                  std::tuple{gates::GateKind::dbtrimkv, false, false},
                                  std::tuple{gates::GateKind::trimkv, true, false},
                                  std::tuple{gates::GateKind::dbtrimkv, false, true}}) {
    const Tiny& t = tiny(kind, linear, kv);
    ASSERT_EQ(t.gates.is_linear(), linear);
    ASSERT_EQ(t.gates.reads_kv(), kv);
    ResidentWeightProvider w(t.ckpt);
    const std::vector<int32_t> ids = random_ids(60, 3);
    for (PolicyKind p : {PolicyKind::window, PolicyKind::trimkv, PolicyKind::dbtrimkv})
      for (int64_t buffer : {1, 3})
        for (int64_t chunk : {0, 4}) {
          PolicyOptions o = policy(p, 7);
          o.buffer = buffer;
          Decoder dec(w, &t.gates, o);
          Simulation sim{o, 2, 2, std::vector<std::vector<int32_t>>(4)};
          // A 20-token prompt (whole or in chunks of 4), then one token at a time.
          const size_t step = chunk ? static_cast<size_t>(chunk) : 20;
          for (size_t at = 0; at < ids.size();) {
            const size_t n = at < 20 ? std::min(step, 20 - at) : 1;
            dec.feed(std::span(ids).subspan(at, n));
            at += n;
            sim.step(static_cast<int64_t>(at), static_cast<int64_t>(n), dec);
            for (int64_t s = 0; s < 4; ++s)
              ASSERT_EQ(dec.cache().kept_positions(s / 2, s % 2), sim.kept[s])
                  << policy_name(p) << " buffer " << buffer << " chunk " << chunk << " after " << at << " stream " << s;
          }
          int64_t most = 0;
          for (auto& s : sim.kept) most = std::max<int64_t>(most, static_cast<int64_t>(s.size()));
          if (p != PolicyKind::dbtrimkv) {
            EXPECT_LE(most, 7 + buffer - 1);
          }
        }
  }
}

// --lookahead a: trimkv and dbtrimkv rank by (q + a − i)·logβ_i (q = tokens seen); the kept sets
// match the brute-force schedule with that score, and a long lookahead keeps other tokens than
// the default a = 1 (so the option is seen to act).
TEST(Decoder, LookaheadKeptSetsMatchBruteForce) {
  for (auto kind : {gates::GateKind::trimkv, gates::GateKind::dbtrimkv}) {
    const Tiny& t = tiny(kind);
    ResidentWeightProvider w(t.ckpt);
    const std::vector<int32_t> ids = random_ids(60, 5);
    for (PolicyKind p : {PolicyKind::trimkv, PolicyKind::dbtrimkv}) {
      int differ = 0;
      for (int64_t lookahead : {0, 7, 100000}) {  // 100000: the ranking is by logβ alone
        PolicyOptions o = policy(p, 7);
        o.lookahead = lookahead;
        PolicyOptions o1 = policy(p, 7);
        Decoder dec(w, &t.gates, o), dec1(w, &t.gates, o1);
        Simulation sim{o, 2, 2, std::vector<std::vector<int32_t>>(4)};
        for (size_t at = 0; at < ids.size();) {
          const size_t n = at < 12 ? 12 : 1;
          dec.feed(std::span(ids).subspan(at, n));
          dec1.feed(std::span(ids).subspan(at, n));
          at += n;
          sim.step(static_cast<int64_t>(at), static_cast<int64_t>(n), dec);
          for (int64_t s = 0; s < 4; ++s) {
            ASSERT_EQ(dec.cache().kept_positions(s / 2, s % 2), sim.kept[s])
                << policy_name(p) << " lookahead " << lookahead << " after " << at << " stream " << s;
            if (dec.cache().kept_positions(s / 2, s % 2) != dec1.cache().kept_positions(s / 2, s % 2)) ++differ;
          }
        }
      }
      EXPECT_GT(differ, 0) << policy_name(p) << ": no lookahead changed what is kept";
    }
  }
  PolicyOptions bad = policy(PolicyKind::trimkv, 7);
  bad.lookahead = -1;
  EXPECT_THROW(make_policy(bad), Error);
}

TEST(Decoder, H2OKeepsRecentHalfAndBoundsTheCache) {
  const Tiny& t = tiny(gates::GateKind::trimkv);
  ResidentWeightProvider w(t.ckpt);
  const std::vector<int32_t> ids = random_ids(50, 4);
  Decoder dec(w, nullptr, policy(PolicyKind::h2o, 8));
  Decoder full(w, nullptr, policy(PolicyKind::full, 0));
  double diff = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    diff = std::max(diff, max_abs_diff(dec.feed(std::span(ids).subspan(i, 1)), full.feed(std::span(ids).subspan(i, 1))));
    for (int64_t s = 0; s < 4; ++s) {
      const auto kept = dec.cache().kept_positions(s / 2, s % 2);
      ASSERT_LE(kept.size(), 8u);
      for (int32_t r = 0; r < std::min<int32_t>(4, static_cast<int32_t>(i) + 1); ++r)
        EXPECT_TRUE(std::count(kept.begin(), kept.end(), static_cast<int32_t>(i) - r)) << "recent token missing";
    }
  }
  EXPECT_GT(diff, 1e-4);  // evictions change the output: the bounded cache is what attention reads
}

// H2O's kept sets depend on the attention the decoder accumulated: after every forward, the
// entries that survive eviction must be exactly those a brute force picks from the cache as it
// was just before (positions and accumulated attention of every entry), and the accumulated
// attention must add up: every query row of a KV head's group hands out probability 1.
TEST(Decoder, H2OKeptSetsMatchBruteForceFromTheAccumulatedAttention) {
  const Tiny& t = tiny(gates::GateKind::trimkv);
  ResidentWeightProvider w(t.ckpt);
  const std::vector<int32_t> ids = random_ids(70, 6);
  for (int64_t buffer : {1, 4}) {
    PolicyOptions o = policy(PolicyKind::h2o, 9);
    o.buffer = buffer;
    Decoder dec(w, nullptr, o);
    std::vector<std::vector<int32_t>> want(4);
    std::vector<double> evicted_mass(4, 0.0);
    dec.set_before_evict([&](const KVCache& c, int64_t) {
      for (int64_t s = 0; s < 4; ++s) {
        const int64_t l = s / 2, h = s % 2, n = c.size(l, h);
        const int32_t* pos = c.positions(l, h);
        const float* acc = c.attn_sum(l, h);
        std::vector<int32_t> keep;
        for (int64_t j = 0; j < n; ++j) {
          bool kept = n < o.budget + o.buffer;  // no eviction below B + buffer
          int64_t newer = 0;
          for (int64_t i = 0; i < n; ++i) newer += pos[i] > pos[j];
          kept = kept || newer < o.budget / 2;  // the recent half
          if (!kept) {
            int64_t beaten = 0;  // by a non-recent entry with more attention (ties: newer)
            for (int64_t i = 0; i < n; ++i) {
              int64_t newer_i = 0;
              for (int64_t x = 0; x < n; ++x) newer_i += pos[x] > pos[i];
              if (newer_i >= o.budget / 2 && (acc[i] > acc[j] || (acc[i] == acc[j] && pos[i] > pos[j]))) ++beaten;
            }
            kept = beaten < o.budget - o.budget / 2;
          }
          if (kept)
            keep.push_back(pos[j]);
          else
            evicted_mass[s] += acc[j];
        }
        std::sort(keep.begin(), keep.end());
        want[s] = keep;
      }
    });
    for (size_t i = 0; i < ids.size(); i += (i < 21 ? 7 : 1)) {
      const size_t n = i < 21 ? 7 : 1;  // a prompt in chunks of 7, then one token at a time
      dec.feed(std::span(ids).subspan(i, n));
      for (int64_t s = 0; s < 4; ++s) {
        ASSERT_EQ(dec.cache().kept_positions(s / 2, s % 2), want[s]) << "buffer " << buffer << " after " << i + n;
        double mass = evicted_mass[s];
        for (int64_t j = 0; j < dec.cache().size(s / 2, s % 2); ++j) mass += dec.cache().attn_sum(s / 2, s % 2)[j];
        EXPECT_NEAR(mass, 2.0 * static_cast<double>(i + n), 1e-3);  // 2 query heads per KV head
      }
    }
  }
}

TEST(Decoder, BadCombinationsFail) {
  const Tiny& t = tiny(gates::GateKind::trimkv);
  ResidentWeightProvider w(t.ckpt);
  EXPECT_THROW(Decoder(w, nullptr, policy(PolicyKind::trimkv, 8)), Error);
  EXPECT_THROW(Decoder(w, nullptr, policy(PolicyKind::dbtrimkv, 8)), Error);
  EXPECT_THROW(Decoder(w, nullptr, policy(PolicyKind::window, 3)), Error);
  gates::GateDims dims = t.gates.dims();
  dims.layers = 3;
  const gates::RetentionGates wrong = gates::RetentionGates::init(dims, 2.0, 1);
  EXPECT_THROW(Decoder(w, &wrong, policy(PolicyKind::trimkv, 8)), Error);
  Decoder dec(w, nullptr, policy(PolicyKind::full, 0));
  const std::vector<int32_t> bad = {5, 300};
  EXPECT_THROW(dec.feed(bad), Error);
}
