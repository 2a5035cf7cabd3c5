// KVPOP future-attention targets (DESIGN §5) by a transposed pass: each 64-key tile walks the
// queries d ≥ t + w of its documents and keeps, per (key, query head), an online log-sum-exp of
// q_d·k_t·scale − lse_d (the log of the dense attention probability p_{d→t}). Memory per tile:
// 64·H running (max, sum) pairs; no T×T buffer. Work O(Σ_docs len²·H·hd), like the attention.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/kvpop_cpu.h"

namespace retain::cpu::kvpop {

namespace {
constexpr int64_t kKeyTile = 64;
}

Tensor future_attention_target(const Tensor& q, const Tensor& k, const Tensor& lse, const int32_t* doc,
                               int64_t w, float scale) {
  const int64_t T = q.dim(0), H = q.dim(1), hd = q.dim(2), K = k.dim(1), G = H / K;
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  Tensor log_m = Tensor::empty({K, T}, DType::F32);
  // run_end[t]: one past the last token of t's document run (documents are contiguous runs).
  std::vector<int64_t> run_end(static_cast<size_t>(T));
  for (int64_t t = T - 1; t >= 0; --t)
    run_end[static_cast<size_t>(t)] = (t + 1 < T && doc[t + 1] == doc[t]) ? run_end[static_cast<size_t>(t + 1)] : t + 1;
  const float* qp = q.data<float>();
  const float* kp = k.data<float>();
  const float* lp = lse.data<float>();
  const int64_t tiles = (T + kKeyTile - 1) / kKeyTile;
#pragma omp parallel
  {
    std::vector<double> mx(static_cast<size_t>(kKeyTile * H)), sum(static_cast<size_t>(kKeyTile * H));
#pragma omp for schedule(dynamic)
    for (int64_t tile = 0; tile < tiles * K; ++tile) {
      const int64_t kb = tile / K, kv = tile % K;
      const int64_t t0 = kb * kKeyTile, t1 = std::min(t0 + kKeyTile, T);
      std::fill(mx.begin(), mx.end(), kNegInf);
      std::fill(sum.begin(), sum.end(), 0.0);
      int64_t d_end = t0;
      for (int64_t t = t0; t < t1; ++t)
        if (doc[t] >= 0) d_end = std::max(d_end, run_end[static_cast<size_t>(t)]);
      for (int64_t dq = t0 + w; dq < d_end; ++dq) {
        if (doc[dq] < 0) continue;
        for (int64_t t = t0; t < t1 && t + w <= dq; ++t) {
          if (doc[t] != doc[dq]) continue;
          const float* kt = kp + (t * K + kv) * hd;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = kv * G + g;
            const float* qd = qp + (dq * H + h) * hd;
            double dot = 0;
            for (int64_t x = 0; x < hd; ++x) dot += double(qd[x]) * kt[x];
            const double s = dot * scale - lp[dq * H + h];
            const size_t a = static_cast<size_t>((t - t0) * H + h);
            if (s > mx[a]) {
              sum[a] = sum[a] * std::exp(mx[a] - s) + 1.0;
              mx[a] = s;
            } else {
              sum[a] += std::exp(s - mx[a]);
            }
          }
        }
      }
      for (int64_t t = t0; t < t1; ++t) {
        double best = kNegInf;
        for (int64_t g = 0; g < G; ++g) {
          const size_t a = static_cast<size_t>((t - t0) * H + kv * G + g);
          if (sum[a] > 0) best = std::max(best, mx[a] + std::log(sum[a]));
        }
        log_m.data<float>()[kv * T + t] = static_cast<float>(best);
      }
    }
  }
  return log_m;
}

}  // namespace retain::cpu::kvpop
