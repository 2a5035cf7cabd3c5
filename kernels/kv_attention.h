// Attention of new queries over a bounded KV cache (DESIGN §8): each KV head holds its own
// number of entries (what its eviction policy kept), each entry with its original RoPE
// position. Plain softmax attention (β never enters the scores at inference). Dispatches on
// the device like kernels/ops.h; the CPU reference is kernels/cpu/kv_attention.cpp.
#pragma once
#include "kernels/tensor.h"

namespace retain::ops {

// q F32 [T, H, d] at positions q_pos I32 [T]; per KV head κ < K the first lens[κ] rows of
// keys[κ], values[κ] (F32 [K, C, d]) with positions key_pos[κ] (I32 [K, C]). Query t with head h
// attends entry j of κ = h / (H/K) iff key_pos[κ, j] ≤ q_pos[t]; score = (q·k)·scale.
// out F32 [T, H, d] (a query that sees no entry gets 0). With attn_sum (F32 [K, C]), every
// attention probability is added to its entry's slot, summed over the queries and the query
// heads of the group (H2O's accumulated attention).
void kv_attention(const Tensor& q, const Tensor& q_pos, const Tensor& keys, const Tensor& values,
                  const Tensor& key_pos, const Tensor& lens, float scale, Tensor& out, Tensor* attn_sum = nullptr);

}  // namespace retain::ops
