#include "trainer/fsdp.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <utility>

#include <fmt/format.h>

#include "kernels/base/error.h"
#include "kernels/base/nvtx.h"

namespace retain::trainer {

namespace {

// Every tensor of a flat vector starts on a 64-byte boundary (SIMD loads, BLAS, vector loads
// on the GPU), and so does every rank's block of a gathered buffer (allocations are 64-byte
// aligned). Element sizes (2, 4) divide 64, so shard boundaries never split an element.
constexpr int64_t kAlignBytes = 64;

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Elements [begin, begin + n) of checkpoint tensor `src` (F32, BF16 or F16) converted to
// `dtype` into dst. The conversion is Tensor::to_dtype, as LocalWeightProvider's and
// DeviceWeightProvider's (elementwise), so values are identical to theirs.
void convert_slice(const Tensor& src, int64_t begin, int64_t n, DType dtype, char* dst) {
  const char* bytes =
      static_cast<const char*>(src.raw()) + static_cast<size_t>(begin) * dtype_size(src.dtype());
  const size_t out_bytes = static_cast<size_t>(n) * dtype_size(dtype);
  if (src.dtype() == dtype) {
    std::memcpy(dst, bytes, out_bytes);
    return;
  }
  // A read-only view: to_dtype only reads it, and src keeps the mapping alive meanwhile.
  const Tensor part = Tensor::view(const_cast<char*>(bytes), {n}, src.dtype(), nullptr);
  const Tensor converted = part.to_dtype(dtype);
  std::memcpy(dst, converted.raw(), out_bytes);
}

}  // namespace

// ---- LayerPrefetchPolicy --------------------------------------------------------------------

LayerPrefetchPolicy::LayerPrefetchPolicy(int64_t layers) : layers_(layers) { learned_.fill(-1); }

int64_t LayerPrefetchPolicy::observe(int64_t l) {
  if (layers_ < 2) return -1;
  if (l == last_) return guess_;  // a repeat: the guess in flight stays right or wrong
  if (pending_key_ >= 0) {        // what followed the last end, for the next time
    learned_[static_cast<size_t>(pending_key_)] = l;
    pending_key_ = -1;
  }
  const int64_t top = layers_ - 1;
  const bool reached_end = last_ >= 0 && ((l == top && last_ == top - 1) || (l == 0 && last_ == 1));
  if (last_ >= 0 && (l == last_ + 1 || l == last_ - 1))
    dir_ = l - last_;
  else if (l == 0)
    dir_ = +1;  // a jump to an end starts a pass from it
  else if (l == top)
    dir_ = -1;
  // (a jump into the middle keeps the direction)
  if (reached_end) {
    // Next: another pass from the other end, or the way back? Whatever came last time here.
    const int end = l == 0 ? 0 : 1;
    pending_key_ = end * 3 + prev_end_;
    prev_end_ = end;
    const int64_t known = learned_[static_cast<size_t>(pending_key_)];
    guess_ = known >= 0 ? known : l - dir_;
  } else {
    guess_ = l + dir_;
    if (guess_ < 0 || guess_ > top) guess_ = l - dir_;
  }
  last_ = l;
  return guess_;
}

// ---- FsdpWeightProvider ---------------------------------------------------------------------

FsdpWeightProvider::FsdpWeightProvider(std::shared_ptr<const Qwen3Checkpoint> ckpt, dist::Comm& comm,
                                       FsdpOptions options)
    : ckpt_(std::move(ckpt)),
      comm_(comm),
      options_(options),
      policy_(ckpt_ ? ckpt_->config().num_hidden_layers : 0) {
  RETAIN_CHECK(ckpt_ != nullptr, "FsdpWeightProvider: null checkpoint");
  const DType mm = options_.matmul_dtype;
  RETAIN_CHECK(mm == DType::F32 || mm == DType::BF16, "FsdpWeightProvider: matmul weights must be F32 or BF16, not {}",
               dtype_name(mm));
  if (options_.device == Device::CUDA && cuda_device_count() == 0)
    fail("{}: no CUDA device to hold the model's shards ({})", ckpt_->dir(),
         cuda_built() ? "cudaGetDeviceCount found none" : "this build has no CUDA support");
  check_same_model_everywhere();
  const Qwen3Config& c = config();
  layers_.reserve(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    std::vector<TensorSpec> specs;
    for (auto& [name, shape] : layer_tensors(c, l)) {
      const DType dtype = layer_tensor_dtype(shape, mm);
      specs.push_back({std::move(name), std::move(shape), dtype});
    }
    layers_.push_back(make_unit(std::move(specs)));
  }
  const Shape vd{c.vocab_size, c.hidden_size};
  const DType embed_dtype = mm == DType::F32 ? DType::F32 : ckpt_->tensor(names::kEmbed).dtype();
  embed_ = make_unit({{names::kEmbed, vd, embed_dtype}});
  if (!c.tie_word_embeddings)
    head_ = make_unit({{names::kLmHead, vd, mm}});
  else if (embed_dtype != mm)  // tied, but the GEMM wants another dtype than the lookup table
    head_ = make_unit({{names::kEmbed, vd, mm}});
  final_norm_ = ckpt_->tensor(names::kFinalNorm).to_dtype(DType::F32).to(options_.device);  // a copy
}

FsdpWeightProvider::~FsdpWeightProvider() {
  // A Request's destructor waits for its collective (which the other ranks take part in).
  for (Slot& s : slots_) s.pending.reset();
}

void FsdpWeightProvider::check_same_model_everywhere() const {
  const Qwen3Config& c = config();
  // Everything the shard sizes and the sequence of collectives depend on.
  const int64_t mine[] = {
      c.num_hidden_layers,   c.vocab_size,          c.hidden_size, c.intermediate_size,
      c.num_attention_heads, c.num_key_value_heads, c.head_dim,    c.tie_word_embeddings ? 1 : 0};
  constexpr size_t n = std::size(mine);
  std::vector<int64_t> all(n * static_cast<size_t>(comm_.size()));
  comm_.all_gather_bytes(mine, all.data(), sizeof mine);
  for (int r = 1; r < comm_.size(); ++r)
    if (!std::equal(all.begin(), all.begin() + n, all.begin() + static_cast<ptrdiff_t>(r * n)))
      fail(
          "{}: rank {} opened a model of another shape than rank 0 did (layers, vocab, hidden, "
          "intermediate, heads, kv heads, head_dim or tying differ); every rank must open the "
          "same checkpoint",
          ckpt_->dir(), r);
}

FsdpWeightProvider::Unit FsdpWeightProvider::make_unit(std::vector<TensorSpec> tensors) const {
  Unit u;
  int64_t total = 0;
  for (auto& [name, shape, dtype] : tensors) {
    total = round_up(total, kAlignBytes);
    const int64_t offset = total;
    total += shape_numel(shape) * static_cast<int64_t>(dtype_size(dtype));
    u.pieces.push_back({std::move(name), std::move(shape), dtype, offset});
  }
  const int64_t n = comm_.size();
  u.shard_len = round_up((total + n - 1) / n, kAlignBytes);
  Tensor host = Tensor::zeros({u.shard_len}, DType::U8);  // padding stays zero
  // This rank's byte range of the flat vector, and the elements of each tensor that fall in
  // it: only those bytes of the mapping are read.
  const int64_t lo = comm_.rank() * u.shard_len, hi = lo + u.shard_len;
  char* dst = static_cast<char*>(host.raw());
  for (const Piece& p : u.pieces) {
    const auto elem = static_cast<int64_t>(dtype_size(p.dtype));
    const int64_t begin = std::max(lo, p.offset), end = std::min(hi, p.offset + shape_numel(p.shape) * elem);
    if (begin >= end) continue;
    convert_slice(ckpt_->tensor(p.name), (begin - p.offset) / elem, (end - begin) / elem, p.dtype,
                  dst + (begin - lo));
  }
  u.shard = options_.device == Device::CPU ? std::move(host) : host.to(options_.device);
  return u;
}

std::unique_ptr<dist::Request> FsdpWeightProvider::start_gather(const Unit& unit, Tensor& buffer,
                                                          bool blocking) {
  if (!gathers()) {  // one rank: the shard is the whole vector
    buffer = unit.shard;
    return nullptr;
  }
  const NvtxRange range("all-gather");
  const int64_t full = unit.shard_len * comm_.size();
  if (buffer.numel() != full || buffer.device() != options_.device)
    buffer = Tensor::empty({full}, DType::U8, options_.device);
  const void* send = unit.shard.raw();
  void* recv = buffer.raw();
  const auto bytes = static_cast<size_t>(unit.shard_len);
  if (blocking) {
    comm_.all_gather_bytes(send, recv, bytes);
    return nullptr;
  }
  return comm_.all_gather_bytes_async(send, recv, bytes);
}

Tensor FsdpWeightProvider::view_of(const Tensor& buffer, const Piece& piece) const {
  return buffer.view_bytes(static_cast<size_t>(piece.offset), piece.shape, piece.dtype);
}

void FsdpWeightProvider::settle(Slot& slot) {
  if (!slot.pending) return;
  slot.pending->wait();
  slot.pending.reset();
}

void FsdpWeightProvider::fill_slot(Slot& slot, int64_t l, bool prefetch) {
  RETAIN_CHECK(!slot.pending, "fill_slot: slot still receiving layer {}", slot.layer);
  const Unit& unit = layers_[static_cast<size_t>(l)];
  slot.layer = -1;  // until the gather is started (an error leaves the slot empty)
  slot.pending = start_gather(unit, slot.buffer, /*blocking=*/!prefetch);
  slot.layer = l;
  slot.prefetched = prefetch;
  const std::array<Tensor*, 11> fields = layer_fields(slot.weights);
  RETAIN_CHECK(unit.pieces.size() == fields.size(), "layer {} has {} tensors", l,
               unit.pieces.size());
  for (size_t i = 0; i < fields.size(); ++i) *fields[i] = view_of(slot.buffer, unit.pieces[i]);
  ++stats_.layer_gathers;
}

const LayerWeights& FsdpWeightProvider::layer(int64_t l) {
  const int64_t layers = config().num_hidden_layers;
  if (l < 0 || l >= layers)
    fail("{}: layer {} requested from a {}-layer model", ckpt_->dir(), l, layers);
  release_global();  // documented: the globals live until the next layer() call
  ++stats_.layer_requests;
  layer_range_.start(fmt::format("layer {}", l).c_str());

  if (current_ >= 0 && slots_[static_cast<size_t>(current_)].layer == l) {
    ++stats_.reused;
  } else {
    const int next = current_ < 0 ? 0 : 1 - current_;
    Slot& s = slots_[static_cast<size_t>(next)];
    settle(s);
    if (s.layer == l) {
      ++stats_.prefetch_hits;
    } else {
      if (s.prefetched) ++stats_.prefetch_misses;
      fill_slot(s, l, /*prefetch=*/false);
      ++stats_.waited_gathers;
    }
    s.prefetched = false;
    current_ = next;
  }

  // Gather the expected next layer into the other buffer (the one handed out before this
  // call, whose views are now invalid), unless it already holds it or is receiving it.
  const int64_t guess = policy_.observe(l);
  if (guess >= 0) {
    Slot& other = slots_[static_cast<size_t>(1 - current_)];
    if (other.layer != guess) {
      settle(other);
      if (other.prefetched) ++stats_.prefetch_misses;
      fill_slot(other, guess, /*prefetch=*/true);
    }
  }
  return slots_[static_cast<size_t>(current_)].weights;
}

const Tensor& FsdpWeightProvider::gathered_global(const Unit& unit, Global& g) {
  layer_range_.end();  // the layers' part of a pass is over
  if (g.full.numel() == 0) {
    start_gather(unit, g.buffer, /*blocking=*/true);
    g.full = view_of(g.buffer, unit.pieces.front());
    ++stats_.global_gathers;
  }
  return g.full;
}

const Tensor& FsdpWeightProvider::embedding() { return gathered_global(embed_, embed_full_); }

const Tensor& FsdpWeightProvider::lm_head() {
  return head_.pieces.empty() ? embedding() : gathered_global(head_, head_full_);
}

void FsdpWeightProvider::release_global() {
  layer_range_.end();
  embed_full_ = Global{};
  head_full_ = Global{};
}

int64_t FsdpWeightProvider::shard_bytes() const {
  auto bytes =
      static_cast<int64_t>(embed_.shard.nbytes() + head_.shard.nbytes() + final_norm_.nbytes());
  for (const Unit& u : layers_) bytes += static_cast<int64_t>(u.shard.nbytes());
  return bytes;
}

int64_t FsdpWeightProvider::resident_bytes() const {
  int64_t bytes = shard_bytes();
  if (!gathers()) return bytes;  // every buffer is a view of a shard
  for (const Slot& s : slots_) bytes += static_cast<int64_t>(s.buffer.nbytes());
  return bytes + static_cast<int64_t>(embed_full_.buffer.nbytes() + head_full_.buffer.nbytes());
}

}  // namespace retain::trainer
