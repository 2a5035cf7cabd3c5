// KVPOP boundary selection (DESIGN §5): per document run, the keys with position ≥ sinks enter
// a Fenwick tree over their descending-log m ranks as they become eligible; at each decision the
// k-th best inserted key is found by binary lifting. O(T log T).
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
                                       int64_t sinks, int64_t k) {
  std::vector<Decision> out;
  for (int64_t st = 0, en; st < T; st = en) {
    en = st + 1;
    while (en < T && doc[en] == doc[st]) ++en;
    if (doc[st] < 0) continue;
    // Candidate keys: positions sinks ≤ p ≤ len − 1 − w (the last t_new of the run).
    const int64_t first = st + sinks, last = en - 1 - w;
    if (last < first) continue;
    const int64_t n = last - first + 1;
    std::vector<int64_t> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), first);
    // Best first; ties by position so the order is total and deterministic.
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return log_m[a] != log_m[b] ? log_m[a] > log_m[b] : a < b;
    });
    std::vector<int64_t> rank(static_cast<size_t>(n));  // key − first → 1-based rank
    for (int64_t x = 0; x < n; ++x) rank[static_cast<size_t>(order[static_cast<size_t>(x)] - first)] = x + 1;
    Fenwick tree(n);
    for (int64_t t_new = first; t_new <= last; ++t_new) {
      if (t_new - first >= k) {
        const int64_t b = order[static_cast<size_t>(tree.kth(k) - 1)];
        const float dm = log_m[t_new] - log_m[b];
        out.push_back({t_new + w, t_new, b, log_m[t_new] > log_m[b] ? 1 : -1, std::abs(dm)});
      }
      tree.add(rank[static_cast<size_t>(t_new - first)]);
    }
  }
  return out;
}

}  // namespace retain::cpu::kvpop
