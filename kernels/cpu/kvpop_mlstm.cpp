// KVPOP stabilized mLSTM with per-document resets and the delayed readout (DESIGN §5),
// chunkwise-parallel, forward and backward. docs/math.md "KVPOP" derives the scheme:
//   F_t  = Σ_{j ≤ t in t's run} log f_j, m_t by the recurrence m_t = max(log f_t + m_{t−1}, ĩ_t)
//   (m = 0 before a run), a_{t,s} = exp(F_t − F_s + ĩ_s − m_t) ≤ 1, and the stabilized state
//   C_t = Σ_{s ≤ t in run} a_{t,s} k̃_s ṽ_sᵀ, n_t = Σ a_{t,s} k̃_s — the recurrence unrolled.
// A readout time t (u = t − w + 1 scored) uses Q_t = q̃_u/√d; C_t is the previous chunk end's
// state e rescaled by exp(F_t − F_e + m_e − m_t) ≤ 1 plus the intra-chunk sum over s ∈ (e, t].
// Chunk-end states are a sequential pass over chunks; the readouts are parallel over chunks.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/kvpop_cpu.h"

namespace retain::cpu::kvpop {

namespace {

constexpr int64_t kChunk = 64;

// Everything per token that the forward and the backward share, in float64.
struct Scan {
  int64_t T = 0, d = 0, r = 0, w = 0;
  std::vector<int64_t> start;  // first token of t's run (padding: t itself)
  std::vector<double> F, m;    // cumulative log f in the run; the stabilizer
  std::vector<char> forget_branch;  // m_t took log f_t + m_{t−1} (else ĩ_t)
  std::vector<char> readout;   // t reads out u = t − w + 1
};

Scan make_scan(const Projected& P, const int32_t* doc, int64_t w) {
  Scan s;
  s.T = P.q.dim(0);
  s.d = P.q.dim(1);
  s.r = P.v.dim(1);
  s.w = w;
  const auto T = static_cast<size_t>(s.T);
  s.start.resize(T);
  s.F.assign(T, 0.0);
  s.m.assign(T, 0.0);
  s.forget_branch.assign(T, 0);
  s.readout.assign(T, 0);
  const float* lf = P.log_f.data<float>();
  const float* ig = P.igate.data<float>();
  for (int64_t t = 0; t < s.T; ++t) {
    const bool first = t == 0 || doc[t] != doc[t - 1] || doc[t] < 0;
    s.start[static_cast<size_t>(t)] = first ? t : s.start[static_cast<size_t>(t - 1)];
    if (doc[t] < 0) continue;
    const double F_prev = first ? 0.0 : s.F[static_cast<size_t>(t - 1)];
    const double m_prev = first ? 0.0 : s.m[static_cast<size_t>(t - 1)];
    s.F[static_cast<size_t>(t)] = F_prev + lf[t];
    const double keep = lf[t] + m_prev;
    s.forget_branch[static_cast<size_t>(t)] = keep >= ig[t];
    s.m[static_cast<size_t>(t)] = std::max(keep, double(ig[t]));
    const int64_t u = t - w + 1;
    s.readout[static_cast<size_t>(t)] = u >= 0 && u >= s.start[static_cast<size_t>(t)];
  }
  return s;
}

// Chunk c's last token.
int64_t chunk_end(const Scan& s, int64_t c) { return std::min((c + 1) * kChunk, s.T) - 1; }

// s and t lie in one (non-padding) run.
bool same_run(const Scan& s, const int32_t* doc, int64_t a, int64_t b) {
  return doc[a] >= 0 && s.start[static_cast<size_t>(a)] == s.start[static_cast<size_t>(b)];
}

// What token t inherits from the chunks before its own: the previous chunk's state C, n (null
// when t's run starts inside its chunk) and the factor exp(F_t − F_ep + m_ep − m_t) that carries
// it, stabilized, from that chunk's last token ep to t.
struct Carried {
  double g = 0;
  const double* C = nullptr;
  const double* n = nullptr;
};
Carried carried(const Scan& s, const int32_t* doc, const std::vector<double>& C, const std::vector<double>& n,
                int64_t t) {
  const int64_t c = t / kChunk, ep = c * kChunk - 1;
  if (c == 0 || !same_run(s, doc, ep, t)) return {};
  const auto ti = static_cast<size_t>(t), ei = static_cast<size_t>(ep);
  return {std::exp(s.F[ti] - s.F[ei] + s.m[ei] - s.m[ti]), C.data() + (c - 1) * s.d * s.r, n.data() + (c - 1) * s.d};
}

double a_weight(const Scan& s, const float* ig, int64_t t, int64_t j) {
  const auto ti = static_cast<size_t>(t), ji = static_cast<size_t>(j);
  return std::exp(s.F[ti] - s.F[ji] + ig[j] - s.m[ti]);
}

// Stabilized state after each chunk's last token e: C [d·r] and n [d] per chunk (zero when e is
// padding). O((T/64)·d·r) memory.
void chunk_states(const Scan& s, const Projected& P, const int32_t* doc, std::vector<double>& C,
                  std::vector<double>& n) {
  const int64_t nc = (s.T + kChunk - 1) / kChunk, d = s.d, r = s.r;
  C.assign(static_cast<size_t>(nc * d * r), 0.0);
  n.assign(static_cast<size_t>(nc * d), 0.0);
  const float* ig = P.igate.data<float>();
  for (int64_t c = 0; c < nc; ++c) {
    const int64_t c0 = c * kChunk, e = chunk_end(s, c);
    if (doc[e] < 0) continue;
    double* Ce = C.data() + c * d * r;
    double* ne = n.data() + c * d;
    if (const Carried prev = carried(s, doc, C, n, e); prev.C) {
      for (int64_t x = 0; x < d * r; ++x) Ce[x] = prev.g * prev.C[x];
      for (int64_t x = 0; x < d; ++x) ne[x] = prev.g * prev.n[x];
    }
    for (int64_t j = std::max(c0, s.start[static_cast<size_t>(e)]); j <= e; ++j) {
      const double a = a_weight(s, ig, e, j);
      const float* kj = P.k.data<float>() + j * d;
      const float* vj = P.v.data<float>() + j * r;
      for (int64_t x = 0; x < d; ++x) {
        const double ak = a * kj[x];
        ne[x] += ak;
        for (int64_t y = 0; y < r; ++y) Ce[x * r + y] += ak * vj[y];
      }
    }
  }
}

// The readout at t: num [r] = C_tᵀ Q, den = n_tᵀ Q, from the previous chunk's state (if in t's
// run) and the intra-chunk terms. Q [d] = q̂_u.
void readout_sums(const Scan& s, const Projected& P, const int32_t* doc, const std::vector<double>& C,
                  const std::vector<double>& n, int64_t t, const double* Q, double* num, double& den) {
  const int64_t d = s.d, r = s.r, c = t / kChunk, c0 = c * kChunk;
  const float* ig = P.igate.data<float>();
  std::fill(num, num + r, 0.0);
  den = 0;
  if (const Carried prev = carried(s, doc, C, n, t); prev.C) {
    for (int64_t x = 0; x < d; ++x) {
      const double gq = prev.g * Q[x];
      den += gq * prev.n[x];
      for (int64_t y = 0; y < r; ++y) num[y] += gq * prev.C[x * r + y];
    }
  }
  for (int64_t j = std::max(c0, s.start[static_cast<size_t>(t)]); j <= t; ++j) {
    const float* kj = P.k.data<float>() + j * d;
    double z = 0;
    for (int64_t x = 0; x < d; ++x) z += kj[x] * Q[x];
    const double az = a_weight(s, ig, t, j) * z;
    den += az;
    const float* vj = P.v.data<float>() + j * r;
    for (int64_t y = 0; y < r; ++y) num[y] += az * vj[y];
  }
}

void load_query(const Projected& P, int64_t u, int64_t d, double* Q) {
  const double inv = 1.0 / std::sqrt(double(d));
  const float* qu = P.q.data<float>() + u * d;
  for (int64_t x = 0; x < d; ++x) Q[x] = qu[x] * inv;
}

double silu(double x) { return x / (1 + std::exp(-x)); }
double silu_grad(double x) {
  const double sg = 1 / (1 + std::exp(-x));
  return sg * (1 + x * (1 - sg));
}

}  // namespace

Tensor mlstm_scores(const Projected& P, const int32_t* doc, int64_t w, const Tensor& w_o, float b_o) {
  const Scan s = make_scan(P, doc, w);
  std::vector<double> C, n;
  chunk_states(s, P, doc, C, n);
  Tensor score = Tensor::zeros({s.T}, DType::F32);
  const float* wo = w_o.data<float>();
#pragma omp parallel
  {
    std::vector<double> Q(static_cast<size_t>(s.d)), num(static_cast<size_t>(s.r));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < s.T; ++t) {
      if (!s.readout[static_cast<size_t>(t)]) continue;
      const int64_t u = t - w + 1;
      load_query(P, u, s.d, Q.data());
      double den;
      readout_sums(s, P, doc, C, n, t, Q.data(), num.data(), den);
      const double M = std::max(std::abs(den), std::exp(-s.m[static_cast<size_t>(t)]));
      double out = b_o;
      for (int64_t y = 0; y < s.r; ++y) out += wo[y] * silu(num[static_cast<size_t>(y)] / (M + retain::kvpop::kReadoutEps));
      score.data<float>()[u] = static_cast<float>(out);
    }
  }
  return score;
}

