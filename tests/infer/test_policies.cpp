// The eviction policies' selections vs brute-force references (an entry is kept iff fewer than
// k entries beat it), and the attention over a bounded cache vs the full attention op and a
// float64 reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "kernels/kv_attention.h"
#include "kernels/ops.h"
#include "model/infer/policy.h"

using namespace retain;
using namespace retain::infer;

namespace {

// Scores drawn from few values, so ties are common and the tie rule is exercised.
std::vector<float> tied_scores(std::mt19937_64& rng, int64_t n) {
  std::uniform_int_distribution<int> pick(0, 5);
  std::vector<float> s(static_cast<size_t>(n));
  for (float& x : s) x = -0.25f * static_cast<float>(pick(rng));
  return s;
}

// Brute force: entry j is kept iff fewer than k entries beat it (larger score, or equal
// score and later position).
std::vector<int32_t> brute_top(const std::vector<float>& s, const std::vector<int32_t>& pos, int64_t k) {
  std::vector<int32_t> out;
  for (size_t j = 0; j < s.size(); ++j) {
    int64_t beaten_by = 0;
    for (size_t i = 0; i < s.size(); ++i)
      if (s[i] > s[j] || (s[i] == s[j] && pos[i] > pos[j])) ++beaten_by;
    if (beaten_by < k) out.push_back(static_cast<int32_t>(j));
  }
  return out;
}

}  // namespace

TEST(Policies, TopKMatchesBruteForceWithTies) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % 40), k = 1 + static_cast<int64_t>(rng() % 45);
    const std::vector<float> s = tied_scores(rng, n);
    std::vector<int32_t> pos(static_cast<size_t>(n));
    int32_t p = 0;
    for (int32_t& x : pos) x = (p += 1 + static_cast<int32_t>(rng() % 3));  // increasing, with gaps
    EXPECT_EQ(select_top(s, pos, k), brute_top(s, pos, k)) << "trial " << trial;
  }
}

TEST(Policies, WindowKeepsSinksAndRecent) {
  // Entries in shuffled slots (as the cache holds them after evictions): the selection goes by position.
  std::mt19937_64 rng(10);
  for (int64_t n = 1; n < 30; ++n)
    for (int64_t b = 5; b < 32; ++b) {
      std::vector<int32_t> pos(static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j) pos[j] = static_cast<int32_t>(2 * j + (j > 6 ? 5 : 0));
      std::shuffle(pos.begin(), pos.end(), rng);
      std::vector<int32_t> want;
      for (int64_t j = 0; j < n; ++j) {  // by definition: one of the 4 oldest, or among the b − 4 newest
        int64_t older = 0, newer = 0;
        for (int32_t p : pos) older += p < pos[j], newer += p > pos[j];
        if (n <= b || older < 4 || newer < b - 4) want.push_back(static_cast<int32_t>(j));
      }
      EXPECT_EQ(select_window(pos, b, 4), want) << n << " " << b;
    }
}

TEST(Policies, H2OMatchesBruteForce) {
  std::mt19937_64 rng(12);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t n = 2 + static_cast<int64_t>(rng() % 40), b = 2 + static_cast<int64_t>(rng() % 40);
    const std::vector<float> s = tied_scores(rng, n);
    std::vector<int32_t> pos(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) pos[j] = static_cast<int32_t>(3 * j);
    std::shuffle(pos.begin(), pos.end(), rng);
    std::vector<int32_t> want;
    const int64_t recent = b / 2;
    for (int64_t j = 0; j < n; ++j) {
      // Recent: fewer than b/2 entries are newer. Heavy: not recent, and fewer than b − b/2 other
      // non-recent entries beat it (more attention, or equal and newer).
      auto is_recent = [&](int64_t i) {
        int64_t newer = 0;
        for (int32_t p : pos) newer += p > pos[i];
        return newer < recent;
      };
      bool keep = n <= b || is_recent(j);
      if (!keep) {
        int64_t beaten = 0;
        for (int64_t i = 0; i < n; ++i)
          if (!is_recent(i) && (s[i] > s[j] || (s[i] == s[j] && pos[i] > pos[j]))) ++beaten;
        keep = beaten < b - recent;
      }
      if (keep) want.push_back(static_cast<int32_t>(j));
    }
    EXPECT_EQ(select_h2o(s, pos, b), want) << "trial " << trial;
  }
}

