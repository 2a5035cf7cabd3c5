// CPU reference for causal, document-masked GQA softmax attention.
// One query row at a time: scores over the allowed keys (i ≤ t, same document) kept in a
// per-thread O(T) buffer, max-subtracted softmax with a float64 normalizer. O(T·d) memory.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/ops_cpu.h"

namespace retain::cpu {

void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& doc, float scale, Tensor& out) {
  const int64_t T = q.dim(0), H = q.dim(1), K = k.dim(1), d = q.dim(2), group = H / K;
  const float* qs = q.data<float>();
  const float* ks = k.data<float>();
  const float* vs = v.data<float>();
  const int32_t* docs = doc.data<int32_t>();
  float* os = out.data<float>();

#pragma omp parallel
  {
    std::vector<float> score(static_cast<size_t>(T));
    std::vector<double> acc(static_cast<size_t>(d));
#pragma omp for schedule(dynamic, 16) collapse(2)
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        float* o = os + (t * H + h) * d;
        if (docs[t] < 0) {  // padding attends nothing
          std::memset(o, 0, sizeof(float) * d);
          continue;
        }
        const int64_t kv = h / group;
        const float* qr = qs + (t * H + h) * d;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i <= t; ++i) {
          if (docs[i] != docs[t]) continue;
          const float* kr = ks + (i * K + kv) * d;
          float s = 0;
          for (int64_t j = 0; j < d; ++j) s += qr[j] * kr[j];
          score[i] = s * scale;
          mx = std::max(mx, score[i]);
        }
        double denom = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t i = 0; i <= t; ++i) {
          if (docs[i] != docs[t]) continue;
          const double p = std::exp(static_cast<double>(score[i] - mx));
          denom += p;
          const float* vr = vs + (i * K + kv) * d;
          for (int64_t j = 0; j < d; ++j) acc[j] += p * vr[j];
        }
        for (int64_t j = 0; j < d; ++j) o[j] = static_cast<float>(acc[j] / denom);
      }
    }
  }
}

}  // namespace retain::cpu
