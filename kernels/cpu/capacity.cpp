// CPU reference for the capacity sums and the capacity hinge of DESIGN §4 (formulas in
// docs/math.md, "Capacity"). One layer at a time, the T×T pair space is visited in 64×64
// tiles (queries t × keys i), skipping tiles above the diagonal, tiles whose blocks share no
// document, and tiles whose every term is below e^-E (E = the skip exponent, 60 by default:
// ops::kExactSkipExponent). Memory is
// O(T·K) per call besides the inputs and outputs. Every term is exp of a float32 exponent
// (t − i)·logβ ≤ 0, so it lies in [0, 1] and cannot overflow; sums run in float64. Each
// output row belongs to one OpenMP work item that visits its tiles in a fixed order, so the
// results do not depend on the thread count.
#include <cmath>
#include <vector>

#include "kernels/cpu/retention_cpu.h"

namespace retain::cpu {

namespace {

constexpr int64_t B = kRetentionBlock;

// A tile (query block qb, key block kb < qb) is skipped when (t − i)·logβ[i, κ] < −E for
// every pair in it: then each skipped forward term exp((t − i)·logβ) is < e^-E (8.8e-27 at the
// default E = 60) and each skipped backward term g·(t − i)·exp((t − i)·logβ) is < T·e^-E
// (g ≤ 1, t − i < T). A row has fewer than T skipped terms, so a capacity sum S ≥ 1 (its
// i = t term) changes by less than T·e^-E (3e-22 at T = 32768, E = 60), and a gradient entry
// by less than |scale|·T²·e^-E.
struct Layer {
  const float* log_beta;  // [Tk, K] of one layer: the keys'
  const int32_t* doc_q;   // [Tq]
  const int32_t* doc_k;   // [Tk]
  int64_t Tq, Tk, K;
  int64_t q0, k0;         // global index of the first query / key (0 for a whole sequence)
  double skip_exponent;   // E
  std::vector<DocRange> q_ranges, k_ranges;
  std::vector<float> block_max;  // per key block: max of logβ over its non-padding keys and κ

  // A whole sequence: queries and keys are the same T tokens.
  Layer(const float* lb, const int32_t* d, int64_t T, int64_t K_, double E) : Layer(lb, d, 0, T, d, 0, T, K_, E) {}
  // Queries [q0, q0 + Tq) of a sequence against its keys [k0, k0 + Tk) (context parallelism).
  Layer(const float* lb, const int32_t* dq, int64_t q0_, int64_t Tq_, const int32_t* dk, int64_t k0_, int64_t Tk_,
        int64_t K_, double E)
      : log_beta(lb), doc_q(dq), doc_k(dk), Tq(Tq_), Tk(Tk_), K(K_), q0(q0_), k0(k0_), skip_exponent(E) {
    q_ranges = block_doc_ranges(doc_q, Tq);
    k_ranges = block_doc_ranges(doc_k, Tk);
    block_max.assign(k_ranges.size(), -std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < Tk; ++i) {
      if (doc_k[i] < 0) continue;
      float& mx = block_max[static_cast<size_t>(i / B)];
      for (int64_t k = 0; k < K; ++k) mx = std::max(mx, log_beta[i * K + k]);
    }
  }
  int64_t q_blocks() const { return static_cast<int64_t>(q_ranges.size()); }
  int64_t k_blocks() const { return static_cast<int64_t>(k_ranges.size()); }

