// The kvpop policy (DESIGN §5, §8) in the decoder: the running scorers' scores equal the
// verified chunkwise op kvpop::mlstm_scores (tests/kvpop: mlstm-kernels) on the dense model's
// k, v, and every eviction keeps exactly what a brute force keeps — sinks, the window (q − i < w
// for the next query q), and the best others by ŝ_i(q) = score_i + (q − i)·log γ computed in
// double from those scores.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "kernels/kvpop.h"
#include "model/infer/decoder.h"
#include "model/kvpop/scorers.h"
#include "model/kvpop_step.h"

namespace retain::infer {
namespace {

const std::string kModel = std::string(RETAIN_FIXTURES_DIR) + "/trainer/model";
const std::string kScorers = std::string(RETAIN_FIXTURES_DIR) + "/kvpop/step/scorers.safetensors";

struct Fixture {
  std::shared_ptr<const Qwen3Checkpoint> ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(kModel));
  ResidentWeightProvider weights{ckpt};
  kvpop::Scorers scorers = kvpop::Scorers::load(kScorers, ckpt->config());  // window 6, sinks 2, topk 3
};

std::vector<int32_t> random_ids(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 256);
  return ids;
}

// kvpop::mlstm_scores on the dense teacher's x = [k; v] (model/kvpop_step.h teacher_pass).
std::vector<std::vector<std::vector<float>>> reference_scores(Fixture& s, const std::vector<int32_t>& ids) {
  const int64_t T = static_cast<int64_t>(ids.size());
  const Tensor id_t = Tensor::from_vector<int32_t>(ids, {T});
  const Tensor doc = Tensor::zeros({T}, DType::I32);
  kvpop::StepSettings st;
  st.window = 6;
  st.sinks = 2;
  st.topk = 3;
  LocalWeightProvider local(s.ckpt);
  const kvpop::TeacherPass pass = kvpop::teacher_pass(local, id_t, doc, st);
  const auto heads = s.scorers.head_values();
  std::vector<std::vector<std::vector<float>>> out(heads.size());
  for (size_t l = 0; l < heads.size(); ++l)
    for (size_t h = 0; h < heads[l].size(); ++h) {
      const kvpop::Projected P = kvpop::project(pass.x[l][h], heads[l][h]);
      const Tensor sc = kvpop::mlstm_scores(P, doc, st.window, heads[l][h].w_o, heads[l][h].b_o);
      out[l].emplace_back(sc.data<float>(), sc.data<float>() + T);
    }
  return out;
}

TEST(KvpopPolicy, RunningScoresEqualTheChunkwiseOp) {
  Fixture s;
  const std::vector<int32_t> ids = random_ids(90, 7);
  const auto want = reference_scores(s, ids);
  for (const int64_t chunk : {int64_t{0}, int64_t{7}}) {
    SCOPED_TRACE(chunk);
    Decoder dec(s.weights, nullptr, {PolicyKind::kvpop, 11, 1, 4, 0}, &s.scorers);
    dec.prefill(ids, chunk);
    const KvpopState& st = *dec.kvpop_state();
    double worst = 0;
    // One chunk: every layer sees the dense k, v. In chunks, eviction changes the attention
    // of later chunks, so only layer 0's k, v (before any attention) are the dense ones.
    const int64_t layers = chunk == 0 ? 2 : 1;
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t h = 0; h < 2; ++h) {
        const std::vector<double>& got = st.scores(l, h);
        ASSERT_EQ(got.size(), ids.size() - 6 + 1);  // u = 0 .. T − w
        for (size_t u = 0; u < got.size(); ++u)
          worst = std::max(worst, std::abs(got[u] - want[l][h][u]) / (1.0 + std::abs(want[l][h][u])));
      }
    EXPECT_LE(worst, 1e-5);
    RecordProperty(chunk == 0 ? "worst_score_error_one_chunk" : "worst_score_error_chunked", std::to_string(worst));
  }
}

