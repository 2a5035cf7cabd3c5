// CPU reference implementations behind kernels/ops.h (shapes already checked).
#pragma once
#include "kernels/tensor.h"

namespace retain::cpu {

void embedding(const Tensor& table, const Tensor& ids, Tensor& out);
void linear(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate);
void cast(const Tensor& src, Tensor& dst);
// OpenBLAS has no bf16 GEMM, so a BF16 weight is multiplied as float32: rows [r0, r1) × columns
// [c0, c1) of the BF16 matrix w, widened (exactly) into dst, row-major [r1 − r0, c1 − c0].
void widen_bf16(const Tensor& w, int64_t r0, int64_t r1, int64_t c0, int64_t c1, float* dst);
// How many floats a widened block of a BF16 weight may take (32 MiB): one block, hence one
// sgemm with exactly the F32 path's arguments, for every weight up to that size; bigger ones
// (an LM head) go block by block rather than doubling their memory as float32.
inline constexpr int64_t kWidenBlockFloats = int64_t{8} << 20;
void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor& out);
void rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, float attention_factor);
// The rotation of rope(), or its transpose (the backward): one loop for both.
void rope_rotate(Tensor& x, const Tensor& positions, const Tensor& inv_freq, float attention_factor, bool transpose);
void swiglu(const Tensor& gate, const Tensor& up, Tensor& out);
void add_inplace(Tensor& x, const Tensor& y);
void fill(Tensor& x, double value);
void scale_to_f32(const Tensor& src, double scale, Tensor& dst);
void concat_columns(const Tensor& a, const Tensor& b, Tensor& out);
void split_columns_add(const Tensor& src, Tensor& da, Tensor& db);
void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& doc, float scale,
               Tensor& out);


// Backward ops (kernels/cpu/ops_backward.cpp).
void linear_backward_input(const Tensor& dy, const Tensor& w, Tensor& dx, bool accumulate);
void linear_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, bool accumulate);
void rmsnorm_backward(const Tensor& x, const Tensor& w, float eps, const Tensor& dy, Tensor& dx, bool accumulate);
void rope_backward(Tensor& dx, const Tensor& positions, const Tensor& inv_freq, float attention_factor);
void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate, Tensor& dup);

}  // namespace retain::cpu
