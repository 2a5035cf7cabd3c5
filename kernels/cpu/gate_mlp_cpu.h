// CPU reference of kernels/gate_mlp.h (arguments checked there).
#pragma once
#include "kernels/tensor.h"

namespace retain::cpu {

void gate_bias_silu(Tensor& a, const Tensor& b, Tensor& s);
void gate_bias_log_sigmoid(Tensor& z, const Tensor& b, Tensor& log_beta);
void gate_silu(const Tensor& a, Tensor& s);
void gate_log_sigmoid_backward(const Tensor& z, const Tensor& dlog_beta, Tensor& dz);
void gate_times_silu_grad(Tensor& ds, const Tensor& a);
void gate_add_column_sums(const Tensor& dy, Tensor& db);

}  // namespace retain::cpu
