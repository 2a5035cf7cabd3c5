// FSDP-sharded frozen weights (DESIGN §2): each rank keeps 1/N of every parameter and
// all-gathers what the model asks for just before it is used, one layer at a time,
// prefetching the layer it will probably ask for next.
//
// Where and in what dtype (FsdpOptions). On the CPU every tensor is F32 (LocalWeightProvider's
// values). On a GPU (Device::CUDA) the shards and the gathered buffers live in device memory
// and the dtypes are DeviceWeightProvider's: projections and lm_head in the matmul dtype (BF16:
// half the bytes to keep and to gather), norms F32, the embedding as the checkpoint stores it
// (F32 when the matmul dtype is F32). A tied lm_head shares the embedding when their dtypes
// agree and is a unit of its own otherwise.
//
// Layout. Every layer is one flat byte vector (its 11 tensors in LayerWeights order, each
// starting on a 64-byte boundary, each in its own dtype), padded with zeros to N equal shards
// (N = world size); rank r keeps shard r, converted from the checkpoint's BF16/F16/F32 once at
// construction by reading only its own slice of the memory-mapped file (shard boundaries fall
// on 64-byte boundaries, so never inside an element). The embedding and the lm_head are
// sharded the same way, as one vector each. The final norm ([D]) is small and kept whole on
// every rank. With N = 1 nothing is copied: the "gathered" buffers are views of the shards,
// so a one-rank run holds the model once; unless FsdpOptions::force_gather, which makes one
// rank gather through `comm` exactly as N ranks do (its one shard is the whole vector).
//
// On a GPU with the NCCL comm, a prefetch runs on the communication stream after the compute
// already queued (the buffer it overwrites held the layer before last, whose kernels may still
// be running) and is waited for by compute, not by the host: layer l+1's gather overlaps layer
// l's kernels. With the MPI comm, device buffers are staged through the host (comm.h).
// NVTX (kernels/base/nvtx.h): "all-gather" spans the host side of each gather (queueing it on
// NCCL; the whole copy on host backends) and "layer l" runs from layer(l) to the next call
// that replaces or leaves it (layer(), embedding(), lm_head(), release_global(), the
// destructor): on the timeline, layer l's kernels under it and layer l+1's gather beside it.
//
// Collectives. Every call that may gather (layer, embedding, lm_head, release_global, the
// constructor and the destructor) is a collective over `comm`: every rank must make the same
// sequence of these calls with the same arguments, as the model graph does when every rank
// runs the same step. Which calls actually communicate depends only on that sequence, so
// ranks never disagree. config(), final_norm(), resident_bytes() and stats() are local.
// `comm` must outlive the provider. Not thread-safe; call from the thread that owns `comm`.
//
// Validity of what is returned:
//   layer(l)             views into one of two layer buffers, valid until the next layer()
//                        call (the same contract as LocalWeightProvider). The other buffer
//                        receives the prefetch meanwhile.
//   embedding()/lm_head() [V, D], gathered on first request and kept until the next
//                        layer() call or release_global(), whichever comes first, then freed
//                        (when tied, both are the same tensor). So: embedding() before layer 0,
//                        lm_head() for a whole loss phase (teacher and student hidden states,
//                        logits and their gradient in chunks) as long as no layer() call comes
//                        in between. Asking again after a release gathers again.
//   final_norm()         F32 [D], valid for the provider's lifetime.
// (On a GPU, "valid" is stream-ordered: kernels queued on the compute stream while a view is
// valid read the right weights, whenever they run.)
//
// Prefetch. After serving layer l, the provider starts a nonblocking all_gather of the layer
// it expects next (LayerPrefetchPolicy): l+1 going up, l-1 going down, and at the first or
// last layer, what followed that end the last time in the same context (learned, so the
// steady pattern of a training step — forward, forward, backward, or forward then backward —
// runs without waiting after the first step). A wrong guess is waited for and discarded;
// results never depend on guesses. With MPI on CPU, a nonblocking collective advances mostly
// inside MPI calls (OpenMPI runs no progress thread), so the overlap with computation is
// partial: for a 63 MB layer on 2 ranks of one (busy) host, ~110 ms per blocking gather and
// ~30 ms still waited for after 50-200 ms of computation (test_fsdp's FsdpBench).
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/base/nvtx.h"
#include "kernels/dist/comm.h"
#include "model/weights.h"

namespace retain::trainer {

// Which layer to gather ahead, from the sequence of layer requests. Pure bookkeeping (no
// communication), deterministic, so every rank makes the same guesses.
class LayerPrefetchPolicy {
 public:
  explicit LayerPrefetchPolicy(int64_t layers);
  // Records a request for layer l; returns the layer expected next (never l), or -1 for a
  // one-layer model. A repeated request (l again) changes nothing and returns the last guess.
  int64_t observe(int64_t l);

