// KVPOP pairwise boundary loss (DESIGN §5) and its gradient into the scores and θ:
//   Δ = ŝ_new(q) − ŝ_b(q) = score_new − score_b + (b − t_new)·log γ(θ),
//   ℓ = a·softplus(−y·Δ/τ),  ∂ℓ/∂Δ = −a·y·σ(−y·Δ/τ)/τ.
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu/kvpop_cpu.h"

namespace retain::cpu::kvpop {

namespace {

double softplus(double x) { return x > 0 ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x)); }
double sigmoid(double x) { return x >= 0 ? 1 / (1 + std::exp(-x)) : std::exp(x) / (1 + std::exp(x)); }

double weight(const Decision& dc, double margin_scale) { return margin_scale > 0 ? dc.margin * margin_scale : 1.0; }

double delta(const float* score, double log_gamma, const Decision& dc) {
  return double(score[dc.t_new]) - score[dc.b] + double(dc.b - dc.t_new) * log_gamma;
}

}  // namespace

double pair_loss(const float* score, double theta, const std::vector<Decision>& decisions, double margin_scale,
                 double tau) {
  const double lg = retain::kvpop::log_gamma(theta);
  double sum = 0;
  for (const Decision& dc : decisions)
    sum += weight(dc, margin_scale) * softplus(-dc.y * delta(score, lg, dc) / tau);
  return sum;
}

void pair_loss_backward(const float* score, double theta, const std::vector<Decision>& decisions,
                        double margin_scale, double tau, double grad_scale, int64_t T, float* dscore,
                        double& dtheta) {
  const double lg = retain::kvpop::log_gamma(theta);
  double dlg = 0;
  std::vector<double> ds(static_cast<size_t>(T), 0.0);  // a key is in many decisions: sum in float64
  for (const Decision& dc : decisions) {
    const double g = grad_scale * weight(dc, margin_scale) * (-dc.y / tau) * sigmoid(-dc.y * delta(score, lg, dc) / tau);
    ds[static_cast<size_t>(dc.t_new)] += g;
    ds[static_cast<size_t>(dc.b)] -= g;
    dlg += g * double(dc.b - dc.t_new);
  }
  for (int64_t t = 0; t < T; ++t) dscore[t] = static_cast<float>(ds[static_cast<size_t>(t)]);
  // log γ = A + (B − A)·σ(θ): d log γ / dθ = (B − A)·σ(θ)·(1 − σ(θ)).
  const double A = std::log(0.999), B = std::log(0.999999), sg = sigmoid(theta);
  dtheta = dlg * (B - A) * sg * (1 - sg);
}

}  // namespace retain::cpu::kvpop
