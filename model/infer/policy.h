// Eviction policies of DESIGN §8, applied to a KVCache after every forward of the decoder.
// Each keeps, per (layer, KV head) — or globally for dbtrimkv — at most `budget` entries once
// an entry count reaches budget + buffer. Ties are broken toward the newer token. The
// selection functions are exposed so that tests can compare them with brute-force references.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/infer/kv_cache.h"

namespace retain::infer {

// oracle_m ("oracle-m"): kvpop's cache (sinks, window, top-k by ŝ_i(q)) with score_i replaced by
// the KVPOP training target log m_i of the whole sequence (model/infer/oracle.h): teacher-forced
// evaluation only, the ceiling of any KVPOP scorer with the same window, sinks and decay.
enum class PolicyKind { full, window, h2o, trimkv, dbtrimkv, kvpop, oracle_m };

PolicyKind parse_policy(std::string_view s, std::string_view what = "--policy");
std::string_view policy_name(PolicyKind kind);
// True for the policies that rank entries by logβ (they need retention gates).
bool policy_needs_gates(PolicyKind kind);
// True for the policies that take KVPOP scorers (kvpop; oracle-m takes their window, sinks and decay).
inline bool policy_needs_scorers(PolicyKind kind) { return kind == PolicyKind::kvpop || kind == PolicyKind::oracle_m; }

struct PolicyOptions {
  PolicyKind kind = PolicyKind::full;
  int64_t budget = 0;  // B: entries per (layer, KV head); ignored by full
  int64_t buffer = 1;  // evict when a count reaches B + buffer (DESIGN §8 default 1)
  int64_t sinks = 4;   // window: StreamingLLM's attention sinks; kvpop, oracle-m: the scorers' sinks
  int64_t window = 0;  // kvpop, oracle-m: the scorers' protected window w (the rest of B is the top-k)
  // kvpop and oracle-m with the scorers' decay every n > 1: n and log γ per stream (layer·K + head); the
  // rank keys then get −log γ where i mod n > q mod n (kvpop_drops). Empty for n = 1.
  int64_t decay_every = 1;
  std::vector<float> log_gamma{};
  // trimkv, dbtrimkv: the score (q + a − i)·logβ_i with q = tokens seen; a = the lookahead
  // (--lookahead; 1: the reference's lookahead_steps = 1, DESIGN §8).
  int64_t lookahead = 1;
};

// The smallest budget a policy can run with: window needs its sinks and one recent token,
// h2o one heavy hitter and one recent token, kvpop (and oracle-m) its sinks, window and one top-k entry; the
// rest one entry. full: 0 (no budget).
int64_t min_budget(const PolicyOptions& opt);

class EvictionPolicy {
 public:
  explicit EvictionPolicy(const PolicyOptions& opt) : opt_(opt) {}
  virtual ~EvictionPolicy() = default;
  const PolicyOptions& options() const { return opt_; }
  // H2O ranks by the attention each entry received: the decoder accumulates it when asked.
  virtual bool needs_attention_sums() const { return false; }
  // Called after every forward; `seen` = tokens fed so far (the next query is at seen + 1 in
  // the reference's counting: q = seen + 1).
  virtual void evict(KVCache& cache, int64_t seen) const = 0;

 protected:
  PolicyOptions opt_;
};

// Validates the budget (one-line error naming the policy and its minimum) and builds the policy.
// kvpop: with q = seen the next query, after each eviction a head keeps its sinks (positions <
// sinks), its window (q − i < w: the w − 1 newest; q itself joins at the next forward) and the
// budget − sinks − (w − 1) eligible keys (i ≤ q − w, DESIGN §5) with the largest ŝ_i(q). As for
// every policy here the next forward then attends over budget + 1 entries: DESIGN's cache of
// B = s + w + k plus one more top-k entry. The decoder writes each entry's rank key
// score_i − i·log γ into its logβ slot when the entry's score is assigned (kvpop_state.h).
std::unique_ptr<EvictionPolicy> make_policy(const PolicyOptions& opt);

// ---- selections (indices into one head's entries, ascending) --------------------------------
// A head's entries are in no particular order (eviction fills holes, see kv_cache.h): every
// selection goes by the entries' positions, never by their indices.

// The m entries with the lowest score, ties toward the smaller position (the older entry loses);
// in no particular order. What the policies evict: one O(n) partition per call.
std::vector<int32_t> drop_worst(std::span<const float> score, std::span<const int32_t> pos, int64_t m);
// What trimkv evicts from one head at query q (= seen + lookahead): the m entries with the lowest (q − i)·logβ_i.
std::vector<int32_t> trimkv_drops(const float* log_beta, const int32_t* pos, int64_t n, int64_t q, int64_t m);
// What kvpop evicts from one head after `seen` tokens: entries outside the sinks and the window
// (positions > seen − window), lowest rank key first (ties: the older loses), down to `budget`.
// With every n > 1 the key of an entry at i with i mod n > q mod n (q = seen) gains −log_gamma:
// then the order is that of ŝ_i(q) = score_i + ⌊(q − i)/n⌋·log γ (kvpop_state.h).
std::vector<int32_t> kvpop_drops(std::span<const float> key, std::span<const int32_t> pos, int64_t budget,
                                 int64_t sinks, int64_t window, int64_t seen, int64_t every = 1,
                                 float log_gamma = 0.0f);
// What window and h2o evict (below), as drop sets.
std::vector<int32_t> window_drops(std::span<const int32_t> pos, int64_t budget, int64_t sinks);
std::vector<int32_t> h2o_drops(std::span<const float> attn_sum, std::span<const int32_t> pos, int64_t budget);
// The kept sets (the complements), ascending:
// the k entries with the largest score, ties toward the larger position; all when n ≤ k.
std::vector<int32_t> select_top(std::span<const float> score, std::span<const int32_t> pos, int64_t k);
// StreamingLLM: the `sinks` oldest entries and the budget − sinks newest.
std::vector<int32_t> select_window(std::span<const int32_t> pos, int64_t budget, int64_t sinks);
// H2O: the budget/2 newest entries (recent half) and the budget − budget/2 other entries with
// the largest accumulated attention (ties toward newer).
std::vector<int32_t> select_h2o(std::span<const float> attn_sum, std::span<const int32_t> pos, int64_t budget);
// TRIM-KV's score at query q: (q − i)·logβ_i in float32, as TrimKVCache computes it.
inline float trimkv_score(float log_beta, int64_t q, int32_t pos) {
  return log_beta * static_cast<float>(q - pos);
}
// DBTrimKV: one top-k over entries of several streams (stream = layer·K + head); returns a
// keep flag per entry. Ties: larger position, then smaller stream.
struct GlobalEntry {
  float score;
  int32_t pos;
  int32_t stream;
};
std::vector<uint8_t> select_global(std::span<const GlobalEntry> entries, int64_t k);

}  // namespace retain::infer
