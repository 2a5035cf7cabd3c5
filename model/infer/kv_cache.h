// The bounded KV cache of DESIGN §8: per layer and KV head, its own number of entries, each
// with its key, value, original position, logβ (when gates ran) and accumulated attention
// (for H2O). Storage per layer is one tensor [K, capacity, d] for keys and one for values, so
// the attention op reads a layer at once (kernels/kv_attention.h); capacity grows
// geometrically. A head's entries are in no particular order: eviction moves the last entries
// into the holes it leaves (O(evicted·d), not a shift of everything after them — with one
// eviction per decoding step that shift would cost as much as the attention itself), and
// attention masks by position, not by slot. kept_positions() sorts.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/tensor.h"

namespace retain::infer {

class KVCache {
 public:
  KVCache() = default;
  KVCache(int64_t layers, int64_t kv_heads, int64_t head_dim);

  int64_t layers() const { return static_cast<int64_t>(layers_.size()); }
  int64_t kv_heads() const { return kv_heads_; }
  int64_t head_dim() const { return head_dim_; }
  // Entries of (layer, KV head).
  int64_t size(int64_t l, int64_t h) const { return layers_[l].lens.data<int32_t>()[h]; }
  int64_t total() const;  // entries over all layers and heads
  int64_t max_size() const;  // the largest per-head entry count
  // Bytes of key/value data the entries hold (what a serving engine would allocate for them).
  int64_t kv_bytes() const { return total() * head_dim_ * 2 * static_cast<int64_t>(sizeof(float)); }

  // Appends T entries to every KV head of layer l: k, v F32 [T, K, d], positions I32 [T],
  // log_beta F32 [T, K] or nullptr (no gates: logβ recorded as 0).
  void append(int64_t l, const Tensor& k, const Tensor& v, const Tensor& positions, const Tensor* log_beta);
  // Keeps the entries `keep` of (l, h) (strictly increasing indices into its entries) and drops
  // the rest; the survivors' slots may change.
  void keep(int64_t l, int64_t h, std::span<const int32_t> keep);
  // Drops the entries `drop` of (l, h) (distinct indices, any order): O(|drop|·d).
  void drop(int64_t l, int64_t h, std::vector<int32_t> drop);

  const int32_t* positions(int64_t l, int64_t h) const { return at<int32_t>(layers_[l].pos, h); }
  const float* log_beta(int64_t l, int64_t h) const { return at<float>(layers_[l].log_beta, h); }
  const float* attn_sum(int64_t l, int64_t h) const { return at<float>(layers_[l].attn_sum, h); }
  std::vector<int32_t> kept_positions(int64_t l, int64_t h) const;  // sorted

  // What kernels/kv_attention.h reads: keys, values F32 [K, C, d], positions I32 [K, C],
  // lens I32 [K], accumulated attention F32 [K, C].
  struct Layer {
    Tensor keys, values, pos, log_beta, attn_sum, lens;
    int64_t capacity = 0;
  };
  Layer& layer(int64_t l) { return layers_[l]; }
  const Layer& layer(int64_t l) const { return layers_[l]; }

 private:
  template <typename T> const T* at(const Tensor& t, int64_t h) const {
    return t.data<T>() + h * t.dim(1);
  }
  void reserve(int64_t l, int64_t need);

  int64_t kv_heads_ = 0, head_dim_ = 0;
  std::vector<Layer> layers_;
};

}  // namespace retain::infer
