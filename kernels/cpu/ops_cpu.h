// CPU reference implementations behind kernels/ops.h (shapes already checked).
#pragma once
#include "kernels/tensor.h"

namespace retain::cpu {

void embedding(const Tensor& table, const Tensor& ids, Tensor& out);
void linear(const Tensor& x, const Tensor& w, Tensor& y);
void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor& out);
void rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, float attention_factor);
// The rotation of rope(), or its transpose (the backward): one loop for both.
void rope_rotate(Tensor& x, const Tensor& positions, const Tensor& inv_freq, float attention_factor, bool transpose);
void swiglu(const Tensor& gate, const Tensor& up, Tensor& out);
void add_inplace(Tensor& x, const Tensor& y);
void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& doc, float scale,
               Tensor& out);


// Backward ops (kernels/cpu/ops_backward.cpp).
void linear_backward_input(const Tensor& dy, const Tensor& w, Tensor& dx, bool accumulate);
void rmsnorm_backward(const Tensor& x, const Tensor& w, float eps, const Tensor& dy, Tensor& dx);
void rope_backward(Tensor& dx, const Tensor& positions, const Tensor& inv_freq, float attention_factor);
void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate, Tensor& dup);

}  // namespace retain::cpu
