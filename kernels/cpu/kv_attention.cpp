// Attention over a bounded KV cache, CPU reference: one score row per (query, head), softmax
// normalizer in float64 (as cpu/attention.cpp). Parallel over KV heads and queries; the
// accumulated attention of a KV head is summed by the one thread that owns that head, in a
// fixed order, so results do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/kv_attention_cpu.h"

namespace retain::cpu {

void kv_attention(const Tensor& q, const Tensor& q_pos, const Tensor& keys, const Tensor& values,
                  const Tensor& key_pos, const Tensor& lens, float scale, Tensor& out, Tensor* attn_sum) {
  const int64_t T = q.dim(0), H = q.dim(1), d = q.dim(2), K = keys.dim(0), C = keys.dim(1), G = H / K;
  const float* qp = q.data<float>();
  const int32_t* qpos = q_pos.data<int32_t>();
  const float* kp = keys.data<float>();
  const float* vp = values.data<float>();
  const int32_t* kpos = key_pos.data<int32_t>();
  const int32_t* len = lens.data<int32_t>();
  float* op = out.data<float>();
  float* acc = attn_sum ? attn_sum->data<float>() : nullptr;

  // Without accumulation every (t, h) row is independent; with it, a head's rows run in order
  // on one thread (the sums are then deterministic).
  const int64_t outer = acc ? K : T * H;
#pragma omp parallel for schedule(dynamic, 1) if (outer > 1)
  for (int64_t o = 0; o < outer; ++o) {
    std::vector<double> p;
    auto row = [&](int64_t t, int64_t h) {
      const int64_t kh = h / G, n = len[kh];
      const float* qv = qp + (t * H + h) * d;
      const float* kb = kp + kh * C * d;
      const float* vb = vp + kh * C * d;
      const int32_t* pb = kpos + kh * C;
      p.assign(static_cast<size_t>(n), 0.0);
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        if (pb[j] > qpos[t]) continue;
        float s = 0.f;
        for (int64_t e = 0; e < d; ++e) s += qv[e] * kb[j * d + e];
        p[j] = static_cast<double>(s * scale);
        mx = std::max(mx, p[j]);
      }
      float* ov = op + (t * H + h) * d;
      std::fill(ov, ov + d, 0.f);
      if (mx == -std::numeric_limits<double>::infinity()) return;
      double z = 0.0;
      for (int64_t j = 0; j < n; ++j) {
        p[j] = pb[j] > qpos[t] ? 0.0 : std::exp(p[j] - mx);
        z += p[j];
      }
      std::vector<double> o(static_cast<size_t>(d), 0.0);
      for (int64_t j = 0; j < n; ++j) {
        if (p[j] == 0.0) continue;
        p[j] /= z;
        for (int64_t e = 0; e < d; ++e) o[e] += p[j] * vb[j * d + e];
        if (acc) acc[kh * C + j] += static_cast<float>(p[j]);
      }
      for (int64_t e = 0; e < d; ++e) ov[e] = static_cast<float>(o[e]);
    };
    if (acc) {
      for (int64_t t = 0; t < T; ++t)
        for (int64_t g = 0; g < G; ++g) row(t, o * G + g);
    } else {
      row(o / H, o % H);
    }
  }
}

}  // namespace retain::cpu
