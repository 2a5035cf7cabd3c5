// KVPOP boundary selection (DESIGN §5): per document run, the keys with position ≥ sinks enter
// a Fenwick tree over their descending-log m ranks as they become eligible; at each decision the
// k-th best inserted key is found by binary lifting. O(T log T).
// Effective targets (TargetRule::effective, the KVPOP paper's rule): ŝ_i(q) = log m_i +
// ⌊(q − i)/n⌋·λ (λ = log γ ≤ 0). With i = n·j_i + r_i and q = n·j_q + r_q (run-relative),
// ⌊(q − i)/n⌋ = j_q − j_i − [r_i > r_q], so ŝ_i(q) = (log m_i − j_i·λ − [r_i > r_q]·λ) + j_q·λ:
// for a fixed residue r_q the order of the keys is static. One pass per residue ρ = r_q ranks by
// log m_i − j_i·λ − [r_i > ρ]·λ and emits the decisions whose q has residue ρ. O(n·T log T).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/cpu/kvpop_cpu.h"

namespace retain::cpu::kvpop {

namespace {

// Counts per rank (1-based), prefix sums and the k-th smallest occupied rank.
class Fenwick {
 public:
  explicit Fenwick(int64_t n) : tree_(static_cast<size_t>(n + 1), 0), n_(n) {
    while ((int64_t{1} << (log_ + 1)) <= n_) ++log_;
  }
  void add(int64_t rank) {
    for (int64_t i = rank; i <= n_; i += i & -i) ++tree_[static_cast<size_t>(i)];
  }
  // The smallest rank whose prefix count reaches k (k ≥ 1 and ≤ the total count).
  int64_t kth(int64_t k) const {
    int64_t pos = 0;
    for (int64_t step = int64_t{1} << log_; step > 0; step >>= 1)
      if (pos + step <= n_ && tree_[static_cast<size_t>(pos + step)] < k) {
        pos += step;
        k -= tree_[static_cast<size_t>(pos)];
      }
    return pos + 1;
  }

 private:
  std::vector<int64_t> tree_;
  int64_t n_;
  int log_ = 0;
};

}  // namespace

std::vector<Decision> select_decisions(const float* log_m, const int32_t* doc, int64_t T, int64_t w,
                                       int64_t sinks, int64_t k, const retain::kvpop::TargetRule& rule) {
  std::vector<Decision> out;
  const int64_t every = rule.effective ? rule.every : 1;
  const double lam = rule.effective ? rule.log_gamma : 0.0;
  for (int64_t st = 0, en; st < T; st = en) {
    en = st + 1;
    while (en < T && doc[en] == doc[st]) ++en;
    if (doc[st] < 0) continue;
    // Candidate keys: positions sinks ≤ p ≤ len − 1 − w (the last t_new of the run).
    const int64_t first = st + sinks, last = en - 1 - w;
    if (last < first) continue;
    const int64_t n = last - first + 1;
    std::vector<int64_t> order(static_cast<size_t>(n));
    std::vector<double> key(static_cast<size_t>(n));
    std::vector<int64_t> rank(static_cast<size_t>(n));  // key − first → 1-based rank
    for (int64_t rho = 0; rho < every; ++rho) {
      // Raw: log m_i. Effective: the static key of residue ρ (see the top); every = 1: log m_i − i·λ.
      for (int64_t i = first; i <= last; ++i) {
        const int64_t rel = i - st;
        // One product of the step count, so that keys equal in exact arithmetic are equal here too.
        const int64_t steps = rel / every + (rel % every > rho ? 1 : 0);
        key[static_cast<size_t>(i - first)] =
            rule.effective ? double(log_m[i]) - double(steps) * lam : double(log_m[i]);
      }
      std::iota(order.begin(), order.end(), first);
      // Best first; ties by position so the order is total and deterministic.
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        const double ka = key[static_cast<size_t>(a - first)], kb = key[static_cast<size_t>(b - first)];
        return ka != kb ? ka > kb : a < b;
      });
      for (int64_t x = 0; x < n; ++x) rank[static_cast<size_t>(order[static_cast<size_t>(x)] - first)] = x + 1;
      Fenwick tree(n);
      for (int64_t t_new = first; t_new <= last; ++t_new) {
        const int64_t q = t_new + w;
        if (t_new - first >= k && (q - st) % every == rho) {
          const int64_t b = order[static_cast<size_t>(tree.kth(k) - 1)];
          // The targets the decision compares: log m, plus the decay at q when effective.
          const double s_new = double(log_m[t_new]) + (rule.effective ? double((q - t_new) / every) * lam : 0.0);
          const double s_b = double(log_m[b]) + (rule.effective ? double((q - b) / every) * lam : 0.0);
          if (rule.effective)
            out.push_back({q, t_new, b, s_new > s_b ? 1 : -1, static_cast<float>(std::abs(s_new - s_b))});
          else  // today's float arithmetic, bit for bit
            out.push_back({q, t_new, b, log_m[t_new] > log_m[b] ? 1 : -1, std::abs(log_m[t_new] - log_m[b])});
        }
        tree.add(rank[static_cast<size_t>(t_new - first)]);
      }
    }
  }
  // In increasing q (the passes of several residues interleave).
  if (every > 1)
    std::stable_sort(out.begin(), out.end(), [](const Decision& a, const Decision& b) { return a.q < b.q; });
  return out;
}

}  // namespace retain::cpu::kvpop
