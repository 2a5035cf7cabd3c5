// CPU reference behind kernels/kv_attention.h (shapes already checked).
#pragma once
#include "kernels/tensor.h"

namespace retain::cpu {

void kv_attention(const Tensor& q, const Tensor& q_pos, const Tensor& keys, const Tensor& values,
                  const Tensor& key_pos, const Tensor& lens, float scale, Tensor& out, Tensor* attn_sum);

}  // namespace retain::cpu
