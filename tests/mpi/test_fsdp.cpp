// FsdpWeightProvider against LocalWeightProvider (the independent reference: whole tensors
// converted by the same checkpoint reader, no sharding, no communication). Every value must
// be bit-identical, for every order of requests, for tied and untied models, for BF16, F16
// and F32 checkpoints, and through the whole Qwen3 forward. Runs as one rank and under
// mpirun -np 2 and -np 3 (the tiny models' sizes split unevenly across 2 and 3 ranks, and
// shard boundaries fall inside tensors).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/base/error.h"
#include "model/gates/gates.h"
#include "model/qwen3.h"
#include "data/formats/safetensors.h"
#include "model/tiny.h"
#include "model/weights.h"
#include "tests/mpi/mpi_test_main.h"
#include "trainer/fsdp.h"

namespace retain::dist {
namespace {

// FSDP is the trainer's (trainer/fsdp.h), standing on the communicator tested here.
using trainer::FsdpOptions;
using trainer::FsdpStats;
using trainer::FsdpWeightProvider;
using trainer::LayerPrefetchPolicy;

namespace fs = std::filesystem;

Comm& comm() { return mpi_test::world(); }

// ---- the models: written once by rank 0 into a directory every rank then opens ----------

TinyModelOptions tied_options() {
  TinyModelOptions o;
  o.layers = 5;
  o.hidden = 48;
  o.heads = 4;
  o.kv_heads = 2;
  o.head_dim = 16;
  o.intermediate = 80;
  o.vocab = 301;
  o.tie = true;
  o.seed = 11;
  o.gate_kind = gates::GateKind::trimkv;
  o.gate_hidden = 8;
  return o;
}

TinyModelOptions untied_options() {
  TinyModelOptions o;
  o.layers = 4;
  o.hidden = 40;
  o.heads = 2;
  o.kv_heads = 1;
  o.head_dim = 24;
  o.intermediate = 72;
  o.vocab = 263;
  o.tie = false;
  o.seed = 12;
  return o;
}

// Rewrites dir/model.safetensors with its tensors stored as BF16, F16 and F32 in turn, so
// that every conversion the provider may meet is exercised (and mixed within a layer).
void mix_dtypes(const std::string& dir) {
  const std::string path = (fs::path(dir) / "model.safetensors").string();
  std::vector<std::pair<std::string, Tensor>> tensors;
  {
    const formats::SafetensorsFile file = formats::SafetensorsFile::open(path);
    const DType kinds[] = {DType::BF16, DType::F16, DType::F32};
    size_t i = 0;
    for (const std::string& name : file.names())
      tensors.emplace_back(name, file.tensor(name).to_dtype(DType::F32).to_dtype(kinds[i++ % 3]));
  }
  formats::write_safetensors(path, tensors);
}

class Models : public ::testing::Environment {
 public:
  void SetUp() override {
    char path[4096] = {};
    if (comm().is_main_rank()) {
      std::string tmpl = (fs::temp_directory_path() / "retain_fsdp_XXXXXX").string();
      if (mkdtemp(tmpl.data()) == nullptr)
        std::snprintf(path, sizeof path, "%s", "");
      else
        std::snprintf(path, sizeof path, "%s", tmpl.c_str());
      if (path[0] != '\0') {
        make_tiny_model(path + std::string("/tied"), tied_options());
        make_tiny_model(path + std::string("/untied"), untied_options());
        mix_dtypes(path + std::string("/untied"));
        TinyModelOptions three = tied_options();
        three.layers = 3;
        make_tiny_model(path + std::string("/three_layers"), three);
      }
    }
    comm().broadcast(path, sizeof path, 0);  // also a barrier: the files are complete
    RETAIN_CHECK(path[0] != '\0', "rank 0 could not make a temporary directory");
    root = path;
  }
  void TearDown() override {
    comm().barrier();  // nobody still reads the files
    if (comm().is_main_rank()) fs::remove_all(root);
  }
  static inline std::string root;
};

std::shared_ptr<const Qwen3Checkpoint> open_model(const std::string& name) {
  return std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(Models::root + "/" + name));
}

// ---- comparisons ----------------------------------------------------------------------------

::testing::AssertionResult same_bits(const Tensor& got, const Tensor& want) {
  if (got.dtype() != DType::F32 || want.dtype() != DType::F32)
    return ::testing::AssertionFailure() << "dtypes " << dtype_name(got.dtype()) << " and "
                                         << dtype_name(want.dtype()) << ", want F32";
  if (got.shape() != want.shape())
    return ::testing::AssertionFailure()
           << "shape " << shape_str(got.shape()) << ", want " << shape_str(want.shape());
  if (std::memcmp(got.raw(), want.raw(), want.nbytes()) != 0) {
    const float* g = got.data<float>();
    const float* w = want.data<float>();
    int64_t i = 0;
    while (std::memcmp(g + i, w + i, sizeof(float)) == 0) ++i;
    return ::testing::AssertionFailure() << "element " << i << " is " << g[i] << ", want " << w[i];
  }
  return ::testing::AssertionSuccess();
}

const char* const kFieldNames[] = {"input_norm", "q_proj",  "k_proj",   "v_proj",
                                   "o_proj",     "q_norm",  "k_norm",   "post_norm",
                                   "gate_proj",  "up_proj", "down_proj"};

// layer(l) of both providers, every field, bit for bit.
void expect_same_layer(FsdpWeightProvider& fsdp, LocalWeightProvider& local, int64_t l) {
  LayerWeights got = fsdp.layer(l), want = local.layer(l);
  const auto g = layer_fields(got), w = layer_fields(want);
  for (size_t i = 0; i < g.size(); ++i)
    EXPECT_TRUE(same_bits(*g[i], *w[i])) << "layer " << l << " " << kFieldNames[i];
}

std::vector<int64_t> forward_order(int64_t L) {
  std::vector<int64_t> o;
  for (int64_t l = 0; l < L; ++l) o.push_back(l);
  return o;
}
std::vector<int64_t> backward_order(int64_t L) {
  std::vector<int64_t> o;
  for (int64_t l = L - 1; l >= 0; --l) o.push_back(l);
  return o;
}
// One training step as the trainer asks: teacher forward, student forward, student backward.
std::vector<int64_t> training_step(int64_t L) {
  std::vector<int64_t> o = forward_order(L), f = forward_order(L), b = backward_order(L);
  o.insert(o.end(), f.begin(), f.end());
  o.insert(o.end(), b.begin(), b.end());
  return o;
}

// Set by the CTest registrations, so that a launcher that silently gave every process its
// own one-rank world cannot pass (every other test here would, comparing rank with itself).
TEST(FsdpWorld, SizeIsWhatTheLauncherAskedFor) {
  const char* want = std::getenv("RETAIN_TEST_WORLD_SIZE");
  if (want == nullptr) GTEST_SKIP() << "RETAIN_TEST_WORLD_SIZE is not set";
  EXPECT_EQ(comm().size(), std::atoi(want));
}

// ---- the prefetch policy alone ---------------------------------------------------------------

TEST(LayerPrefetchPolicy, FollowsTheDirectionOfTravel) {
  LayerPrefetchPolicy p(6);
  EXPECT_EQ(p.observe(0), 1);
  EXPECT_EQ(p.observe(1), 2);
  EXPECT_EQ(p.observe(2), 3);
  EXPECT_EQ(p.observe(2), 3);  // a repeat keeps the guess
  EXPECT_EQ(p.observe(1), 0);  // turned around
  EXPECT_EQ(p.observe(4), 3);  // a jump into the middle keeps the direction
  EXPECT_EQ(p.observe(5), 4);  // a jump to the last layer starts a backward pass
  EXPECT_EQ(p.observe(0), 1);  // a jump to the first, a forward pass
  LayerPrefetchPolicy one(1);
  EXPECT_EQ(one.observe(0), -1);
}

TEST(LayerPrefetchPolicy, LearnsWhatFollowsEachEnd) {
  const int64_t L = 4;
  LayerPrefetchPolicy p(L);
  // Count wrong guesses per training step: the first step learns, later ones make none.
  std::vector<int64_t> wrong;
  for (int step = 0; step < 4; ++step) {
    int64_t bad = 0, last = -1, guess = -1;
    for (int64_t l : training_step(L)) {
      if (l != last && last >= 0 && l != guess) ++bad;
      guess = p.observe(l);
      last = l;
    }
    wrong.push_back(bad);
  }
  EXPECT_GT(wrong[0], 0);
  EXPECT_EQ(wrong[1], 1);  // only the first end: its context (after a backward) is new
  EXPECT_EQ(wrong[2], 0);
  EXPECT_EQ(wrong[3], 0);
}

// ---- layers ------------------------------------------------------------------------------------

class FsdpLayers : public ::testing::TestWithParam<const char*> {};

TEST_P(FsdpLayers, EveryOrderEqualsTheLocalProvider) {
  const auto ckpt = open_model(GetParam());
  FsdpWeightProvider fsdp(ckpt, comm());
  LocalWeightProvider local(ckpt);
  const int64_t L = ckpt->config().num_hidden_layers;

  std::vector<std::vector<int64_t>> orders = {forward_order(L),
                                              backward_order(L),
                                              training_step(L),
                                              training_step(L),
                                              {2, 2, 0, L - 1, L - 1, 1, 3, 3, 3, 0}};
  std::mt19937 rng(7);  // the same on every rank: the same sequence of collectives
  std::uniform_int_distribution<int64_t> any(0, L - 1);
  std::vector<int64_t> random(60);
  for (int64_t& l : random) l = any(rng);
  orders.push_back(random);

  for (const auto& order : orders)
    for (int64_t l : order) expect_same_layer(fsdp, local, l);
  const FsdpStats& s = fsdp.stats();
  EXPECT_EQ(s.layer_requests, s.prefetch_hits + s.waited_gathers + s.reused);
}

TEST_P(FsdpLayers, GlobalsEqualTheLocalProvider) {
  const auto ckpt = open_model(GetParam());
  FsdpWeightProvider fsdp(ckpt, comm());
  LocalWeightProvider local(ckpt);
  const Tensor want_embedding = local.embedding().to_dtype(DType::F32);  // stored BF16/F16/F32

  EXPECT_TRUE(same_bits(fsdp.final_norm(), local.final_norm()));
  EXPECT_TRUE(same_bits(fsdp.embedding(), want_embedding));
  EXPECT_TRUE(same_bits(fsdp.lm_head(), local.lm_head()));
  if (ckpt->config().tie_word_embeddings) {
    EXPECT_EQ(fsdp.lm_head().raw(), fsdp.embedding().raw());  // one gathered tensor
    EXPECT_EQ(fsdp.stats().global_gathers, 1);
  } else {
    EXPECT_FALSE(same_bits(fsdp.lm_head(), want_embedding));  // really another tensor
    EXPECT_EQ(fsdp.stats().global_gathers, 2);
  }
  // Still gathered: asking again costs nothing.
  const int64_t gathers = fsdp.stats().global_gathers;
  fsdp.embedding();
  fsdp.lm_head();
  EXPECT_EQ(fsdp.stats().global_gathers, gathers);
  // A layer() call releases them; asking again gathers again, with the same values.
  expect_same_layer(fsdp, local, 0);
  EXPECT_TRUE(same_bits(fsdp.lm_head(), local.lm_head()));
  EXPECT_GT(fsdp.stats().global_gathers, gathers);
  fsdp.release_global();
  EXPECT_TRUE(same_bits(fsdp.embedding(), want_embedding));
  EXPECT_TRUE(same_bits(fsdp.final_norm(), local.final_norm()));
}

TEST_P(FsdpLayers, OutOfRangeLayersAreErrors) {
  const auto ckpt = open_model(GetParam());
  FsdpWeightProvider fsdp(ckpt, comm());
  const int64_t L = ckpt->config().num_hidden_layers;
  EXPECT_THROW(fsdp.layer(L), retain::Error);  // checked before any collective, on every rank
  EXPECT_THROW(fsdp.layer(-1), retain::Error);
  LocalWeightProvider local(ckpt);
  expect_same_layer(fsdp, local, L - 1);  // still usable
}

INSTANTIATE_TEST_SUITE_P(Models, FsdpLayers, ::testing::Values("tied", "untied"),
                         [](const auto& p) { return std::string(p.param); });

// ---- the prefetch in a training loop ------------------------------------------------------------

TEST(FsdpPrefetch, SteadyTrainingStepsNeverWait) {
  const auto ckpt = open_model("tied");
  FsdpWeightProvider fsdp(ckpt, comm());
  const int64_t L = ckpt->config().num_hidden_layers;
  auto run_step = [&] {
    for (int64_t l : training_step(L)) fsdp.layer(l);
  };
  run_step();  // learns what follows each end
  run_step();  // the backward-then-forward turn is first seen here
  const FsdpStats before = fsdp.stats();
  run_step();
  run_step();
  const FsdpStats& after = fsdp.stats();
  EXPECT_EQ(after.waited_gathers, before.waited_gathers);
  EXPECT_EQ(after.prefetch_misses, before.prefetch_misses);
  // Each step: 3L requests, two of them for the layer in use (the backward starts with the
  // last layer, where the second forward ended; the next step starts with layer 0, where the
  // backward ended); every other request finds its layer gathered ahead.
  EXPECT_EQ(after.layer_requests - before.layer_requests, 2 * 3 * L);
  EXPECT_EQ(after.reused - before.reused, 2 * 2);
  EXPECT_EQ(after.prefetch_hits - before.prefetch_hits, 2 * (3 * L - 2));
}

// ---- the forward, bit for bit ----------------------------------------------------------------

// Token ids and document ids: two documents and a padded tail.
std::pair<Tensor, Tensor> batch(int64_t vocab, int64_t T) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> ids(static_cast<size_t>(T)), doc(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    ids[size_t(t)] = tok(rng);
    doc[size_t(t)] = t < T / 2 ? 4 : (t < T - 3 ? 5 : -1);
  }
  return {Tensor::from_vector(ids, {T}), Tensor::from_vector(doc, {T})};
}

