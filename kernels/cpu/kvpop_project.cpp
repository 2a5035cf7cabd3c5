// KVPOP projections (DESIGN §5): Hedgehog features, value projection and soft-capped gates,
// forward and backward. One token per loop iteration; float64 dot products (2d terms).
#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/cpu/kvpop_cpu.h"

namespace retain::cpu::kvpop {

namespace {

// z = W x for one token: W [r, 2d] row-major, x [2d].
void matvec(const float* W, const float* x, int64_t r, int64_t n, double* z) {
  for (int64_t j = 0; j < r; ++j) {
    double s = 0;
    for (int64_t c = 0; c < n; ++c) s += double(W[j * n + c]) * x[c];
    z[j] = s;
  }
}

// φ(z) = [softmax(z); softmax(−z)] into out [2r].
void hedgehog(const double* z, int64_t r, double* out) {
  const double hi = *std::max_element(z, z + r), lo = *std::min_element(z, z + r);
  double sp = 0, sn = 0;
  for (int64_t j = 0; j < r; ++j) {
    out[j] = std::exp(z[j] - hi);
    out[r + j] = std::exp(lo - z[j]);
    sp += out[j];
    sn += out[r + j];
  }
  for (int64_t j = 0; j < r; ++j) {
    out[j] /= sp;
    out[r + j] /= sn;
  }
}

// dz of φ given φ's output f [2r] and its gradient g [2r] (softmax Jacobian on each half; the
// second half's input is −z, hence the minus).
void hedgehog_backward(const double* f, const float* g, int64_t r, double* dz) {
  double dp = 0, dn = 0;
  for (int64_t j = 0; j < r; ++j) {
    dp += f[j] * g[j];
    dn += f[r + j] * g[r + j];
  }
  for (int64_t j = 0; j < r; ++j) dz[j] = f[j] * (g[j] - dp) - f[r + j] * (g[r + j] - dn);
}

double dot(const float* a, const float* x, int64_t n) {
  double s = 0;
  for (int64_t c = 0; c < n; ++c) s += double(a[c]) * x[c];
  return s;
}

double log_sigmoid(double x) { return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x)); }

}  // namespace

Projected project(const Tensor& x, const HeadParams& p) {
  const int64_t T = x.dim(0), n = x.dim(1), r = p.W_q.dim(0), d = 2 * r;
  Projected P{Tensor::empty({T, d}, DType::F32), Tensor::empty({T, d}, DType::F32),
              Tensor::empty({T, r}, DType::F32), Tensor::empty({T}, DType::F32), Tensor::empty({T}, DType::F32)};
  const float c = retain::kvpop::kGateCap;
  const double bi = p.b_i.data<float>()[0], bf = p.b_f.data<float>()[0];
#pragma omp parallel
  {
    std::vector<double> z(static_cast<size_t>(r)), f(static_cast<size_t>(d));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float* xt = x.data<float>() + t * n;
      for (auto [W, out] : {std::pair{&p.W_q, &P.q}, std::pair{&p.W_k, &P.k}}) {
        matvec(W->data<float>(), xt, r, n, z.data());
        hedgehog(z.data(), r, f.data());
        std::copy(f.begin(), f.end(), out->data<float>() + t * d);
      }
      matvec(p.W_v.data<float>(), xt, r, n, z.data());
      std::copy(z.begin(), z.end(), P.v.data<float>() + t * r);
      P.igate.data<float>()[t] = static_cast<float>(c * std::tanh((dot(p.w_i.data<float>(), xt, n) + bi) / c));
      const double ft = c * std::tanh((dot(p.w_f.data<float>(), xt, n) + bf) / c);
      P.log_f.data<float>()[t] = static_cast<float>(log_sigmoid(ft));
    }
  }
  return P;
}

