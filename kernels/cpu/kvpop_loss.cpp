// KVPOP pairwise boundary loss (DESIGN §5) and its gradient into the scores and θ, with
// D_i = ⌊(q − i)/every⌋ (every = 1: D_new − D_b = b − t_new):
//   Δ = ŝ_new(q) − ŝ_b(q) = score_new − score_b + (D_new − D_b)·log γ(θ),
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

// D_new − D_b, the decay steps by which t_new is ahead of b at q.
double steps_ahead(const Decision& dc, int64_t every) {
  using retain::kvpop::decay_steps;
  return double(decay_steps(dc.q, dc.t_new, every) - decay_steps(dc.q, dc.b, every));
}

double delta(const float* score, double log_gamma, const Decision& dc, int64_t every) {
  return double(score[dc.t_new]) - score[dc.b] + steps_ahead(dc, every) * log_gamma;
}

}  // namespace

double pair_loss(const float* score, double theta, const std::vector<Decision>& decisions, double margin_scale,
                 double tau, const retain::kvpop::Decay& decay) {
  const double lg = retain::kvpop::log_gamma(theta, decay);
  double sum = 0;
  for (const Decision& dc : decisions)
    sum += weight(dc, margin_scale) * softplus(-dc.y * delta(score, lg, dc, decay.every) / tau);
  return sum;
}

void pair_loss_backward(const float* score, double theta, const std::vector<Decision>& decisions,
                        double margin_scale, double tau, double grad_scale, int64_t T, float* dscore,
                        double& dtheta, const retain::kvpop::Decay& decay) {
  const double lg = retain::kvpop::log_gamma(theta, decay);
  double dlg = 0;
  std::vector<double> ds(static_cast<size_t>(T), 0.0);  // a key is in many decisions: sum in float64
  for (const Decision& dc : decisions) {
    const double g = grad_scale * weight(dc, margin_scale) * (-dc.y / tau) * sigmoid(-dc.y * delta(score, lg, dc, decay.every) / tau);
    ds[static_cast<size_t>(dc.t_new)] += g;
    ds[static_cast<size_t>(dc.b)] -= g;
    dlg += g * steps_ahead(dc, decay.every);
  }
  for (int64_t t = 0; t < T; ++t) dscore[t] = static_cast<float>(ds[static_cast<size_t>(t)]);
  dtheta = dlg * retain::kvpop::log_gamma_derivative(theta, decay);
}

}  // namespace retain::cpu::kvpop