class FsdpForward : public ::testing::TestWithParam<const char*> {};

TEST_P(FsdpForward, Qwen3ForwardIsBitIdentical) {
  const auto ckpt = open_model(GetParam());
  const Qwen3Config& c = ckpt->config();
  const auto [ids, doc] = batch(c.vocab_size, 29);
  LocalWeightProvider local(ckpt);
  const Tensor want = qwen3_forward(local, ids, doc);

  FsdpWeightProvider fsdp(ckpt, comm());
  for (int pass = 0; pass < 2; ++pass)  // the second pass starts with a prefetch in flight
    EXPECT_TRUE(same_bits(qwen3_forward(fsdp, ids, doc), want)) << "pass " << pass;

  // The gated student too, where the model has gates.
  const std::string gates_path = ckpt->dir() + "/gates.safetensors";
  if (fs::exists(gates_path)) {
    const auto g = gates::RetentionGates::load(gates_path, c);
    const Tensor want_student = qwen3_forward(local, ids, doc, {}, &g);
    EXPECT_FALSE(same_bits(want_student, want));  // the gates matter
    EXPECT_TRUE(same_bits(qwen3_forward(fsdp, ids, doc, {}, &g), want_student));
  }
}

// Gathers in small pieces (several nonblocking collectives per layer, strided datatypes).
TEST_P(FsdpForward, ChunkedGathersGiveTheSameForward) {
  const auto ckpt = open_model(GetParam());
  const auto [ids, doc] = batch(ckpt->config().vocab_size, 17);
  LocalWeightProvider local(ckpt);
  const Tensor want = qwen3_forward(local, ids, doc);
  comm().set_max_chunk(1000);
  {
    FsdpWeightProvider fsdp(ckpt, comm());
    EXPECT_TRUE(same_bits(qwen3_forward(fsdp, ids, doc), want));
    for (int64_t l : training_step(ckpt->config().num_hidden_layers))
      expect_same_layer(fsdp, local, l);
  }  // destroyed before the chunk limit is restored: its last prefetch used the small pieces
  comm().set_max_chunk(INT_MAX);
}