void project_backward(const Tensor& x, const HeadParams& p, const Projected& dP, HeadParams& g) {
  const int64_t T = x.dim(0), n = x.dim(1), r = p.W_q.dim(0), d = 2 * r;
  const double c = retain::kvpop::kGateCap;
  const double bi = p.b_i.data<float>()[0], bf = p.b_f.data<float>()[0];
  // Per-token pre-activation gradients first (parallel over tokens), then the weight
  // gradients as sums over tokens (parallel over weight rows): deterministic, no atomics.
  std::vector<double> dzq(static_cast<size_t>(T * r), 0.0), dzk(static_cast<size_t>(T * r), 0.0);
  std::vector<double> dpre_i(static_cast<size_t>(T), 0.0), dpre_f(static_cast<size_t>(T), 0.0);
#pragma omp parallel
  {
    std::vector<double> z(static_cast<size_t>(r)), f(static_cast<size_t>(d));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float* xt = x.data<float>() + t * n;
      for (auto [W, dout, dz] : {std::tuple{&p.W_q, &dP.q, &dzq}, std::tuple{&p.W_k, &dP.k, &dzk}}) {
        if (!dout->defined() || dout->numel() == 0) continue;
        matvec(W->data<float>(), xt, r, n, z.data());
        hedgehog(z.data(), r, f.data());
        hedgehog_backward(f.data(), dout->data<float>() + t * d, r, dz->data() + t * r);
      }
      // d/da of c·tanh(a/c) = 1 − tanh²(a/c); d log_f / d f̃ = σ(−f̃).
      if (dP.igate.defined() && dP.igate.numel() > 0) {
        const double th = std::tanh((dot(p.w_i.data<float>(), xt, n) + bi) / c);
        dpre_i[static_cast<size_t>(t)] = dP.igate.data<float>()[t] * (1 - th * th);
      }
      if (dP.log_f.defined() && dP.log_f.numel() > 0) {
        const double th = std::tanh((dot(p.w_f.data<float>(), xt, n) + bf) / c);
        const double ft = c * th;
        dpre_f[static_cast<size_t>(t)] = dP.log_f.data<float>()[t] * (1 / (1 + std::exp(ft))) * (1 - th * th);
      }
    }
  }
  g.W_q = Tensor::zeros({r, n}, DType::F32);
  g.W_k = Tensor::zeros({r, n}, DType::F32);
  g.W_v = Tensor::zeros({r, n}, DType::F32);
  g.w_i = Tensor::zeros({n}, DType::F32);
  g.w_f = Tensor::zeros({n}, DType::F32);
  g.b_i = Tensor::zeros({1}, DType::F32);
  g.b_f = Tensor::zeros({1}, DType::F32);
  const bool has_v = dP.v.defined() && dP.v.numel() > 0;
  // Rows 0..r−1: W_q, r..2r−1: W_k, 2r..3r−1: W_v, 3r: w_i, 3r+1: w_f.
#pragma omp parallel
  {
    std::vector<double> acc(static_cast<size_t>(n));
#pragma omp for schedule(dynamic)
    for (int64_t row = 0; row < 3 * r + 2; ++row) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t t = 0; t < T; ++t) {
        double gt;
        if (row < r) gt = dzq[static_cast<size_t>(t * r + row)];
        else if (row < 2 * r) gt = dzk[static_cast<size_t>(t * r + row - r)];
        else if (row < 3 * r) gt = has_v ? dP.v.data<float>()[t * r + row - 2 * r] : 0.0;
        else gt = row == 3 * r ? dpre_i[static_cast<size_t>(t)] : dpre_f[static_cast<size_t>(t)];
        if (gt == 0) continue;
        const float* xt = x.data<float>() + t * n;
        for (int64_t col = 0; col < n; ++col) acc[static_cast<size_t>(col)] += gt * xt[col];
      }
      float* out = row < r           ? g.W_q.data<float>() + row * n
                   : row < 2 * r     ? g.W_k.data<float>() + (row - r) * n
                   : row < 3 * r     ? g.W_v.data<float>() + (row - 2 * r) * n
                   : row == 3 * r    ? g.w_i.data<float>()
                                     : g.w_f.data<float>();
      for (int64_t col = 0; col < n; ++col) out[col] = static_cast<float>(acc[static_cast<size_t>(col)]);
    }
  }
  double si = 0, sf = 0;
  for (int64_t t = 0; t < T; ++t) {
    si += dpre_i[static_cast<size_t>(t)];
    sf += dpre_f[static_cast<size_t>(t)];
  }
  g.b_i.data<float>()[0] = static_cast<float>(si);
  g.b_f.data<float>()[0] = static_cast<float>(sf);
}

}  // namespace retain::cpu::kvpop