// Every eviction against a brute force: ŝ_i(q) = score_i + floor((q − i)/n)·log γ in double
// from the running scores. Returns the evictions whose kept set differs from the one the same
// scores would give with n = 1 (so a test of n > 1 can tell the rules apart).
int check_every_eviction(Fixture& s, const kvpop::Decay& decay) {
  s.scorers.set_decay(decay);
  const int64_t n_every = decay.every;
  int differ = 0;
  const int64_t B = 11, sinks = 2, w = 6;
  for (const int64_t buffer : {int64_t{1}, int64_t{3}}) {
    SCOPED_TRACE(buffer);
    Decoder dec(s.weights, nullptr, {PolicyKind::kvpop, B, buffer, 4, 0}, &s.scorers);
    std::vector<std::vector<std::set<int32_t>>> expected;
    int evictions = 0;
    dec.set_before_evict([&](const KVCache& c, int64_t seen) {
      const KvpopState& st = *dec.kvpop_state();
      expected.assign(2, std::vector<std::set<int32_t>>(2));
      for (int64_t l = 0; l < 2; ++l)
        for (int64_t h = 0; h < 2; ++h) {
          const std::vector<int32_t> pos = c.kept_positions(l, h);
          std::set<int32_t>& keep = expected[l][h];
          if (static_cast<int64_t>(pos.size()) < B + buffer) {
            keep.insert(pos.begin(), pos.end());
            continue;
          }
          ++evictions;
          std::vector<std::pair<double, int32_t>> ranked, ranked1;  // (ŝ_i(q), i) of the eligible entries; n = 1
          for (int32_t p : pos) {
            if (p < sinks || p > seen - w) {  // next query q = seen: window q − i < w, eligible i ≤ q − w
              keep.insert(p);
            } else {
              EXPECT_LT(static_cast<size_t>(p), st.scores(l, h).size()) << "entry " << p << " has no score";
              const double score = st.scores(l, h)[p];
              ranked.emplace_back(score + std::floor(double(seen - p) / double(n_every)) * st.log_gamma(l, h), p);
              ranked1.emplace_back(score + double(seen - p) * st.log_gamma(l, h), p);
            }
          }
          auto better = [](const auto& a, const auto& b) {
            return a.first != b.first ? a.first > b.first : a.second > b.second;  // ties: newer kept
          };
          std::sort(ranked.begin(), ranked.end(), better);
          std::sort(ranked1.begin(), ranked1.end(), better);
          const size_t protected_count = keep.size();
          for (size_t i = 0; keep.size() < static_cast<size_t>(B) && i < ranked.size(); ++i) keep.insert(ranked[i].second);
          std::set<int32_t> top, top1;
          for (size_t i = 0; i + protected_count < static_cast<size_t>(B) && i < ranked.size(); ++i) {
            top.insert(ranked[i].second);
            top1.insert(ranked1[i].second);
          }
          if (top != top1) ++differ;
        }
    });
    std::vector<int32_t> ids = random_ids(30, 11);
    dec.prefill(ids, 9);  // prefill in chunks, evicting after each
    auto check = [&] {
      for (int64_t l = 0; l < 2; ++l)
        for (int64_t h = 0; h < 2; ++h) {
          const std::vector<int32_t> got = dec.cache().kept_positions(l, h);
          EXPECT_EQ(std::set<int32_t>(got.begin(), got.end()), expected[l][h]) << "layer " << l << " head " << h
                                                                               << " after " << dec.seen();
        }
    };
    check();
    for (int step = 0; step < 40; ++step) {  // decoding: one token at a time
      const int32_t next = static_cast<int32_t>((step * 37 + 5) % 256);
      dec.feed(std::span<const int32_t>(&next, 1));
      check();
    }
    EXPECT_GT(evictions, 40);
    EXPECT_LE(dec.cache().max_size(), B + buffer - 1);
  }
  return differ;
}

TEST(KvpopPolicy, EveryEvictionKeepsSinksWindowAndTopKByScore) {
  Fixture s;
  EXPECT_EQ(check_every_eviction(s, kvpop::Decay{}), 0);
}

// --decay-every n (the KVPOP paper's ⌊(q − i)/n⌋) and a decay range strong enough to reorder
// entries within the 70 tokens: the decoder's residue-corrected rank keys keep exactly what the
// brute force keeps, and that differs from what n = 1 would keep.
TEST(KvpopPolicy, DecayEveryNKeepsWhatBruteForceKeeps) {
  Fixture s;
  EXPECT_EQ(check_every_eviction(s, kvpop::Decay{1, 0.3, 0.6}), 0);  // the range alone: same rule as n = 1
  const int differ = check_every_eviction(s, kvpop::Decay{4, 0.3, 0.6});
  RecordProperty("evictions_differing_from_n1", std::to_string(differ));
  EXPECT_GT(differ, 0);
  EXPECT_GT(check_every_eviction(s, kvpop::Decay{3, 0.05, 0.2}), 0);
}



TEST(KvpopPolicy, BudgetAndScorersAreChecked) {
  Fixture s;
  auto error_of = [&](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  EXPECT_EQ(error_of([&] { Decoder(s.weights, nullptr, {PolicyKind::kvpop, 8, 1, 4, 0}, &s.scorers); }),
            "--budget 8 is below the minimum 9 of policy kvpop (2 sinks + a window of 6 + 1 top-k entry, from the "
            "scorers)");
  EXPECT_NE(error_of([&] { Decoder(s.weights, nullptr, {PolicyKind::kvpop, 12, 1, 4, 0}, nullptr); })
                .find("--policy kvpop ranks tokens by KVPOP scorers"),
            std::string::npos);
}

}  // namespace
}  // namespace retain::infer