Projected mlstm_scores_backward(const Projected& P, const int32_t* doc, int64_t w, const Tensor& w_o,
                                float /*b_o*/, const Tensor& dscore, Tensor& dw_o, Tensor& db_o) {
  const Scan s = make_scan(P, doc, w);
  const int64_t T = s.T, d = s.d, r = s.r, nc = (T + kChunk - 1) / kChunk;
  const auto Ts = static_cast<size_t>(T);
  std::vector<double> C, n;
  chunk_states(s, P, doc, C, n);
  const float* wo = w_o.data<float>();
  const float* ig = P.igate.data<float>();
  const double eps = retain::kvpop::kReadoutEps, inv_sqrt_d = 1.0 / std::sqrt(double(d));

  // Pass 1 (parallel over readouts): recompute h_t, then the gradients into num, den and the
  // readout's own log-weight terms. gnum [T·r], gden [T]; gF, gm [T] (t side).
  std::vector<double> gnum(Ts * static_cast<size_t>(r), 0.0), gden(Ts, 0.0), gF(Ts, 0.0), gm(Ts, 0.0);
  std::vector<double> dwo_parts(Ts * static_cast<size_t>(r), 0.0), dbo_parts(Ts, 0.0);
  std::vector<double> dQ(Ts * static_cast<size_t>(d), 0.0);  // per readout t (= per u)
#pragma omp parallel
  {
    std::vector<double> Q(static_cast<size_t>(d)), num(static_cast<size_t>(r));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      if (!s.readout[static_cast<size_t>(t)]) continue;
      const int64_t u = t - w + 1;
      const double ds = dscore.data<float>()[u];
      load_query(P, u, d, Q.data());
      double den;
      readout_sums(s, P, doc, C, n, t, Q.data(), num.data(), den);
      const double em = std::exp(-s.m[static_cast<size_t>(t)]);
      const bool den_branch = std::abs(den) >= em;
      const double M = den_branch ? std::abs(den) : em, D = M + eps;
      double gh_dot_h = 0, R = 0;
      double* gn = gnum.data() + t * r;
      for (int64_t y = 0; y < r; ++y) {
        const double h = num[static_cast<size_t>(y)] / D;
        dwo_parts[static_cast<size_t>(t * r + y)] = ds * silu(h);
        const double gh = ds * wo[y] * silu_grad(h);
        gh_dot_h += gh * h;
        gn[y] = gh / D;
        R += gn[y] * num[static_cast<size_t>(y)];
      }
      dbo_parts[static_cast<size_t>(t)] = ds;
      const double gM = -gh_dot_h / D;
      gden[static_cast<size_t>(t)] = den_branch ? gM * (den >= 0 ? 1.0 : -1.0) : 0.0;
      R += gden[static_cast<size_t>(t)] * den;
      // num and den are sums of a_{t,s}(...), ∂ log a_{t,s} / ∂F_t = 1, / ∂m_t = −1; the
      // e^{−m_t} branch of the max adds its own ∂/∂m_t.
      gF[static_cast<size_t>(t)] += R;
      gm[static_cast<size_t>(t)] += -R + (den_branch ? 0.0 : -gM * em);
      // dQ = C_t gnum + n_t gden, C_t the stabilized state: the previous chunk's state
      // rescaled, plus the intra-chunk keys.
      const int64_t c = t / kChunk, c0 = c * kChunk;
      double* dq = dQ.data() + t * d;
      const double gd = gden[static_cast<size_t>(t)];
      if (const Carried prev = carried(s, doc, C, n, t); prev.C) {
        for (int64_t x = 0; x < d; ++x) {
          double acc = prev.n[x] * gd;
          for (int64_t y = 0; y < r; ++y) acc += prev.C[x * r + y] * gn[y];
          dq[x] += prev.g * acc;
        }
      }
      for (int64_t j = std::max(c0, s.start[static_cast<size_t>(t)]); j <= t; ++j) {
        const float* vj = P.v.data<float>() + j * r;
        double coef = gd;
        for (int64_t y = 0; y < r; ++y) coef += gn[y] * vj[y];
        coef *= a_weight(s, ig, t, j);
        const float* kj = P.k.data<float>() + j * d;
        for (int64_t x = 0; x < d; ++x) dq[x] += coef * kj[x];
      }
    }
  }

  // Pass 2: reverse chunk-end states dC_e = Σ_{t > e, same run, readout} exp(F_t − F_e + m_e − m_t)
  // Q_t gnum_tᵀ (and dn_e with gden), sequential over chunks from the last.
  std::vector<double> dC(static_cast<size_t>(nc * d * r), 0.0), dn(static_cast<size_t>(nc * d), 0.0);
  {
    std::vector<double> Q(static_cast<size_t>(d));
    for (int64_t c = nc - 2; c >= 0; --c) {
      const int64_t e = chunk_end(s, c), e1 = chunk_end(s, c + 1);
      if (doc[e] < 0) continue;
      double* dCe = dC.data() + c * d * r;
      double* dne = dn.data() + c * d;
      if (same_run(s, doc, e, e1)) {
        const double g = std::exp(s.F[static_cast<size_t>(e1)] - s.F[static_cast<size_t>(e)] +
                                  s.m[static_cast<size_t>(e)] - s.m[static_cast<size_t>(e1)]);
        for (int64_t x = 0; x < d * r; ++x) dCe[x] = g * dC[static_cast<size_t>((c + 1) * d * r + x)];
        for (int64_t x = 0; x < d; ++x) dne[x] = g * dn[static_cast<size_t>((c + 1) * d + x)];
      }
      for (int64_t t = e + 1; t <= e1 && same_run(s, doc, e, t); ++t) {
        if (!s.readout[static_cast<size_t>(t)]) continue;
        const double g = std::exp(s.F[static_cast<size_t>(t)] - s.F[static_cast<size_t>(e)] +
                                  s.m[static_cast<size_t>(e)] - s.m[static_cast<size_t>(t)]);
        load_query(P, t - w + 1, d, Q.data());
        const double* gn = gnum.data() + t * r;
        const double gd = gden[static_cast<size_t>(t)];
        for (int64_t x = 0; x < d; ++x) {
          const double gq = g * Q[static_cast<size_t>(x)];
          dne[x] += gq * gd;
          for (int64_t y = 0; y < r; ++y) dCe[x * r + y] += gq * gn[y];
        }
      }
    }
  }

  // Pass 3 (parallel over chunks): dk̃_s, dṽ_s from the readouts of s's chunk (intra) and from
  // the chunk end's reverse state (later chunks); then ∂/∂ĩ_s = k̃_s·dk̃_s = −∂/∂F_s (s side).
  Projected dP{Tensor::zeros({T, d}, DType::F32), Tensor::zeros({T, d}, DType::F32),
               Tensor::zeros({T, r}, DType::F32), Tensor::zeros({T}, DType::F32), Tensor::zeros({T}, DType::F32)};
  std::vector<double> gi(Ts, 0.0);