  // Tile (qb, kb) holds an allowed pair with a term above e^-E. Its smallest distance t − i
  // is the query block's first index − the key block's last (≥ 1 when the keys lie wholly
  // before; a short last key block only makes the true distance larger), and logβ ≤
  // block_max[kb] ≤ 0 for all its keys. A key block that starts after the query block's last
  // query holds no allowed pair (causal).
  bool tile_matters(int64_t qb, int64_t kb) const {
    if (!blocks_may_meet(q_ranges[qb], k_ranges[kb])) return false;
    const int64_t first_t = q0 + qb * B, last_t = q0 + std::min(Tq, qb * B + B) - 1;
    const int64_t first_i = k0 + kb * B, last_i = k0 + kb * B + B - 1;
    if (first_i > last_t) return false;
    if (first_t <= last_i) return true;
    const double min_distance = static_cast<double>(first_t - last_i);
    return !(min_distance * block_max[kb] < -skip_exponent);
  }
};

// S[t·K + κ] (+)= Σ_{allowed i of the key span} exp((t − i)·logβ[i, κ]) for one layer, the
// i = t term 1 (padding rows get nothing). `add`: added to S, else S is overwritten.
void layer_sums(const Layer& L, double* S, bool add = false) {
  const int64_t T = L.Tq, Tk = L.Tk, K = L.K, nb = L.q_blocks(), nkb = L.k_blocks();
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t qb = nb - 1; qb >= 0; --qb) {
    const int64_t t0 = qb * B, t1 = std::min(T, t0 + B);
    if (!add)
      for (int64_t x = t0 * K; x < t1 * K; ++x) S[x] = 0.0;
    for (int64_t kb = 0; kb < nkb; ++kb) {
      if (!L.tile_matters(qb, kb)) continue;
      const int64_t i0 = kb * B, i1 = std::min(Tk, i0 + B);
      for (int64_t t = t0; t < t1; ++t) {
        const int32_t dt = L.doc_q[t];
        if (dt < 0) continue;
        const int64_t tg = L.q0 + t;  // global index
        double* st = S + t * K;
        // i < t; the i = t term is added below
        for (int64_t i = i0; i < std::min(i1, tg - L.k0); ++i) {
          if (L.doc_k[i] != dt) continue;
          const float x = static_cast<float>(tg - (L.k0 + i));
          const float* lb = L.log_beta + i * K;
          for (int64_t k = 0; k < K; ++k) st[k] += exp_or_zero(x * lb[k]);
        }
        if (tg - L.k0 >= i0 && tg - L.k0 < i1)
          for (int64_t k = 0; k < K; ++k) st[k] += 1.0;  // exp(0·logβ) = 1, even for logβ = −inf
      }
    }
  }
}

// acc[i·K + κ] = Σ_{allowed t > i} g[t·K + κ]·(t − i)·exp((t − i)·logβ[i, κ]) for one layer's
// key span, g (rows of the query span) being ∂(Σℓ)/∂S (0 where the hinge is flat). The i = t
// term has factor t − i = 0. `sink(i0, n, acc)` takes each key block's n rows.
template <typename Sink>
void layer_backward_blocks(const Layer& L, const double* g, Sink sink) {
  const int64_t T = L.Tq, Tk = L.Tk, K = L.K, nb = L.q_blocks(), nkb = L.k_blocks();
  std::vector<char> g_any(static_cast<size_t>(nb), 0);  // query blocks with some g ≠ 0
  for (int64_t x = 0; x < T * K; ++x)
    if (g[x] != 0.0) g_any[static_cast<size_t>(x / K / B)] = 1;
#pragma omp parallel
  {
    std::vector<double> acc(static_cast<size_t>(B * K));
#pragma omp for schedule(dynamic, 1)
    for (int64_t kb = 0; kb < nkb; ++kb) {
      const int64_t i0 = kb * B, i1 = std::min(Tk, i0 + B);
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t qb = 0; qb < nb; ++qb) {
        if (!g_any[qb] || !L.tile_matters(qb, kb)) continue;
        const int64_t t1 = std::min(T, qb * B + B);
        for (int64_t i = i0; i < i1; ++i) {
          const int32_t di = L.doc_k[i];
          if (di < 0) continue;
          const int64_t ig = L.k0 + i;  // global index
          const float* lb = L.log_beta + i * K;
          double* ai = acc.data() + (i - i0) * K;
          for (int64_t t = std::max(qb * B, ig + 1 - L.q0); t < t1; ++t) {
            if (L.doc_q[t] != di) continue;
            const float x = static_cast<float>(L.q0 + t - ig);
            const double* gt = g + t * K;
            for (int64_t k = 0; k < K; ++k)
              if (gt[k] != 0.0) ai[k] += gt[k] * x * exp_or_zero(x * lb[k]);
          }
        }
      }
      sink(i0, i1 - i0, acc.data());
    }
  }
}

// dlb[i·K + κ] = scale · the sum above, for a whole sequence.
void layer_backward(const Layer& L, const std::vector<double>& g, double scale, float* dlb) {
  const int64_t K = L.K;
  layer_backward_blocks(L, g.data(), [&](int64_t i0, int64_t n, const double* acc) {
    for (int64_t x = 0; x < n * K; ++x) dlb[i0 * K + x] = static_cast<float>(scale * acc[x]);
  });
}