INSTANTIATE_TEST_SUITE_P(Models, FsdpForward, ::testing::Values("tied", "untied"),
                         [](const auto& p) { return std::string(p.param); });

// ---- the GPU layout (BF16 matrices), on the CPU ---------------------------------------------

// What DeviceWeightProvider holds, on the host, from whole tensors: projections and lm_head
// BF16, norms F32, the embedding as stored. The reference for FsdpOptions{CPU, BF16}, whose
// layout is the one FSDP uses on GPUs.
class Bf16Reference final : public WeightProvider {
 public:
  explicit Bf16Reference(std::shared_ptr<const Qwen3Checkpoint> ckpt) : ckpt_(std::move(ckpt)) {
    const Qwen3Config& c = config();
    layers_.resize(static_cast<size_t>(c.num_hidden_layers));
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const auto tensors = layer_tensors(c, l);
      const auto fields = layer_fields(layers_[static_cast<size_t>(l)]);
      for (size_t i = 0; i < tensors.size(); ++i) {
        const Tensor t = ckpt_->tensor(tensors[i].first);
        *fields[i] = t.to_dtype(t.ndim() == 1 ? DType::F32 : DType::BF16);
      }
    }
    embedding_ = ckpt_->tensor(names::kEmbed).clone();
    lm_head_ = ckpt_->tensor(c.tie_word_embeddings ? names::kEmbed : names::kLmHead).to_dtype(DType::BF16);
    final_norm_ = ckpt_->tensor(names::kFinalNorm).to_dtype(DType::F32);
  }
  const Qwen3Config& config() const override { return ckpt_->config(); }
  const LayerWeights& layer(int64_t l) override { return layers_[static_cast<size_t>(l)]; }
  const Tensor& embedding() override { return embedding_; }
  const Tensor& final_norm() override { return final_norm_; }
  const Tensor& lm_head() override { return lm_head_; }

 private:
  std::shared_ptr<const Qwen3Checkpoint> ckpt_;
  std::vector<LayerWeights> layers_;
  Tensor embedding_, final_norm_, lm_head_;
};

