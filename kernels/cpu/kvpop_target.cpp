// KVPOP future-attention targets (DESIGN §5) by a transposed pass: each 64-key tile walks the
// queries d ≥ t + w of its documents and keeps, per (key, query head), an online log-sum-exp of
// q_d·k_t·scale − lse_d (the log of the dense attention probability p_{d→t}). No T×T buffer;
// work O(Σ_docs len²·H·hd), like the attention.
//
// The sums are split by spans for context parallelism (kvpop::future_attention_sums): keys and
// queries at global token offsets, the running (max, sum) pairs kept by the caller between
// query spans. The whole-sequence target is one span of each, then the finish: the same loops.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/kvpop_cpu.h"

namespace retain::cpu::kvpop {

namespace {
constexpr int64_t kKeyTile = 64;
}

void future_attention_sums(const Tensor& q, const Tensor& lse, const int32_t* q_doc, int64_t q_start,
                           const Tensor& k, const int32_t* k_doc, int64_t k_start, int64_t w, float scale,
                           Tensor& mx, Tensor& sum) {
  const int64_t Tq = q.dim(0), H = q.dim(1), hd = q.dim(2), Tk = k.dim(0), K = k.dim(1), G = H / K;
  const float* qp = q.data<float>();
  const float* kp = k.data<float>();
  const float* lp = lse.data<float>();
  double* mxp = mx.data<double>();
  double* sump = sum.data<double>();
  const int64_t tiles = (Tk + kKeyTile - 1) / kKeyTile;
#pragma omp parallel for schedule(dynamic)
  for (int64_t tile = 0; tile < tiles * K; ++tile) {
    const int64_t kb = tile / K, kv = tile % K;
    const int64_t a0 = kb * kKeyTile, a1 = std::min(a0 + kKeyTile, Tk);  // the tile's rows of k
    const int64_t t0 = k_start + a0, t1 = k_start + a1;                  // ... as global tokens
    // A query after the tile can only share the document of its last key (documents are
    // contiguous runs): the walk ends at the first later query of another document.
    const int32_t last_doc = k_doc[a1 - 1];
    for (int64_t dq = std::max(q_start, t0 + w); dq < q_start + Tq; ++dq) {
      const int32_t dd = q_doc[dq - q_start];
      if (dq >= t1 && (last_doc < 0 || dd != last_doc)) break;
      if (dd < 0) continue;
      for (int64_t t = t0; t < t1 && t + w <= dq; ++t) {
        if (k_doc[t - k_start] != dd) continue;
        const float* kt = kp + ((t - k_start) * K + kv) * hd;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = kv * G + g;
          const float* qd = qp + ((dq - q_start) * H + h) * hd;
          double dot = 0;
          for (int64_t x = 0; x < hd; ++x) dot += double(qd[x]) * kt[x];
          const double s = dot * scale - lp[(dq - q_start) * H + h];
          const size_t a = static_cast<size_t>((t - k_start) * H + h);
          if (s > mxp[a]) {
            sump[a] = sump[a] * std::exp(mxp[a] - s) + 1.0;
            mxp[a] = s;
          } else {
            sump[a] += std::exp(s - mxp[a]);
          }
        }
      }
    }
  }
}

Tensor future_attention_finish(const Tensor& mx, const Tensor& sum, int64_t K) {
  const int64_t T = mx.dim(0), H = mx.dim(1), G = H / K;
  Tensor log_m = Tensor::empty({K, T}, DType::F32);
  const double* mxp = mx.data<double>();
  const double* sump = sum.data<double>();
  for (int64_t kv = 0; kv < K; ++kv)
    for (int64_t t = 0; t < T; ++t) {
      double best = -std::numeric_limits<double>::infinity();
      for (int64_t g = 0; g < G; ++g) {
        const size_t a = static_cast<size_t>(t * H + kv * G + g);
        if (sump[a] > 0) best = std::max(best, mxp[a] + std::log(sump[a]));
      }
      log_m.data<float>()[kv * T + t] = static_cast<float>(best);
    }
  return log_m;
}

std::pair<Tensor, Tensor> future_attention_start(int64_t T, int64_t H) {
  Tensor mx = Tensor::empty({T, H}, DType::F64), sum = Tensor::zeros({T, H}, DType::F64);
  std::fill(mx.data<double>(), mx.data<double>() + mx.numel(), -std::numeric_limits<double>::infinity());
  return {mx, sum};
}

Tensor future_attention_target(const Tensor& q, const Tensor& k, const Tensor& lse, const int32_t* doc,
                               int64_t w, float scale) {
  auto [mx, sum] = future_attention_start(q.dim(0), q.dim(1));
  future_attention_sums(q, lse, doc, 0, k, doc, 0, w, scale, mx, sum);
  return future_attention_finish(mx, sum, k.dim(1));
}

}  // namespace retain::cpu::kvpop