 private:
  int64_t layers_;
  int64_t last_ = -1;
  int64_t dir_ = +1;
  int64_t guess_ = -1;
  // At an end (layer 0 or L-1, reached by moving toward it) the next request is learned,
  // keyed by (this end, the end reached before it: 0, 1 or none = 2).
  int prev_end_ = 2;
  int pending_key_ = -1;  // the key waiting for the next different request
  std::array<int64_t, 6> learned_;
};

// Counters for tests and logs.
struct FsdpStats {
  int64_t layer_requests = 0;   // layer() calls
  int64_t layer_gathers = 0;    // layer all_gathers started (prefetches included)
  int64_t prefetch_hits = 0;    // requests served by a prefetch (or a buffer that held it)
  int64_t prefetch_misses = 0;  // prefetched layers discarded unused
  int64_t waited_gathers = 0;   // requests that had to gather their layer there and then
  int64_t reused = 0;           // requests for the layer already being used
  int64_t global_gathers = 0;   // embedding / lm_head all_gathers
};

// Where the provider keeps the weights, and the dtype of the matrices the GEMMs read.
struct FsdpOptions {
  Device device = Device::CPU;
  DType matmul_dtype = DType::F32;  // F32 or BF16 (BF16 on CPU too: tests the GPU layout there)
  // Gather through `comm` in a one-rank world too, instead of serving views of the shards:
  // one GPU then runs the N-rank path (two reused layer buffers, the prefetch on NCCL's
  // communication stream, events, the comm's device timers), which is how exposed
  // communication is measured without a second GPU (retain-train --fsdp-force-gather,
  // docs/training.md). Costs two layer buffers and a copy of every layer used. No effect
  // with more than one rank, where every rank gathers anyway.
  bool force_gather = false;
};

class FsdpWeightProvider : public WeightProvider {
 public:
  // Collective. Every rank must open the same checkpoint; the constructor checks that all
  // ranks see the same configuration and tensor sizes (every rank fails alike otherwise).
  FsdpWeightProvider(std::shared_ptr<const Qwen3Checkpoint> ckpt, dist::Comm& comm, FsdpOptions options = {});
  // Collective: waits for a prefetch still in flight.
  ~FsdpWeightProvider() override;
  FsdpWeightProvider(const FsdpWeightProvider&) = delete;
  FsdpWeightProvider& operator=(const FsdpWeightProvider&) = delete;

  const Qwen3Config& config() const override { return ckpt_->config(); }
  Device device() const override { return options_.device; }
  const LayerWeights& layer(int64_t l) override;
  const Tensor& embedding() override;
  const Tensor& final_norm() override { return final_norm_; }
  const Tensor& lm_head() override;
  void release_global() override;

  // Bytes this rank holds now: shards, final norm, layer buffers and gathered globals.
  int64_t resident_bytes() const;
  // The part of resident_bytes() that never changes: shards and final norm.
  int64_t shard_bytes() const;
  const FsdpStats& stats() const { return stats_; }
  // True when layers are gathered through the comm (several ranks, or force_gather), false
  // when they are views of this rank's shards.
  bool gathers() const { return comm_.size() > 1 || options_.force_gather; }

 private:
  // One sharded flat byte vector: its tensors' names, shapes, dtypes and byte offsets, and
  // this rank's shard.
  struct Piece {
    std::string name;  // the checkpoint tensor it is converted from
    Shape shape;
    DType dtype;
    int64_t offset;  // bytes
  };
  struct Unit {
    std::vector<Piece> pieces;
    int64_t shard_len = 0;  // bytes per rank; the full vector is N * shard_len
    Tensor shard;           // U8 [shard_len] on the provider's device
  };
  struct TensorSpec {
    std::string name;
    Shape shape;
    DType dtype;
  };
  // A layer buffer: the layer it holds (or is receiving), its views, a gather in flight.
  struct Slot {
    int64_t layer = -1;
    bool prefetched = false;  // filled by a guess, not yet asked for
    Tensor buffer;
    LayerWeights weights;
    std::unique_ptr<dist::Request> pending;
  };
  // A gathered embedding or lm_head: the buffer and the [V, D] view of it (empty: released).
  struct Global {
    Tensor buffer;
    Tensor full;
  };

  Unit make_unit(std::vector<TensorSpec> tensors) const;
  // Starts gathering `unit` into `buffer` (allocated if needed; with one rank, the shard
  // itself); null when nothing is left to wait for.
  std::unique_ptr<dist::Request> start_gather(const Unit& unit, Tensor& buffer, bool blocking);
  void fill_slot(Slot& slot, int64_t l, bool prefetch);
  void settle(Slot& slot);  // waits for the slot's gather, if any
  Tensor view_of(const Tensor& buffer, const Piece& piece) const;
  const Tensor& gathered_global(const Unit& unit, Global& g);
  void check_same_model_everywhere() const;

  std::shared_ptr<const Qwen3Checkpoint> ckpt_;
  dist::Comm& comm_;
  FsdpOptions options_;
  std::vector<Unit> layers_;
  Unit embed_, head_;  // head_ has no pieces when the lm_head is the embedding
  Tensor final_norm_;
  Global embed_full_, head_full_;  // gathered globals (empty when released)
  std::array<Slot, 2> slots_;
  int current_ = -1;  // the slot handed out by the last layer() call
  LayerPrefetchPolicy policy_;
  FsdpStats stats_;
  NvtxSpan layer_range_;  // "layer l", from layer(l) to the next request
};

}  // namespace retain::trainer