::testing::AssertionResult same_bytes(const Tensor& got, const Tensor& want) {
  if (got.dtype() != want.dtype())
    return ::testing::AssertionFailure() << "dtype " << dtype_name(got.dtype()) << ", want " << dtype_name(want.dtype());
  if (got.shape() != want.shape())
    return ::testing::AssertionFailure() << "shape " << shape_str(got.shape()) << ", want " << shape_str(want.shape());
  if (got.device() != Device::CPU) return ::testing::AssertionFailure() << "not on the CPU";
  if (std::memcmp(got.raw(), want.raw(), want.nbytes()) != 0) return ::testing::AssertionFailure() << "bytes differ";
  return ::testing::AssertionSuccess();
}

class FsdpBf16 : public ::testing::TestWithParam<const char*> {};

TEST_P(FsdpBf16, LayersAndGlobalsEqualTheDeviceLayout) {
  const auto ckpt = open_model(GetParam());
  FsdpWeightProvider fsdp(ckpt, comm(), {Device::CPU, DType::BF16});
  Bf16Reference want(ckpt);
  for (int64_t l : training_step(ckpt->config().num_hidden_layers)) {
    LayerWeights got = fsdp.layer(l), ref = want.layer(l);
    const auto g = layer_fields(got), w = layer_fields(ref);
    for (size_t i = 0; i < g.size(); ++i) EXPECT_TRUE(same_bytes(*g[i], *w[i])) << "layer " << l << " " << kFieldNames[i];
  }
  EXPECT_TRUE(same_bytes(fsdp.final_norm(), want.final_norm()));
  EXPECT_TRUE(same_bytes(fsdp.embedding(), want.embedding()));
  EXPECT_TRUE(same_bytes(fsdp.lm_head(), want.lm_head()));
  // A tied head shares the gathered embedding only when the embedding is stored as BF16.
  const bool shared = ckpt->config().tie_word_embeddings && want.embedding().dtype() == DType::BF16;
  EXPECT_EQ(fsdp.lm_head().raw() == fsdp.embedding().raw(), shared);
}

