// Shape checks and device dispatch for kernels/kv_attention.h.
#include "kernels/kv_attention.h"

#include "kernels/cpu/kv_attention_cpu.h"
#include "kernels/require_cpu.h"

namespace retain::ops {

void kv_attention(const Tensor& q, const Tensor& q_pos, const Tensor& keys, const Tensor& values,
                  const Tensor& key_pos, const Tensor& lens, float scale, Tensor& out, Tensor* attn_sum) {
  RETAIN_CHECK(q.dtype() == DType::F32 && q.ndim() == 3 && keys.dtype() == DType::F32 && keys.ndim() == 3 &&
                   values.shape() == keys.shape() && values.dtype() == DType::F32 && out.shape() == q.shape() &&
                   out.dtype() == DType::F32,
               "kv_attention: q {} keys {} values {} out {}", shape_str(q.shape()), shape_str(keys.shape()),
               shape_str(values.shape()), shape_str(out.shape()));
  const int64_t T = q.dim(0), H = q.dim(1), d = q.dim(2), K = keys.dim(0), C = keys.dim(1);
  RETAIN_CHECK(keys.dim(2) == d && K > 0 && H % K == 0, "kv_attention: q {} keys {}", shape_str(q.shape()),
               shape_str(keys.shape()));
  RETAIN_CHECK(q_pos.dtype() == DType::I32 && q_pos.shape() == Shape{T}, "kv_attention: q_pos {}",
               shape_str(q_pos.shape()));
  RETAIN_CHECK(key_pos.dtype() == DType::I32 && key_pos.shape() == (Shape{K, C}), "kv_attention: key_pos {}",
               shape_str(key_pos.shape()));
  RETAIN_CHECK(lens.dtype() == DType::I32 && lens.shape() == Shape{K}, "kv_attention: lens {}",
               shape_str(lens.shape()));
  for (int64_t k = 0; k < K; ++k)
    RETAIN_CHECK(lens.data<int32_t>()[k] >= 0 && lens.data<int32_t>()[k] <= C, "kv_attention: lens[{}] = {} of {}",
                 k, lens.data<int32_t>()[k], C);
  if (attn_sum)
    RETAIN_CHECK(attn_sum->dtype() == DType::F32 && attn_sum->shape() == (Shape{K, C}), "kv_attention: attn_sum {}",
                 shape_str(attn_sum->shape()));
  require_cpu("kv_attention", {&q, &q_pos, &keys, &values, &key_pos, &lens, &out});
  if (attn_sum) require_cpu("kv_attention", {attn_sum});
  cpu::kv_attention(q, q_pos, keys, values, key_pos, lens, scale, out, attn_sum);
}

}  // namespace retain::ops
