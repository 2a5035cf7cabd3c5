#include "model/infer/policy.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>

#include "kernels/base/error.h"

namespace retain::infer {

PolicyKind parse_policy(std::string_view s, std::string_view what) {
  static constexpr std::pair<std::string_view, PolicyKind> kNames[] = {
      {"full", PolicyKind::full},     {"window", PolicyKind::window},     {"h2o", PolicyKind::h2o},
      {"trimkv", PolicyKind::trimkv}, {"dbtrimkv", PolicyKind::dbtrimkv}, {"kvpop", PolicyKind::kvpop},
      {"oracle-m", PolicyKind::oracle_m}};
  for (const auto& [name, kind] : kNames)
    if (s == name) return kind;
  fail("{}: unknown policy '{}' (full, window, h2o, trimkv, dbtrimkv, kvpop, oracle-m)", what, s);
}

std::string_view policy_name(PolicyKind kind) {
  switch (kind) {
    case PolicyKind::full: return "full";
    case PolicyKind::window: return "window";
    case PolicyKind::h2o: return "h2o";
    case PolicyKind::trimkv: return "trimkv";
    case PolicyKind::dbtrimkv: return "dbtrimkv";
    case PolicyKind::kvpop: return "kvpop";
    case PolicyKind::oracle_m: return "oracle-m";
  }
  return "?";
}

bool policy_needs_gates(PolicyKind kind) { return kind == PolicyKind::trimkv || kind == PolicyKind::dbtrimkv; }

int64_t min_budget(const PolicyOptions& opt) {
  switch (opt.kind) {
    case PolicyKind::full: return 0;
    case PolicyKind::window: return opt.sinks + 1;
    case PolicyKind::h2o: return 2;
    case PolicyKind::kvpop:
    case PolicyKind::oracle_m: return opt.sinks + opt.window + 1;
    default: return 1;
  }
}

namespace {

// One candidate for eviction. `worse` is the eviction order: lower score first, then the older
// entry, then (global selections) the later stream.
struct Cand {
  float score;
  int32_t pos;
  int32_t stream;
  int32_t index;
};
bool worse(const Cand& a, const Cand& b) {
  if (a.score != b.score) return a.score < b.score;
  if (a.pos != b.pos) return a.pos < b.pos;
  return a.stream > b.stream;
}

// The m worst of a stream of candidates, in one pass: a max-heap (by `worse`) of the m worst
// so far, whose top is the best of them. O(n log m) without allocating per candidate; a
// decoding step evicts m = buffer entries per head (L·K for dbtrimkv), so this is a linear scan.
class WorstM {
 public:
  explicit WorstM(int64_t m) : m_(static_cast<size_t>(m)) { heap_.reserve(m_); }
  void offer(const Cand& c) {
    if (heap_.size() < m_) {
      heap_.push_back(c);
      std::push_heap(heap_.begin(), heap_.end(), worse);
    } else if (m_ > 0 && worse(c, heap_.front())) {
      std::pop_heap(heap_.begin(), heap_.end(), worse);
      heap_.back() = c;
      std::push_heap(heap_.begin(), heap_.end(), worse);
    }
  }
  const std::vector<Cand>& result() const { return heap_; }