// The views' dtypes and shapes serve the whole forward (the CPU GEMMs read BF16 weights).
TEST_P(FsdpBf16, ForwardEqualsTheDeviceLayout) {
  const auto ckpt = open_model(GetParam());
  const auto [ids, doc] = batch(ckpt->config().vocab_size, 23);
  Bf16Reference ref(ckpt);
  const Tensor want = qwen3_forward(ref, ids, doc);
  FsdpWeightProvider fsdp(ckpt, comm(), {Device::CPU, DType::BF16});
  for (int pass = 0; pass < 2; ++pass) EXPECT_TRUE(same_bits(qwen3_forward(fsdp, ids, doc), want)) << "pass " << pass;
}

INSTANTIATE_TEST_SUITE_P(Models, FsdpBf16, ::testing::Values("tied", "untied"),
                         [](const auto& p) { return std::string(p.param); });

// ---- force_gather: the N-rank path in any world, one rank included -------------------------

// The world comm, counting the all_gather_bytes calls (blocking or not) that go through it.
class CountingComm final : public Comm {
 public:
  explicit CountingComm(Comm& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string_view backend() const override { return inner_.backend(); }
  int64_t gathers = 0;

 private:
  void do_all_gather(const float* s, float* r, size_t n) override { inner_.all_gather(s, r, n); }
  std::unique_ptr<Request> do_all_gather_async(const float* s, float* r, size_t n) override {
    return inner_.all_gather_async(s, r, n);
  }
  void do_all_gather_bytes(const void* s, void* r, size_t n) override {
    ++gathers;
    inner_.all_gather_bytes(s, r, n);
  }
  std::unique_ptr<Request> do_all_gather_bytes_async(const void* s, void* r, size_t n) override {
    ++gathers;
    return inner_.all_gather_bytes_async(s, r, n);
  }
  std::unique_ptr<Request> do_ring_shift_bytes_async(const void* s, void* r, size_t n, int distance) override {
    return inner_.ring_shift_bytes_async(s, r, n, distance);
  }
  void do_reduce_scatter(const float* s, float* r, size_t n) override { inner_.reduce_scatter(s, r, n); }
  void do_all_reduce(float* b, size_t n) override { inner_.all_reduce(b, n); }
  void do_all_reduce(double* b, size_t n) override { inner_.all_reduce(b, n); }
  void do_all_reduce_max(double* b, size_t n) override { inner_.all_reduce_max(b, n); }
  void do_broadcast(void* b, size_t n, int root) override { inner_.broadcast(b, n, root); }
  void do_barrier() override { inner_.barrier(); }
  void do_abort(int code) override { inner_.abort(code); }
  std::unique_ptr<Comm> do_split(int color, int key) override { return inner_.split(color, key); }

  Comm& inner_;
};

// Forced and plain providers in the same world, over the F32 and the GPU's BF16 layout: the
// same bytes for every layer and global, the same forward, the same counters; the forced one
// gathers every layer and global through the comm (a one-rank plain one never does) into
// buffers of its own.
class FsdpForceGather : public ::testing::TestWithParam<const char*> {};

TEST_P(FsdpForceGather, GathersThroughTheCommWithTheSameValues) {
  const auto ckpt = open_model(GetParam());
  const Qwen3Config& c = ckpt->config();
  const int64_t L = c.num_hidden_layers;
  const auto [ids, doc] = batch(c.vocab_size, 19);
  for (const DType mm : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(mm));
    CountingComm plain_comm(comm()), forced_comm(comm());
    FsdpWeightProvider plain(ckpt, plain_comm, {Device::CPU, mm});
    FsdpWeightProvider forced(ckpt, forced_comm, {Device::CPU, mm, /*force_gather=*/true});
    EXPECT_EQ(plain.gathers(), comm().size() > 1);
    EXPECT_TRUE(forced.gathers());
    const int64_t setup = forced_comm.gathers;  // the constructor's shape check
    EXPECT_EQ(plain_comm.gathers, setup);
    EXPECT_EQ(forced.shard_bytes(), plain.shard_bytes());

    std::vector<int64_t> order = training_step(L), again = training_step(L);
    order.insert(order.end(), again.begin(), again.end());
    for (int64_t l : order) {
      LayerWeights got = forced.layer(l), want = plain.layer(l);
      const auto g = layer_fields(got), w = layer_fields(want);
      for (size_t i = 0; i < g.size(); ++i) EXPECT_TRUE(same_bytes(*g[i], *w[i])) << "layer " << l << " " << kFieldNames[i];
    }
    EXPECT_GT(forced.resident_bytes(), forced.shard_bytes()) << "two layer buffers of its own";
    EXPECT_TRUE(same_bytes(forced.embedding(), plain.embedding()));
    EXPECT_TRUE(same_bytes(forced.lm_head(), plain.lm_head()));
    EXPECT_TRUE(same_bits(qwen3_forward(forced, ids, doc), qwen3_forward(plain, ids, doc)));

    const FsdpStats& f = forced.stats();
    const FsdpStats& p = plain.stats();
    EXPECT_EQ(forced_comm.gathers - setup, f.layer_gathers + f.global_gathers);
    EXPECT_EQ(plain_comm.gathers - setup, comm().size() > 1 ? p.layer_gathers + p.global_gathers : 0);
    EXPECT_GT(f.layer_gathers, 2 * L) << "the prefetch keeps gathering";
    EXPECT_GT(f.prefetch_hits, 0);
    EXPECT_EQ(f.layer_gathers, p.layer_gathers);
    EXPECT_EQ(f.prefetch_hits, p.prefetch_hits);
    EXPECT_EQ(f.waited_gathers, p.waited_gathers);
    EXPECT_EQ(f.global_gathers, p.global_gathers);
  }
}

