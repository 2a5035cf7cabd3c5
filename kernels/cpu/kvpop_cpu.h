// CPU references behind kernels/kvpop.h (shapes, dtypes and document runs already checked by
// kernels/kvpop.cpp).
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/kvpop.h"

namespace retain::cpu::kvpop {

using retain::kvpop::Decision;
using retain::kvpop::HeadParams;
using retain::kvpop::Projected;

Projected project(const Tensor& x, const HeadParams& p);
void project_backward(const Tensor& x, const HeadParams& p, const Projected& dP, HeadParams& g);
Tensor mlstm_scores(const Projected& P, const int32_t* doc, int64_t w, const Tensor& w_o, float b_o);
Projected mlstm_scores_backward(const Projected& P, const int32_t* doc, int64_t w, const Tensor& w_o,
                                float b_o, const Tensor& dscore, Tensor& dw_o, Tensor& db_o);
Tensor future_attention_target(const Tensor& q, const Tensor& k, const Tensor& lse, const int32_t* doc,
                               int64_t w, float scale);
void future_attention_sums(const Tensor& q, const Tensor& lse, const int32_t* q_doc, int64_t q_start,
                           const Tensor& k, const int32_t* k_doc, int64_t k_start, int64_t w, float scale,
                           Tensor& mx, Tensor& sum);
std::pair<Tensor, Tensor> future_attention_start(int64_t T, int64_t H);
Tensor future_attention_finish(const Tensor& mx, const Tensor& sum, int64_t K);
std::vector<Decision> select_decisions(const float* log_m, const int32_t* doc, int64_t T, int64_t w,
                                       int64_t sinks, int64_t k, const retain::kvpop::TargetRule& rule);

}  // namespace retain::cpu::kvpop

namespace retain::cpu::kvpop {
double pair_loss(const float* score, double theta, const std::vector<Decision>& decisions, double margin_scale,
                 double tau, const retain::kvpop::Decay& decay);
void pair_loss_backward(const float* score, double theta, const std::vector<Decision>& decisions,
                        double margin_scale, double tau, double grad_scale, int64_t T, float* dscore,
                        double& dtheta, const retain::kvpop::Decay& decay);
}  // namespace retain::cpu::kvpop