#pragma omp parallel
  {
    std::vector<double> Q(static_cast<size_t>(d)), dk(static_cast<size_t>(d)), dv(static_cast<size_t>(r));
#pragma omp for schedule(static)
    for (int64_t c = 0; c < nc; ++c) {
      const int64_t c0 = c * kChunk, e = chunk_end(s, c);
      for (int64_t j = c0; j <= e; ++j) {
        if (doc[j] < 0) continue;
        std::fill(dk.begin(), dk.end(), 0.0);
        std::fill(dv.begin(), dv.end(), 0.0);
        const float* kj = P.k.data<float>() + j * d;
        const float* vj = P.v.data<float>() + j * r;
        for (int64_t t = j; t <= e && same_run(s, doc, j, t); ++t) {
          if (!s.readout[static_cast<size_t>(t)]) continue;
          load_query(P, t - w + 1, d, Q.data());
          const double* gn = gnum.data() + t * r;
          double z = 0, coef = gden[static_cast<size_t>(t)];
          for (int64_t x = 0; x < d; ++x) z += kj[x] * Q[static_cast<size_t>(x)];
          for (int64_t y = 0; y < r; ++y) coef += gn[y] * vj[y];
          const double a = a_weight(s, ig, t, j);
          for (int64_t x = 0; x < d; ++x) dk[static_cast<size_t>(x)] += a * coef * Q[static_cast<size_t>(x)];
          for (int64_t y = 0; y < r; ++y) dv[static_cast<size_t>(y)] += a * z * gn[y];
        }
        if (same_run(s, doc, j, e)) {
          const double b = a_weight(s, ig, e, j);
          const double* dCe = dC.data() + c * d * r;
          const double* dne = dn.data() + c * d;
          for (int64_t x = 0; x < d; ++x) {
            double acc = dne[x];
            for (int64_t y = 0; y < r; ++y) {
              acc += dCe[x * r + y] * vj[y];
              dv[static_cast<size_t>(y)] += b * dCe[x * r + y] * kj[x];
            }
            dk[static_cast<size_t>(x)] += b * acc;
          }
        }
        double kdk = 0;
        for (int64_t x = 0; x < d; ++x) {
          kdk += kj[x] * dk[static_cast<size_t>(x)];
          dP.k.data<float>()[j * d + x] = static_cast<float>(dk[static_cast<size_t>(x)]);
        }
        for (int64_t y = 0; y < r; ++y) dP.v.data<float>()[j * r + y] = static_cast<float>(dv[static_cast<size_t>(y)]);
        gi[static_cast<size_t>(j)] += kdk;
        gF[static_cast<size_t>(j)] -= kdk;
      }
    }
  }

  // Pass 4 (sequential, O(T)): the stabilizer's recurrence backward, then F_t = Σ_{j ≤ t} log f_j
  // backward (a reverse cumulative sum per run), and dq̃_u = dQ_t/√d.
  std::vector<double> glf(Ts, 0.0);
  for (int64_t t = T - 1; t >= 0; --t) {
    const auto ti = static_cast<size_t>(t);
    if (doc[t] < 0) continue;
    if (s.forget_branch[ti]) {
      glf[ti] += gm[ti];
      if (s.start[ti] != t) gm[ti - 1] += gm[ti];
    } else {
      gi[ti] += gm[ti];
    }
  }
  double run_sum = 0;
  for (int64_t t = T - 1; t >= 0; --t) {
    const auto ti = static_cast<size_t>(t);
    if (doc[t] < 0) continue;
    if (t == T - 1 || !same_run(s, doc, t, t + 1)) run_sum = 0;
    run_sum += gF[ti];
    glf[ti] += run_sum;
  }
  double dbo = 0;
  std::vector<double> dwo(static_cast<size_t>(r), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const auto ti = static_cast<size_t>(t);
    dP.igate.data<float>()[t] = static_cast<float>(gi[ti]);
    dP.log_f.data<float>()[t] = static_cast<float>(glf[ti]);
    if (!s.readout[ti]) continue;
    dbo += dbo_parts[ti];
    for (int64_t y = 0; y < r; ++y) dwo[static_cast<size_t>(y)] += dwo_parts[ti * static_cast<size_t>(r) + static_cast<size_t>(y)];
    const int64_t u = t - w + 1;
    for (int64_t x = 0; x < d; ++x)
      dP.q.data<float>()[u * d + x] = static_cast<float>(dQ[ti * static_cast<size_t>(d) + static_cast<size_t>(x)] * inv_sqrt_d);
  }
  dw_o = Tensor::empty({r}, DType::F32);
  for (int64_t y = 0; y < r; ++y) dw_o.data<float>()[y] = static_cast<float>(dwo[static_cast<size_t>(y)]);
  db_o = Tensor::from_vector<float>({static_cast<float>(dbo)}, {1});
  return dP;
}

}  // namespace retain::cpu::kvpop
