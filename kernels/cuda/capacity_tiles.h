// The tile schedule and per-lane arithmetic of the CUDA capacity kernels (kernels/cuda/capacity.cu),
// written as __host__ __device__ functions so that tests/cuda/test_capacity_tiles.cpp can run
// the very same code on the CPU (a block emulated lane by lane) against the CPU reference in
// every CI build, GPU or not. Plain C++ when not compiled by nvcc.
//
// Layout. The T×T pair space of one layer is cut into kTile × kTile tiles (queries t × keys i).
// A CUDA block owns one tile row (sums: a query tile, all key tiles kb ≤ qb) or one tile column
// (backward: a key tile, all query tiles qb ≥ kb) for up to kHeadsPerBlock KV heads, one warp
// per head. A lane owns kRun = 4 consecutive rows (sums) or keys (backward): 32 lanes × 4 = 128.
//
// Accuracy. Every term exp((t − i)·logβ_i) lies in [0, 1] (logβ ≤ 0) and every backward term
// g_t·(t − i)·exp(...) is ≥ 0, so all sums are of non-negative terms, whose floating-point sum
// has relative error ≤ (n − 1)·u for n terms (u = 2^-24 in float32). A lane adds at most
// kPartial = 64 terms per row in float32 (≤ 63u = 3.8e-6 relative, worst case; ~√64·u typical)
// and then adds that partial into a float64 accumulator (the CPU sums in float64 throughout).
// Each term is computed as
//   e(t0) = exp2_ftz(fl((t0 − i)·lb2_i)),  lb2_i = fl(logβ_i·log2 e)   (one MUFU.EX2:
//           ≤ 2 ulp, results below 2^-126 flushed to 0; kernels/cuda/fast_exp2.h)
//   e(t0 + r) = e(t0 + r − 1)·β_i,  β_i = expf(logβ_i),  r = 1..3
// along the 4 consecutive rows of a run: 3 products, each adding ≤ 2 ulp (β) + 0.5 ulp
// (rounding), so a term carries ≤ 10 ulp (1.2e-6) of multiplicative error, plus the exponent's:
// the CPU rounds y = (t − i)·|logβ| once; here lb2's rounding and the product's round it
// twice and the recurrence once more, an exponent difference ≤ 3u·y, i.e. a relative term
// error ≤ 3u·y. Over a row of S the terms weigh e^-y, and the i = t term (y = 0, weight 1)
// bounds the weighted mean of y by ln T + 1 ≤ 18 for T < 2^24, so this adds ≤ 54u = 3.2e-6.
// Worst case ≤ 8.2e-6 relative on S, inside the tests' 1e-5; typical errors are ~1e-7.
// dlogβ has the same per-term bounds; only an entry whose terms all have y ≫ 18 (a steep key,
// gradient ~e^-y) can exceed them, by 3u·y, and such entries weigh nothing in a norm-wise
// comparison. The recurrence replaces three of every four exponentials by one FMUL, and the
// exponential is one MUFU.EX2 rather than expf's eight instructions (range reduction around
// the MUFU), which leaves the loops FMA-bound.
// The recurrence is only used off the diagonal (t0 − i ≥ 1), so logβ = −inf gives 0·0 = 0,
// never −inf·0 = NaN; diagonal tiles evaluate every term directly and add the i = t term as 1.
#pragma once
#include <cmath>
#include <cstdint>

#include "kernels/cuda/fast_exp2.h"
#include "kernels/cuda/host_device.h"