TEST(Policies, GlobalTopKMatchesBruteForce) {
  std::mt19937_64 rng(13);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t streams = 1 + static_cast<int64_t>(rng() % 6), n = 1 + static_cast<int64_t>(rng() % 60);
    const int64_t k = 1 + static_cast<int64_t>(rng() % 70);
    std::vector<GlobalEntry> e;
    const std::vector<float> s = tied_scores(rng, n);
    for (int64_t j = 0; j < n; ++j)
      e.push_back({s[j], static_cast<int32_t>(rng() % 8), static_cast<int32_t>(rng() % streams)});
    std::vector<uint8_t> want(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) {
      int64_t beaten_by = 0;
      for (int64_t i = 0; i < n; ++i) {
        const auto& a = e[i];
        const auto& b = e[j];
        if (i != j && (a.score > b.score || (a.score == b.score && (a.pos > b.pos || (a.pos == b.pos && (a.stream < b.stream || (a.stream == b.stream && i < j))))))) ++beaten_by;
      }
      want[j] = beaten_by < k;
    }
    // Fully tied entries (same score, position and stream) are interchangeable: compare counts
    // per (score, pos, stream) class.
    const std::vector<uint8_t> got = select_global(e, k);
    std::multiset<std::tuple<float, int32_t, int32_t>> g, w;
    for (int64_t j = 0; j < n; ++j) {
      if (got[j]) g.insert({e[j].score, e[j].pos, e[j].stream});
      if (want[j]) w.insert({e[j].score, e[j].pos, e[j].stream});
    }
    EXPECT_EQ(g, w) << "trial " << trial;
  }
}

TEST(Policies, BudgetValidation) {
  PolicyOptions o;
  o.kind = PolicyKind::window;
  o.budget = 4;
  EXPECT_THROW(make_policy(o), Error);
  o.budget = 5;
  EXPECT_NO_THROW(make_policy(o));
  o.kind = PolicyKind::h2o;
  o.budget = 1;
  EXPECT_THROW(make_policy(o), Error);
  o.kind = PolicyKind::trimkv;
  o.budget = 0;
  EXPECT_THROW(make_policy(o), Error);
  o.kind = PolicyKind::kvpop;  // sinks + window + 1 (tests/infer/test_kvpop_policy.cpp: the policy itself)
  o.sinks = 4;
  o.window = 8;
  o.budget = 12;
  EXPECT_THROW(make_policy(o), Error);
  o.budget = 13;
  EXPECT_NO_THROW(make_policy(o));
  EXPECT_THROW(parse_policy("lru"), Error);
}

TEST(KvAttention, FullCacheEqualsCausalAttention) {
  const int64_t T = 23, H = 4, K = 2, d = 8, C = 32;
  std::mt19937_64 rng(14);
  std::normal_distribution<float> n01;
  Tensor q = Tensor::empty({T, H, d}, DType::F32), k = Tensor::empty({T, K, d}, DType::F32),
         v = Tensor::empty({T, K, d}, DType::F32);
  for (Tensor* t : {&q, &k, &v})
    for (int64_t i = 0; i < t->numel(); ++i) t->data<float>()[i] = n01(rng);
  Tensor doc = Tensor::zeros({T}, DType::I32), want = Tensor::empty({T, H, d}, DType::F32);
  ops::attention(q, k, v, doc, 0.35f, want);
  // The same keys as a cache laid out [K, C, d] with room to spare.
  Tensor keys = Tensor::zeros({K, C, d}, DType::F32), values = Tensor::zeros({K, C, d}, DType::F32),
         kpos = Tensor::zeros({K, C}, DType::I32), lens = Tensor::empty({K}, DType::I32),
         qpos = Tensor::empty({T}, DType::I32), got = Tensor::empty({T, H, d}, DType::F32);
  for (int64_t h = 0; h < K; ++h) {
    lens.data<int32_t>()[h] = static_cast<int32_t>(T);
    for (int64_t t = 0; t < T; ++t) {
      kpos.data<int32_t>()[h * C + t] = static_cast<int32_t>(t);
      for (int64_t e = 0; e < d; ++e) {
        keys.data<float>()[(h * C + t) * d + e] = k.data<float>()[(t * K + h) * d + e];
        values.data<float>()[(h * C + t) * d + e] = v.data<float>()[(t * K + h) * d + e];
      }
    }
  }
  for (int64_t t = 0; t < T; ++t) qpos.data<int32_t>()[t] = static_cast<int32_t>(t);
  Tensor sums = Tensor::zeros({K, C}, DType::F32);
  ops::kv_attention(q, qpos, keys, values, kpos, lens, 0.35f, got, &sums);
  for (int64_t i = 0; i < got.numel(); ++i) EXPECT_NEAR(got.data<float>()[i], want.data<float>()[i], 2e-6);
  // Accumulated attention: every query row sums to 1, H/K heads per KV head.
  for (int64_t h = 0; h < K; ++h) {
    double total = 0;
    for (int64_t j = 0; j < T; ++j) total += sums.data<float>()[h * C + j];
    EXPECT_NEAR(total, static_cast<double>(T * (H / K)), 1e-4);
  }
}