INSTANTIATE_TEST_SUITE_P(Models, FsdpForceGather, ::testing::Values("tied", "untied"),
                         [](const auto& p) { return std::string(p.param); });

// ---- memory: about 1/N of the model per rank --------------------------------------------------

// F32 bytes of the whole model (each tensor once; a tied head is the embedding).
int64_t model_f32_bytes(const Qwen3Config& c) {
  int64_t n = 0;
  for (const auto& [name, shape] : expected_tensors(c)) n += shape_numel(shape);
  return n * 4;
}

TEST(FsdpMemory, EachRankHoldsAboutOneNth) {
  for (const char* name : {"tied", "untied"}) {
    const auto ckpt = open_model(name);
    const Qwen3Config& c = ckpt->config();
    FsdpWeightProvider fsdp(ckpt, comm());
    const int64_t N = comm().size(), model = model_f32_bytes(c);
    const int64_t norm = c.hidden_size * 4;  // kept whole on every rank
    const int64_t units = c.num_hidden_layers + (c.tie_word_embeddings ? 1 : 2);
    // Padding: < 16 floats before each of a layer's 11 tensors, < N * 16 + N per unit to
    // make N equal 64-byte-aligned shards.
    const int64_t slack = units * (11 * 16 * 4 / N + 17 * 4);
    const int64_t shard = fsdp.shard_bytes();
    EXPECT_GE(shard, (model - norm) / N + norm) << name;
    EXPECT_LE(shard, (model - norm) / N + norm + slack) << name;
    EXPECT_EQ(fsdp.resident_bytes(), shard) << name << ": nothing gathered yet";

    // Shards of all ranks together: the model once, plus padding and N-1 extra final norms.
    double total = static_cast<double>(shard);
    comm().all_reduce(&total, 1);
    EXPECT_GE(total, static_cast<double>(model + (N - 1) * norm)) << name;
    EXPECT_LE(total, static_cast<double>(model + (N - 1) * norm + N * slack)) << name;

    // Two layer buffers while layers are in use, and a gathered global until released.
    fsdp.layer(0);
    const int64_t with_layers = fsdp.resident_bytes();
    fsdp.embedding();
    fsdp.lm_head();
    const int64_t with_globals = fsdp.resident_bytes();
    fsdp.release_global();
    EXPECT_EQ(fsdp.resident_bytes(), with_layers) << name;
    if (N == 1) {
      EXPECT_EQ(with_layers, shard) << name << ": one rank gathers nothing";
      EXPECT_EQ(with_globals, shard) << name;
    } else {
      int64_t one_layer = 0;
      for (const auto& [n, shape] : layer_tensors(c, 0)) one_layer += shape_numel(shape) * 4;
      EXPECT_GE(with_layers - shard, 2 * one_layer) << name;
      EXPECT_LE(with_layers - shard, 2 * (one_layer + 11 * 16 * 4 + N * 17 * 4)) << name;
      const int64_t vd = c.vocab_size * c.hidden_size * 4;
      const int64_t globals = c.tie_word_embeddings ? vd : 2 * vd;
      EXPECT_GE(with_globals - with_layers, globals) << name;
      EXPECT_LE(with_globals - with_layers, globals + (globals / vd) * N * 17 * 4) << name;
    }

    // Everyone's numbers, printed by rank 0 for the record.
    std::vector<double> mine = {double(shard), double(with_layers), double(with_globals)};
    std::vector<double> all(mine.size() * size_t(N));
    comm().all_gather_bytes(mine.data(), all.data(), mine.size() * sizeof(double));
    if (comm().is_main_rank()) {
      std::printf(
          "[ memory   ] %s: model %lld bytes F32; per rank (shards / +2 layer buffers / "
          "+globals):",
          name, static_cast<long long>(model));
      for (int64_t r = 0; r < N; ++r)
        std::printf(" r%lld %.0f (%.1f%%) / %.0f / %.0f", static_cast<long long>(r),
                    all[size_t(r) * 3], 100.0 * all[size_t(r) * 3] / double(model),
                    all[size_t(r) * 3 + 1], all[size_t(r) * 3 + 2]);
      std::printf("\n");
    }
  }
}