struct Dims {
  int64_t L, T, K;
};
Dims dims(const Tensor& log_beta) { return {log_beta.dim(0), log_beta.dim(1), log_beta.dim(2)}; }

// Counts a hinge value into the loss: Σℓ and #{ℓ > 0} (ℓ = 0 adds nothing).
void add_positive(ops::CapacityLoss& loss, double ell) {
  if (ell > 0) {
    loss.sum += ell;
    ++loss.positive;
  }
}

// Local hinge of one (l, t, κ): ℓ = max(0, (S − M)/max(p − M, 1)); dℓ/dS = 1/max(p − M, 1) where ℓ > 0.
double local_denominator(int32_t p, double M) { return std::max(static_cast<double>(p) - M, 1.0); }
// Global hinge of one t: ℓ = max(0, (ΣS − M·N)/max(p·N − M·N, 1)).
double global_denominator(int32_t p, double M, double N) { return std::max(static_cast<double>(p) * N - M * N, 1.0); }

// Σ_{l, κ} S[l, t, κ] for every t (float64).
std::vector<double> total_sums(const Tensor& log_beta, const Tensor& doc, double E) {
  const auto [L, T, K] = dims(log_beta);
  std::vector<double> S(static_cast<size_t>(T * K)), total(static_cast<size_t>(T), 0.0);
  for (int64_t l = 0; l < L; ++l) {
    layer_sums(Layer(log_beta.data<float>() + l * T * K, doc.data<int32_t>(), T, K, E), S.data());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) total[t] += S[t * K + k];
  }
  return total;
}

}  // namespace

void capacity_sums(const Tensor& log_beta, const Tensor& doc, Tensor& S, double E) {
  const auto [L, T, K] = dims(log_beta);
  std::vector<double> layer(static_cast<size_t>(T * K));
  for (int64_t l = 0; l < L; ++l) {
    layer_sums(Layer(log_beta.data<float>() + l * T * K, doc.data<int32_t>(), T, K, E), layer.data());
    float* out = S.data<float>() + l * T * K;
    for (int64_t x = 0; x < T * K; ++x) out[x] = static_cast<float>(layer[x]);
  }
}

ops::CapacityLoss capacity_loss(const Tensor& log_beta, const Tensor& doc, const Tensor& positions, double memory,
                                ops::CapacityMode mode, double E) {
  const auto [L, T, K] = dims(log_beta);
  const int32_t* dc = doc.data<int32_t>();
  const int32_t* pos = positions.data<int32_t>();
  const double M = memory;
  ops::CapacityLoss loss;
  auto add = [&](double ell) { add_positive(loss, ell); };
  if (mode == ops::CapacityMode::local) {
    std::vector<double> S(static_cast<size_t>(T * K));
    for (int64_t l = 0; l < L; ++l) {
      layer_sums(Layer(log_beta.data<float>() + l * T * K, dc, T, K, E), S.data());
      for (int64_t t = 0; t < T; ++t) {
        if (dc[t] < 0) continue;
        for (int64_t k = 0; k < K; ++k) add((S[t * K + k] - M) / local_denominator(pos[t], M));
      }
    }
  } else {
    const double N = static_cast<double>(L * K);
    const std::vector<double> total = total_sums(log_beta, doc, E);
    for (int64_t t = 0; t < T; ++t)
      if (dc[t] >= 0) add((total[t] - M * N) / global_denominator(pos[t], M, N));
  }
  return loss;
}