 private:
  size_t m_;
  std::vector<Cand> heap_;
};

std::vector<int32_t> indices(const WorstM& w) {
  std::vector<int32_t> out;
  for (const Cand& c : w.result()) out.push_back(c.index);
  return out;
}

}  // namespace

std::vector<int32_t> drop_worst(std::span<const float> score, std::span<const int32_t> pos, int64_t m) {
  const int64_t n = static_cast<int64_t>(score.size());
  if (m <= 0) return {};
  WorstM w(std::min(m, n));
  for (int32_t j = 0; j < n; ++j) w.offer({score[j], pos[j], 0, j});
  return indices(w);
}

std::vector<int32_t> trimkv_drops(const float* log_beta, const int32_t* pos, int64_t n, int64_t q, int64_t m) {
  if (m <= 0) return {};
  WorstM w(std::min(m, n));
  for (int32_t j = 0; j < n; ++j) w.offer({trimkv_score(log_beta[j], q, pos[j]), pos[j], 0, j});
  return indices(w);
}

namespace {

// The complement of `drop` in [0, n), ascending.
std::vector<int32_t> complement(int64_t n, const std::vector<int32_t>& drop) {
  std::vector<uint8_t> gone(static_cast<size_t>(n), 0);
  for (int32_t j : drop) gone[static_cast<size_t>(j)] = 1;
  std::vector<int32_t> out;
  for (int32_t j = 0; j < n; ++j)
    if (!gone[static_cast<size_t>(j)]) out.push_back(j);
  return out;
}

constexpr float kProtected = std::numeric_limits<float>::infinity();

// The k-th largest position (k ≥ 1), by a partition of a copy: entries with a larger or equal
// position are the k newest (positions within a head are distinct).
int32_t kth_newest(std::span<const int32_t> pos, int64_t k) {
  std::vector<int32_t> p(pos.begin(), pos.end());
  std::nth_element(p.begin(), p.begin() + (k - 1), p.end(), std::greater<>());
  return p[static_cast<size_t>(k - 1)];
}

}  // namespace

std::vector<int32_t> window_drops(std::span<const int32_t> pos, int64_t budget, int64_t sinks) {
  const int64_t n = static_cast<int64_t>(pos.size());
  if (n <= budget) return {};
  // Score = position (older loses), except the sinks (the `sinks` oldest), which never lose.
  std::vector<int32_t> neg(pos.size());
  for (size_t j = 0; j < pos.size(); ++j) neg[j] = -pos[j];
  const int32_t sink_edge = sinks > 0 ? -kth_newest(neg, sinks) : std::numeric_limits<int32_t>::min();
  std::vector<float> score(pos.size());
  for (size_t j = 0; j < pos.size(); ++j)
    score[j] = sinks > 0 && pos[j] <= sink_edge ? kProtected : static_cast<float>(pos[j]);
  return drop_worst(score, pos, n - budget);
}

std::vector<int32_t> kvpop_drops(std::span<const float> key, std::span<const int32_t> pos, int64_t budget,
                                 int64_t sinks, int64_t window, int64_t seen, int64_t every, float log_gamma) {
  const int64_t n = static_cast<int64_t>(pos.size());
  if (n <= budget) return {};
  std::vector<float> score(key.begin(), key.end());
  for (size_t j = 0; j < pos.size(); ++j) {
    // The next query is q = seen: the window is q − i < w, the eligible keys are i ≤ q − w.
    if (pos[j] < sinks || pos[j] > seen - window) score[j] = kProtected;
    else RETAIN_CHECK(std::isfinite(score[j]), "kvpop: entry at position {} has no score", pos[j]);
    // ⌊(q − i)/n⌋ = ⌊q/n⌋ − ⌊i/n⌋ − [i mod n > q mod n]: the last term is one step less decay.
    if (every > 1 && score[j] != kProtected && pos[j] % every > seen % every) score[j] -= log_gamma;
  }
  return drop_worst(score, pos, n - budget);
}

std::vector<int32_t> h2o_drops(std::span<const float> attn_sum, std::span<const int32_t> pos, int64_t budget) {
  const int64_t n = static_cast<int64_t>(attn_sum.size());
  if (n <= budget) return {};
  const int64_t recent = budget / 2;
  const int32_t recent_edge = recent > 0 ? kth_newest(pos, recent) : std::numeric_limits<int32_t>::max();
  std::vector<float> score(attn_sum.begin(), attn_sum.end());
  for (size_t j = 0; j < pos.size(); ++j)
    if (pos[j] >= recent_edge) score[j] = kProtected;
  return drop_worst(score, pos, n - budget);
}

std::vector<int32_t> select_top(std::span<const float> score, std::span<const int32_t> pos, int64_t k) {
  const int64_t n = static_cast<int64_t>(score.size());
  return complement(n, drop_worst(score, pos, n - k));
}

std::vector<int32_t> select_window(std::span<const int32_t> pos, int64_t budget, int64_t sinks) {
  return complement(static_cast<int64_t>(pos.size()), window_drops(pos, budget, sinks));
}

std::vector<int32_t> select_h2o(std::span<const float> attn_sum, std::span<const int32_t> pos, int64_t budget) {
  return complement(static_cast<int64_t>(pos.size()), h2o_drops(attn_sum, pos, budget));
}

std::vector<uint8_t> select_global(std::span<const GlobalEntry> e, int64_t k) {
  const int64_t n = static_cast<int64_t>(e.size());
  std::vector<uint8_t> keep(static_cast<size_t>(n), 1);
  if (n <= k) return keep;
  WorstM w(n - k);
  for (int32_t j = 0; j < n; ++j) w.offer({e[j].score, e[j].pos, e[j].stream, j});
  for (const Cand& c : w.result()) keep[static_cast<size_t>(c.index)] = 0;
  return keep;
}

namespace {

class FullPolicy : public EvictionPolicy {
 public:
  using EvictionPolicy::EvictionPolicy;
  void evict(KVCache&, int64_t) const override {}
};

// Base of the per-(layer, KV head) policies: evict a head once it reaches B + buffer.
class PerHeadPolicy : public EvictionPolicy {
 public:
  using EvictionPolicy::EvictionPolicy;
  void evict(KVCache& cache, int64_t seen) const override {
    for (int64_t l = 0; l < cache.layers(); ++l)
      for (int64_t h = 0; h < cache.kv_heads(); ++h)
        if (cache.size(l, h) >= opt_.budget + opt_.buffer) cache.drop(l, h, drops(cache, l, h, seen));
  }
  // The entries of (l, h) to evict, down to the budget.
  virtual std::vector<int32_t> drops(const KVCache& cache, int64_t l, int64_t h, int64_t seen) const = 0;
};

class WindowPolicy : public PerHeadPolicy {
 public:
  using PerHeadPolicy::PerHeadPolicy;
  std::vector<int32_t> drops(const KVCache& c, int64_t l, int64_t h, int64_t) const override {
    return window_drops({c.positions(l, h), static_cast<size_t>(c.size(l, h))}, opt_.budget, opt_.sinks);
  }
};

class H2OPolicy : public PerHeadPolicy {
 public:
  using PerHeadPolicy::PerHeadPolicy;
  bool needs_attention_sums() const override { return true; }
  std::vector<int32_t> drops(const KVCache& c, int64_t l, int64_t h, int64_t) const override {
    const size_t n = static_cast<size_t>(c.size(l, h));
    return h2o_drops({c.attn_sum(l, h), n}, {c.positions(l, h), n}, opt_.budget);
  }
};

class TrimKVPolicy : public PerHeadPolicy {
 public:
  using PerHeadPolicy::PerHeadPolicy;
  std::vector<int32_t> drops(const KVCache& c, int64_t l, int64_t h, int64_t seen) const override {
    const int64_t n = c.size(l, h);
    return trimkv_drops(c.log_beta(l, h), c.positions(l, h), n, seen + opt_.lookahead, n - opt_.budget);
  }
};

class KvpopPolicy : public PerHeadPolicy {
 public:
  using PerHeadPolicy::PerHeadPolicy;
  std::vector<int32_t> drops(const KVCache& c, int64_t l, int64_t h, int64_t seen) const override {
    const size_t n = static_cast<size_t>(c.size(l, h));
    const float lg = opt_.decay_every > 1 ? opt_.log_gamma.at(static_cast<size_t>(l * c.kv_heads() + h)) : 0.0f;
    return kvpop_drops({c.log_beta(l, h), n}, {c.positions(l, h), n}, opt_.budget, opt_.sinks, opt_.window, seen,
                       opt_.decay_every, lg);
  }
};

class DBTrimKVPolicy : public EvictionPolicy {
 public:
  using EvictionPolicy::EvictionPolicy;
  void evict(KVCache& c, int64_t seen) const override {
    const int64_t streams = c.layers() * c.kv_heads();
    if (c.total() < streams * (opt_.budget + opt_.buffer)) return;
    // One pass over every entry of every head, keeping the worst (total − B·L·K).
    WorstM w(c.total() - streams * opt_.budget);
    for (int64_t l = 0; l < c.layers(); ++l)
      for (int64_t h = 0; h < c.kv_heads(); ++h) {
        const float* lb = c.log_beta(l, h);
        const int32_t* pos = c.positions(l, h);
        const int32_t stream = static_cast<int32_t>(l * c.kv_heads() + h);
        for (int32_t j = 0; j < c.size(l, h); ++j) w.offer({trimkv_score(lb[j], seen + opt_.lookahead, pos[j]), pos[j], stream, j});
      }
    std::vector<std::vector<int32_t>> drops(static_cast<size_t>(streams));
    for (const Cand& cand : w.result()) drops[static_cast<size_t>(cand.stream)].push_back(cand.index);
    for (int64_t l = 0; l < c.layers(); ++l)
      for (int64_t h = 0; h < c.kv_heads(); ++h) {
        std::vector<int32_t>& drop = drops[static_cast<size_t>(l * c.kv_heads() + h)];
        c.drop(l, h, std::move(drop));
      }
  }
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_policy(const PolicyOptions& opt) {
  if (opt.buffer < 1) fail("--buffer must be at least 1, got {}", opt.buffer);
  if (opt.lookahead < 0) fail("--lookahead must be ≥ 0, got {}", opt.lookahead);
  if (opt.kind != PolicyKind::full && opt.budget < min_budget(opt))
    fail("--budget {} is below the minimum {} of policy {}{}", opt.budget, min_budget(opt), policy_name(opt.kind),
         opt.kind == PolicyKind::window ? fmt::format(" ({} sinks + 1 recent token)", opt.sinks)
         : opt.kind == PolicyKind::h2o  ? std::string(" (1 heavy hitter + 1 recent token)")
         : policy_needs_scorers(opt.kind)
             ? fmt::format(" ({} sinks + a window of {} + 1 top-k entry, from the scorers)", opt.sinks, opt.window)
                                        : std::string());
  switch (opt.kind) {
    case PolicyKind::full: return std::make_unique<FullPolicy>(opt);
    case PolicyKind::window: return std::make_unique<WindowPolicy>(opt);
    case PolicyKind::h2o: return std::make_unique<H2OPolicy>(opt);
    case PolicyKind::trimkv: return std::make_unique<TrimKVPolicy>(opt);
    case PolicyKind::dbtrimkv: return std::make_unique<DBTrimKVPolicy>(opt);
    case PolicyKind::kvpop:
    case PolicyKind::oracle_m: return std::make_unique<KvpopPolicy>(opt);  // the same cache; other rank keys
  }
  fail("--policy: unknown policy");
}

}  // namespace retain::infer
