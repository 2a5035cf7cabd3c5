#include "model/infer/kv_cache.h"

#include <algorithm>
#include <cstring>
#include <functional>

namespace retain::infer {

namespace {

// Copies the first `n` rows of every head from a [K, C_old, w] buffer into a [K, C_new, w] one.
Tensor regrow(const Tensor& old, int64_t K, int64_t cap, int64_t row, const int32_t* lens) {
  Shape shape = row == 1 ? Shape{K, cap} : Shape{K, cap, row};
  Tensor t = Tensor::zeros(shape, old.dtype());
  if (!old.numel()) return t;
  const size_t esz = dtype_size(old.dtype());
  const int64_t old_cap = old.dim(1);
  for (int64_t h = 0; h < K; ++h)
    std::memcpy(static_cast<char*>(t.raw()) + static_cast<size_t>(h * cap * row) * esz,
                static_cast<const char*>(old.raw()) + static_cast<size_t>(h * old_cap * row) * esz,
                static_cast<size_t>(lens[h] * row) * esz);
  return t;
}

}  // namespace

KVCache::KVCache(int64_t layers, int64_t kv_heads, int64_t head_dim)
    : kv_heads_(kv_heads), head_dim_(head_dim), layers_(static_cast<size_t>(layers)) {
  for (Layer& ly : layers_) {
    ly.lens = Tensor::zeros({kv_heads}, DType::I32);
    ly.keys = Tensor::zeros({kv_heads, 0, head_dim}, DType::F32);
    ly.values = Tensor::zeros({kv_heads, 0, head_dim}, DType::F32);
    ly.pos = Tensor::zeros({kv_heads, 0}, DType::I32);
    ly.log_beta = Tensor::zeros({kv_heads, 0}, DType::F32);
    ly.attn_sum = Tensor::zeros({kv_heads, 0}, DType::F32);
  }
}

int64_t KVCache::total() const {
  int64_t n = 0;
  for (int64_t l = 0; l < layers(); ++l)
    for (int64_t h = 0; h < kv_heads_; ++h) n += size(l, h);
  return n;
}

int64_t KVCache::max_size() const {
  int64_t n = 0;
  for (int64_t l = 0; l < layers(); ++l)
    for (int64_t h = 0; h < kv_heads_; ++h) n = std::max(n, size(l, h));
  return n;
}

void KVCache::reserve(int64_t l, int64_t need) {
  Layer& ly = layers_[l];
  if (need <= ly.capacity) return;
  const int64_t cap = std::max<int64_t>({need, 2 * ly.capacity, 16});
  const int32_t* lens = ly.lens.data<int32_t>();
  ly.keys = regrow(ly.keys, kv_heads_, cap, head_dim_, lens);
  ly.values = regrow(ly.values, kv_heads_, cap, head_dim_, lens);
  ly.pos = regrow(ly.pos, kv_heads_, cap, 1, lens);
  ly.log_beta = regrow(ly.log_beta, kv_heads_, cap, 1, lens);
  ly.attn_sum = regrow(ly.attn_sum, kv_heads_, cap, 1, lens);
  ly.capacity = cap;
}

void KVCache::append(int64_t l, const Tensor& k, const Tensor& v, const Tensor& positions, const Tensor* log_beta) {
  const int64_t T = k.dim(0), K = kv_heads_, d = head_dim_;
  RETAIN_CHECK(k.shape() == (Shape{T, K, d}) && v.shape() == k.shape() && positions.shape() == Shape{T} &&
                   (!log_beta || log_beta->shape() == (Shape{T, K})),
               "KVCache::append: k {} v {} positions {}", shape_str(k.shape()), shape_str(v.shape()),
               shape_str(positions.shape()));
  const int32_t* cur = layers_[l].lens.data<int32_t>();
  reserve(l, *std::max_element(cur, cur + K) + T);
  Layer& ly = layers_[l];
  int32_t* lens = ly.lens.data<int32_t>();
  const int64_t C = ly.capacity;
  for (int64_t h = 0; h < K; ++h) {
    const int64_t n = lens[h];
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(ly.keys.data<float>() + (h * C + n + t) * d, k.data<float>() + (t * K + h) * d, d * sizeof(float));
      std::memcpy(ly.values.data<float>() + (h * C + n + t) * d, v.data<float>() + (t * K + h) * d, d * sizeof(float));
      ly.pos.data<int32_t>()[h * C + n + t] = positions.data<int32_t>()[t];
      ly.log_beta.data<float>()[h * C + n + t] = log_beta ? log_beta->data<float>()[t * K + h] : 0.f;
      ly.attn_sum.data<float>()[h * C + n + t] = 0.f;
    }
    lens[h] = static_cast<int32_t>(n + T);
  }
}

void KVCache::keep(int64_t l, int64_t h, std::span<const int32_t> keep) {
  const int64_t n = size(l, h);
  std::vector<uint8_t> kept(static_cast<size_t>(n), 0);
  for (size_t i = 0; i < keep.size(); ++i) {
    RETAIN_CHECK(keep[i] >= 0 && keep[i] < n && (i == 0 || keep[i] > keep[i - 1]), "KVCache::keep: bad index {} of {}",
                 keep[i], n);
    kept[static_cast<size_t>(keep[i])] = 1;
  }
  std::vector<int32_t> gone;
  for (int32_t j = 0; j < n; ++j)
    if (!kept[static_cast<size_t>(j)]) gone.push_back(j);
  drop(l, h, std::move(gone));
}

void KVCache::drop(int64_t l, int64_t h, std::vector<int32_t> drop) {
  Layer& ly = layers_[l];
  int32_t* lens = ly.lens.data<int32_t>();
  const int64_t C = ly.capacity, d = head_dim_;
  float* kb = ly.keys.data<float>() + h * C * d;
  float* vb = ly.values.data<float>() + h * C * d;
  int32_t* pb = ly.pos.data<int32_t>() + h * C;
  float* lb = ly.log_beta.data<float>() + h * C;
  float* ab = ly.attn_sum.data<float>() + h * C;
  // From the highest dropped slot down, the last entry fills each hole: every slot above the
  // current drop already holds a survivor (or is gone), so only survivors are moved.
  std::sort(drop.begin(), drop.end(), std::greater<>());
  int64_t len = lens[h];
  for (size_t i = 0; i < drop.size(); ++i) {
    const int64_t j = drop[i];
    RETAIN_CHECK(j >= 0 && j < len && (i == 0 || j < drop[i - 1]), "KVCache::drop: bad index {} of {}", j, len);
    const int64_t last = --len;
    if (j == last) continue;
    std::memcpy(kb + j * d, kb + last * d, d * sizeof(float));
    std::memcpy(vb + j * d, vb + last * d, d * sizeof(float));
    pb[j] = pb[last], lb[j] = lb[last], ab[j] = ab[last];
  }
  lens[h] = static_cast<int32_t>(len);
}

std::vector<int32_t> KVCache::kept_positions(int64_t l, int64_t h) const {
  const int32_t* p = positions(l, h);
  std::vector<int32_t> out(p, p + size(l, h));
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace retain::infer