// ---- every rank must open the same model ----------------------------------------------------

TEST(FsdpSetup, RanksWithDifferentModelsAllFail) {
  if (comm().size() < 2) GTEST_SKIP() << "needs two ranks";
  // Odd ranks open a model with fewer layers: every rank must throw, none may hang.
  const auto ckpt = open_model(comm().rank() % 2 ? "three_layers" : "tied");
  try {
    FsdpWeightProvider fsdp(ckpt, comm());
    ADD_FAILURE() << "different models on different ranks were accepted";
  } catch (const retain::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 1 opened a model of another shape than rank 0"), std::string::npos)
        << what;
  }
}

// ---- how much of a prefetch overlaps computation (a measurement, only when asked) ----------

// A layer of Qwen3-0.6B's width (hidden 1024, intermediate 3072: 15.7M floats, 63 MB in F32):
// the time layer() blocks when its layer was not prefetched, and when it was, with busy
// "computation" between requests that makes no MPI call (as the model graph's).
TEST(FsdpBench, PrefetchOverlap) {
  const char* bench = std::getenv("RETAIN_FSDP_BENCH");
  if (bench == nullptr || std::string(bench) != "1") GTEST_SKIP() << "set RETAIN_FSDP_BENCH=1";
  char path[4096] = {};
  if (comm().is_main_rank()) {
    TinyModelOptions o;
    o.layers = 4;
    o.hidden = 1024;
    o.heads = 16;
    o.kv_heads = 8;
    o.head_dim = 128;
    o.intermediate = 3072;
    o.vocab = 512;
    std::snprintf(path, sizeof path, "%s/bench", Models::root.c_str());
    make_tiny_model(path, o);
  }
  comm().broadcast(path, sizeof path, 0);
  const auto ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(path));
  FsdpWeightProvider fsdp(ckpt, comm());
  using Clock = std::chrono::steady_clock;
  auto busy = [](double seconds) {  // computation: no MPI calls
    const auto end = Clock::now() + std::chrono::duration<double>(seconds);
    volatile double x = 0;
    while (Clock::now() < end) x = x + 1;
  };
  auto timed_layer = [&](int64_t l) {
    const auto t0 = Clock::now();
    fsdp.layer(l);
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  // Unprefetched: jump around so that every guess is wrong (each request waits for a
  // wrong prefetch and gathers its own layer).
  double cold = 0;
  const int64_t jumps[] = {0, 2, 0, 2, 0, 2, 0, 2};
  for (int64_t l : jumps) cold += timed_layer(l);
  cold /= std::size(jumps);
  for (double compute : {0.0, 0.05, 0.2}) {
    double warm = 0;
    int n = 0;
    for (int pass = 0; pass < 3; ++pass)
      for (int64_t l = 0; l < 4; ++l) {
        const double t = timed_layer(l);
        if (pass > 0 && l > 0) warm += t, ++n;  // prefetched requests only
        busy(compute);
      }
    if (comm().is_main_rank())
      std::printf(
          "[ bench    ] %d ranks: layer() %.1f ms unprefetched; prefetched after %.0f ms of "
          "compute: %.1f ms\n",
          comm().size(), 1e3 * cold, 1e3 * compute, 1e3 * warm / n);
  }
  LocalWeightProvider local(ckpt);
  expect_same_layer(fsdp, local, 3);
}

const auto* const g_models = ::testing::AddGlobalTestEnvironment(new Models);

}  // namespace
}  // namespace retain::dist