TEST(KvAttention, RaggedHeadsMatchFloat64) {
  const int64_t T = 3, H = 6, K = 3, d = 5, C = 9;
  std::mt19937_64 rng(15);
  std::normal_distribution<float> n01;
  Tensor q = Tensor::empty({T, H, d}, DType::F32), keys = Tensor::empty({K, C, d}, DType::F32),
         values = Tensor::empty({K, C, d}, DType::F32);
  for (Tensor* t : {&q, &keys, &values})
    for (int64_t i = 0; i < t->numel(); ++i) t->data<float>()[i] = n01(rng);
  const std::vector<int32_t> len = {9, 4, 0};
  Tensor lens = Tensor::from_vector(len, {K}), kpos = Tensor::zeros({K, C}, DType::I32);
  for (int64_t h = 0; h < K; ++h)
    for (int64_t j = 0; j < len[h]; ++j) kpos.data<int32_t>()[h * C + j] = static_cast<int32_t>(5 * j + h);
  Tensor qpos = Tensor::from_vector(std::vector<int32_t>{12, 30, 45}, {T}), out = Tensor::empty({T, H, d}, DType::F32);
  Tensor sums = Tensor::zeros({K, C}, DType::F32);
  ops::kv_attention(q, qpos, keys, values, kpos, lens, 0.5f, out, &sums);
  std::vector<double> want_sum(static_cast<size_t>(K * C), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t hq = 0; hq < H; ++hq) {
      const int64_t h = hq / (H / K);
      std::vector<double> s;
      std::vector<int64_t> js;
      for (int64_t j = 0; j < len[h]; ++j) {
        if (kpos.data<int32_t>()[h * C + j] > qpos.data<int32_t>()[t]) continue;
        double dot = 0;
        for (int64_t e = 0; e < d; ++e)
          dot += static_cast<double>(q.data<float>()[(t * H + hq) * d + e]) * keys.data<float>()[(h * C + j) * d + e];
        s.push_back(0.5 * dot);
        js.push_back(j);
      }
      for (int64_t e = 0; e < d; ++e) {
        double z = 0, o = 0;
        const double mx = s.empty() ? 0 : *std::max_element(s.begin(), s.end());
        for (size_t i = 0; i < s.size(); ++i) z += std::exp(s[i] - mx);
        for (size_t i = 0; i < s.size(); ++i) {
          const double p = std::exp(s[i] - mx) / z;
          o += p * values.data<float>()[(h * C + js[i]) * d + e];
          if (e == 0) want_sum[h * C + js[i]] += p;
        }
        EXPECT_NEAR(out.data<float>()[(t * H + hq) * d + e], o, 1e-5) << t << " " << hq << " " << e;
      }
    }
  for (int64_t i = 0; i < K * C; ++i) EXPECT_NEAR(sums.data<float>()[i], want_sum[i], 1e-5) << i;
}