void capacity_loss_backward(const Tensor& log_beta, const Tensor& doc, const Tensor& positions, double memory,
                            ops::CapacityMode mode, double scale, Tensor& dlog_beta, double E) {
  const auto [L, T, K] = dims(log_beta);
  const int32_t* dc = doc.data<int32_t>();
  const int32_t* pos = positions.data<int32_t>();
  const double M = memory;
  std::vector<double> g(static_cast<size_t>(T * K), 0.0);
  if (mode == ops::CapacityMode::global) {
    // The same ∂ℓ_t/∂S[l, t, κ] for every (l, κ).
    const double N = static_cast<double>(L * K);
    const std::vector<double> total = total_sums(log_beta, doc, E);
    for (int64_t t = 0; t < T; ++t) {
      if (dc[t] < 0 || !(total[t] - M * N > 0)) continue;
      for (int64_t k = 0; k < K; ++k) g[t * K + k] = 1.0 / global_denominator(pos[t], M, N);
    }
  }
  std::vector<double> S(mode == ops::CapacityMode::local ? static_cast<size_t>(T * K) : 0);
  for (int64_t l = 0; l < L; ++l) {
    const Layer layer(log_beta.data<float>() + l * T * K, dc, T, K, E);
    if (mode == ops::CapacityMode::local) {
      layer_sums(layer, S.data());
      for (int64_t t = 0; t < T; ++t)
        for (int64_t k = 0; k < K; ++k)
          g[t * K + k] = (dc[t] >= 0 && S[t * K + k] - M > 0) ? 1.0 / local_denominator(pos[t], M) : 0.0;
    }
    layer_backward(layer, g, scale, dlog_beta.data<float>() + l * T * K);
  }
}

void capacity_sums_span(const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, const Tensor& q_doc,
                        int64_t q_start, Tensor& S, double E) {
  const int64_t L = log_beta.dim(0), Tk = log_beta.dim(1), K = log_beta.dim(2), Tq = q_doc.dim(0);
  for (int64_t l = 0; l < L; ++l)
    layer_sums(Layer(log_beta.data<float>() + l * Tk * K, q_doc.data<int32_t>(), q_start, Tq, k_doc.data<int32_t>(),
                     k_start, Tk, K, E),
               S.data<double>() + l * Tq * K, true);
}

void capacity_grad_span(const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, const Tensor& q_doc,
                        int64_t q_start, const Tensor& g, Tensor& dlog_beta, double E) {
  const int64_t L = log_beta.dim(0), Tk = log_beta.dim(1), K = log_beta.dim(2), Tq = q_doc.dim(0);
  for (int64_t l = 0; l < L; ++l) {
    double* dlb = dlog_beta.data<double>() + l * Tk * K;
    layer_backward_blocks(Layer(log_beta.data<float>() + l * Tk * K, q_doc.data<int32_t>(), q_start, Tq,
                                k_doc.data<int32_t>(), k_start, Tk, K, E),
                          g.data<double>() + l * Tq * K, [&](int64_t i0, int64_t n, const double* acc) {
                            for (int64_t x = 0; x < n * K; ++x) dlb[i0 * K + x] += acc[x];
                          });
  }
}

ops::CapacityLoss capacity_hinge(const Tensor& S, const Tensor& doc, const Tensor& positions, double memory,
                                 ops::CapacityMode mode, Tensor* g) {
  const int64_t L = S.dim(0), T = S.dim(1), K = S.dim(2);
  const double* s = S.data<double>();
  const int32_t* dc = doc.data<int32_t>();
  const int32_t* pos = positions.data<int32_t>();
  const double M = memory;
  double* gp = g ? g->data<double>() : nullptr;
  if (gp) std::fill(gp, gp + L * T * K, 0.0);
  ops::CapacityLoss loss;
  auto add = [&](double ell) { add_positive(loss, ell); };
  if (mode == ops::CapacityMode::local) {
    for (int64_t l = 0; l < L; ++l)
      for (int64_t t = 0; t < T; ++t) {
        if (dc[t] < 0) continue;
        for (int64_t k = 0; k < K; ++k) {
          const double x = s[(l * T + t) * K + k] - M;
          add(x / local_denominator(pos[t], M));
          if (gp && x > 0) gp[(l * T + t) * K + k] = 1.0 / local_denominator(pos[t], M);
        }
      }
    return loss;
  }
  const double N = static_cast<double>(L * K);
  for (int64_t t = 0; t < T; ++t) {
    if (dc[t] < 0) continue;
    double total = 0;  // in the order total_sums adds: layer by layer, κ within
    for (int64_t l = 0; l < L; ++l)
      for (int64_t k = 0; k < K; ++k) total += s[(l * T + t) * K + k];
    add((total - M * N) / global_denominator(pos[t], M, N));
    if (gp && total - M * N > 0)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t k = 0; k < K; ++k) gp[(l * T + t) * K + k] = 1.0 / global_denominator(pos[t], M, N);
  }
  return loss;
}

}  // namespace retain::cpu