namespace retain::cuda::capacity {

inline constexpr int kTile = 128;          // rows per query tile = keys per key tile
inline constexpr int kRun = 4;             // consecutive rows (sums) / keys (backward) per lane
inline constexpr int kLanes = kTile / kRun;  // 32: one warp covers a tile edge
inline constexpr int kPartial = 64;        // terms per float32 partial before the float64 add
inline constexpr int kHeadsPerBlock = 8;   // warps per block, one KV head each
static_assert(kLanes == 32, "a warp must cover one tile edge");
static_assert(kTile % kPartial == 0 && kPartial % kRun == 0, "partials must split the tile evenly");

// Tiles whose every term is below e^-E are skipped, as on the CPU (kernels/cpu/capacity.cpp);
// E is the skip exponent, by default 60 (ops::kExactSkipExponent, kernels/retention.h): a row of
// S skips fewer than T terms, so S (≥ 1) changes by < T·e^-E (1.2e-21 at T = 131072, E = 60),
// and a gradient entry (terms g·x·e^{x·logβ}, g ≤ 1, x < T) by < |scale|·T²·e^-E.
inline constexpr double kNegligibleExponent = 60.0;

// Padding never matches: keys with doc < 0 are stored as kPadKey and rows as kPadRow, two
// different values that no real document id (≥ 0) equals.
inline constexpr int32_t kPadKey = -1;
inline constexpr int32_t kPadRow = -2;
RETAIN_HD int32_t key_doc(int32_t d) { return d < 0 ? kPadKey : d; }
RETAIN_HD int32_t row_doc(int32_t d) { return d < 0 ? kPadRow : d; }

RETAIN_HD int64_t tile_count(int64_t T) { return (T + kTile - 1) / kTile; }

// What the kernels stage per key for the exponentials: logβ·log2 e (−inf stays −inf: every
// staged key meets only rows t > i, so its terms are exp2(−inf) = 0, never 0·−inf).
RETAIN_HD float staged_lb2(float log_beta) { return log_beta * kLog2e; }

// The document ids among the non-padding tokens of a tile, as [lo, hi], like cpu::DocRange:
// two tiles can hold an allowed pair only if their ranges intersect (any document layout).
struct TileDocs {
  int32_t lo;      // INT32_MAX when the tile has no non-padding token
  int32_t hi;      // INT32_MIN then
  int32_t padded;  // 1: some token is padding or the tile is the short last one
};

RETAIN_HD bool tile_empty(const TileDocs& a) { return a.lo > a.hi; }
RETAIN_HD bool tiles_may_meet(const TileDocs& a, const TileDocs& b) {
  return !tile_empty(a) && !tile_empty(b) && a.lo <= b.hi && b.lo <= a.hi;
}
// Every pair (t, i) of tile (qb, kb) shares one document: no per-pair document mask needed.
RETAIN_HD bool tile_one_document(const TileDocs& q, const TileDocs& k) {
  return !q.padded && !k.padded && q.lo == q.hi && k.lo == k.hi && q.lo == k.lo;
}

// Tile (qb, kb < qb) holds no term above e^-E for a head whose keys in kb have
// logβ ≤ key_max ≤ 0: its smallest distance t − i is qb·kTile − (kb·kTile + kTile − 1) ≥ 1
// (a short last key tile only makes distances larger). Monotone in qb: once true for some qb
// it stays true for every later query tile (the backward stops there).
RETAIN_HD bool tile_negligible_at(int64_t min_distance, float key_max, double exponent = kNegligibleExponent) {
  return static_cast<double>(min_distance) * static_cast<double>(key_max) < -exponent;
}
RETAIN_HD bool tile_negligible(int64_t qb, int64_t kb, float key_max, double exponent = kNegligibleExponent) {
  if (qb <= kb) return false;
  return tile_negligible_at(qb * kTile - (kb * kTile + kTile - 1), key_max, exponent);
}
// The same for a rectangle (context parallelism, kernels/retention_spans.h): query tile qb of a
// span whose positions are `gap` past those of a wholly earlier key span's tiles (every
// distance ≥ 1, also for qb ≤ kb). Monotone in qb as tile_negligible is.
RETAIN_HD bool rect_tile_negligible(int64_t gap, int64_t qb, int64_t kb, float key_max,
                                    double exponent = kNegligibleExponent) {
  return tile_negligible_at(gap + qb * kTile - (kb * kTile + kTile - 1), key_max, exponent);
}

// ---- sums: one lane, kRun rows t0 .. t0+3, one key tile of n keys starting at i0 ----------
// lb2, beta, kdoc: the key tile in shared memory (lb2 = staged_lb2(logβ), beta = expf(logβ),
// kdoc = key_doc(doc));
// rdoc: row_doc of the lane's rows (kPadRow for rows ≥ T); acc: float64 sums of the rows.
// Off the diagonal (every i < t0) with one document: no masks.
// kOneDocument: every pair shares one document (no per-term test; one instance per case).
template <bool kOneDocument>
RETAIN_HD void lane_sums_partials(const float* lb2, const float* beta, const int32_t* kdoc, int64_t i0, int n,
                                  int64_t t0, const int32_t* rdoc, double* acc) {
  for (int c = 0; c < n; c += kPartial) {
    float p[kRun] = {0, 0, 0, 0};
    const int end = c + kPartial < n ? c + kPartial : n;
    // x0 = t0 − (i0 + j) ≥ 1, counted down in float32: integers below 2^24 are exact, and
    // this avoids an int64 → float conversion per key.
    float x0 = static_cast<float>(t0 - i0 - c);
    for (int j = c; j < end; ++j, x0 -= 1.0f) {
      const float b = beta[j];
      float e = exp2_ftz(x0 * lb2[j]);
      const int32_t d = kdoc[j];
      for (int r = 0; r < kRun; ++r) {
        p[r] += kOneDocument || rdoc[r] == d ? e : 0.0f;
        e *= b;
      }
    }
    for (int r = 0; r < kRun; ++r) acc[r] += static_cast<double>(p[r]);
  }
}
RETAIN_HD void lane_sums_off_diagonal(const float* lb2, const float* beta, const int32_t* kdoc, int64_t i0,
                                          int n, int64_t t0, const int32_t* rdoc, bool one_document,
                                          double* acc) {
  if (one_document)
    lane_sums_partials<true>(lb2, beta, kdoc, i0, n, t0, rdoc, acc);
  else
    lane_sums_partials<false>(lb2, beta, kdoc, i0, n, t0, rdoc, acc);
}

// The diagonal tile (keys i0 .. i0+n−1 cover the lane's rows): pairs i < t evaluated directly.
RETAIN_HD void lane_sums_diagonal(const float* lb2, const int32_t* kdoc, int64_t i0, int n, int64_t t0,
                                      const int32_t* rdoc, double* acc) {
  for (int c = 0; c < n; c += kPartial) {
    float p[kRun] = {0, 0, 0, 0};
    const int end = c + kPartial < n ? c + kPartial : n;
    for (int j = c; j < end; ++j) {
      const int64_t i = i0 + j;
      for (int r = 0; r < kRun; ++r) {
        const int64_t t = t0 + r;
        if (i < t && rdoc[r] == kdoc[j]) p[r] += exp2_ftz(static_cast<float>(t - i) * lb2[j]);
      }
    }
    for (int r = 0; r < kRun; ++r) acc[r] += static_cast<double>(p[r]);
  }
}

// The i = t term of every non-padding row: exactly 1 (exp(0·logβ), also for logβ = −inf).
// Added once per row after the key loop, so that no tile skip can lose it.
RETAIN_HD void lane_self_terms(const int32_t* rdoc, double* acc) {
  for (int r = 0; r < kRun; ++r)
    if (rdoc[r] >= 0) acc[r] += 1.0;
}

// ---- backward: one lane, kRun keys i0 .. i0+3, one query tile of n rows starting at t0 -----
// Adds Σ_t g_t·(t − i)·exp((t − i)·logβ_i) over the tile's rows t > i with doc_t == doc_i.
// g, rdoc: the query tile in shared memory (g = 0 and rdoc = kPadRow beyond T); lb2 (staged_lb2),
// beta, kdoc: the lane's keys (kdoc = kPadKey for keys ≥ T). Off the diagonal every t > every i.
// kOneDocument: every pair shares one document (no per-term test; one instance per case).
template <bool kOneDocument>
RETAIN_HD void lane_grads_partials(const float* g, const int32_t* rdoc, int64_t t0, int n, int64_t i0,
                                   const float* lb2, const float* beta, const int32_t* kdoc, double* acc) {
  for (int c = 0; c < n; c += kPartial) {
    float p[kRun] = {0, 0, 0, 0};
    const int end = c + kPartial < n ? c + kPartial : n;
    const float base = static_cast<float>(t0 - i0 + c);  // t0 + s − i0 at s = c, exact (< 2^24)
    for (int s = c; s < end; s += kRun) {  // kRun consecutive rows: one exponential, then products
      for (int j = 0; j < kRun; ++j) {
        float x = base + static_cast<float>(s - c - j);  // t0 + s − (i0 + j) ≥ 1, exact
        float e = exp2_ftz(x * lb2[j]);
        for (int r = 0; r < kRun && s + r < end; ++r) {
          const float gr = kOneDocument || rdoc[s + r] == kdoc[j] ? g[s + r] : 0.0f;
          p[j] += (gr * x) * e;
          x += 1.0f;
          e *= beta[j];
        }
      }
    }
    for (int j = 0; j < kRun; ++j) acc[j] += static_cast<double>(p[j]);
  }
}
RETAIN_HD void lane_grads_off_diagonal(const float* g, const int32_t* rdoc, int64_t t0, int n, int64_t i0,
                                           const float* lb2, const float* beta, const int32_t* kdoc,
                                           bool one_document, double* acc) {
  if (one_document)
    lane_grads_partials<true>(g, rdoc, t0, n, i0, lb2, beta, kdoc, acc);
  else
    lane_grads_partials<false>(g, rdoc, t0, n, i0, lb2, beta, kdoc, acc);
}

// The diagonal tile: pairs t > i evaluated directly (the t = i term has factor t − i = 0).
RETAIN_HD void lane_grads_diagonal(const float* g, const int32_t* rdoc, int64_t t0, int n, int64_t i0,
                                       const float* lb2, const int32_t* kdoc, double* acc) {
  for (int c = 0; c < n; c += kPartial) {
    float p[kRun] = {0, 0, 0, 0};
    const int end = c + kPartial < n ? c + kPartial : n;
    for (int s = c; s < end; ++s) {
      const int64_t t = t0 + s;
      for (int j = 0; j < kRun; ++j) {
        const int64_t i = i0 + j;
        if (t > i && rdoc[s] == kdoc[j]) {
          const float x = static_cast<float>(t - i);
          p[j] += (g[s] * x) * exp2_ftz(x * lb2[j]);
        }
      }
    }
    for (int j = 0; j < kRun; ++j) acc[j] += static_cast<double>(p[j]);
  }
}

// ---- the hinge of DESIGN §4 (float64, as the CPU) ------------------------------------------
RETAIN_HD double local_denominator(int32_t p, double M) {
  const double d = static_cast<double>(p) - M;
  return d > 1.0 ? d : 1.0;
}
RETAIN_HD double global_denominator(int32_t p, double M, double N) {
  const double d = static_cast<double>(p) * N - M * N;
  return d > 1.0 ? d : 1.0;
}
// ℓ = max(0, (S − M)/den); 0 where the hinge is flat (S ≤ M).
RETAIN_HD double hinge(double excess, double denominator) { return excess > 0 ? excess / denominator : 0.0; }
// ∂ℓ/∂S: 1/den where S > M, else 0 (at S = M exactly the gradient is taken as 0, as on the CPU).
RETAIN_HD double hinge_slope(double excess, double denominator) { return excess > 0 ? 1.0 / denominator : 0.0; }

}  // namespace retain::cuda::capacity
