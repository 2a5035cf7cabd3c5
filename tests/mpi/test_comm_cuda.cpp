// The communicator and the FSDP provider on device buffers (label cuda; every test skips
// without a GPU). Runs as one rank and under mpirun -np 2; on a machine with one GPU the two
// ranks share it, which the MPI backend allows (it stages device buffers through the host) and
// NCCL does not (the NCCL tests then run in the one-rank world only, or with one GPU per rank).
//   - every collective of the world comm (local or MPI) on device buffers equals the values
//     computed from the ranks' known inputs, and so does the NCCL comm on device and on host
//     buffers;
//   - the NCCL comm's nonblocking gather is ordered before later kernels without a host wait,
//     and its timers report the device time it took;
//   - FsdpWeightProvider{CUDA, BF16} hands out exactly DeviceWeightProvider's weights (every
//     layer in a training step's order, the globals) and the same Qwen3 logits, bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/cuda/memory.h"
#include "kernels/device.h"
#include "model/device_weights.h"
#include "model/qwen3.h"
#include "model/tiny.h"
#include "model/weights.h"
#include "tests/mpi/mpi_test_main.h"
#include "kernels/dist/comm.h"
#include "trainer/fsdp.h"

namespace retain::dist {
namespace {

// FSDP is the trainer's (trainer/fsdp.h), standing on the communicator tested here.
using trainer::FsdpOptions;
using trainer::FsdpStats;
using trainer::FsdpWeightProvider;

namespace fs = std::filesystem;

Comm& world() { return mpi_test::world(); }

// Every rank decides alike (a collective must not be skipped by one rank only).
bool gpu_everywhere() {
  double missing = cuda_device_count() == 0 ? 1 : 0;
  world().all_reduce(&missing, 1);
  return missing == 0;
}

#define SKIP_WITHOUT_GPUS()                                                            \
  do {                                                                                 \
    if (!gpu_everywhere()) GTEST_SKIP() << "needs a CUDA device on every rank";        \
    bind_local_gpu(node_local_rank(world()));                                          \
  } while (0)

// NCCL over the world's ranks, when they have a GPU each (NCCL refuses two ranks on one).
std::unique_ptr<Comm> nccl_or_null() {
  if (!nccl_built()) return nullptr;
  double shared = cuda_device_count() < world().size() ? 1 : 0;
  world().all_reduce(&shared, 1);
  if (shared > 0) return nullptr;
  return make_nccl_comm(world());
}

Tensor on_device(const std::vector<float>& v) { return Tensor::from_vector(v, {static_cast<int64_t>(v.size())}).to(Device::CUDA); }
std::vector<float> to_host(const Tensor& t) {
  const Tensor h = t.to(Device::CPU);
  return std::vector<float>(h.data<float>(), h.data<float>() + h.numel());
}

// Rank r's value i: distinct across ranks and positions, exact in float sums of a few ranks.
float value(int r, size_t i) { return static_cast<float>(1000 * (r + 1) + static_cast<int>(i % 997)) * 0.25f; }

// Every collective on buffers of `kind` through `comm`, against values computed here.
void check_collectives(Comm& comm, Device kind, const std::string& what) {
  SCOPED_TRACE(what);
  const int n = comm.size(), me = comm.rank();
  const size_t count = 3001;  // not a multiple of anything
  auto buffer = [&](const std::vector<float>& v) { return kind == Device::CUDA ? on_device(v) : Tensor::from_vector(v, {static_cast<int64_t>(v.size())}); };
  auto host = [&](const Tensor& t) { return to_host(t); };

  std::vector<float> mine(count);
  for (size_t i = 0; i < count; ++i) mine[i] = value(me, i);

  // all_gather (separate buffers), all_gather_async, and in place.
  {
    Tensor send = buffer(mine), recv = buffer(std::vector<float>(count * n, -1.f));
    comm.all_gather(send.data<float>(), recv.data<float>(), count);
    const std::vector<float> got = host(recv);
    for (int r = 0; r < n; ++r)
      for (size_t i = 0; i < count; i += 97) EXPECT_EQ(got[r * count + i], value(r, i)) << "all_gather " << r << " " << i;

    Tensor recv2 = buffer(std::vector<float>(count * n, -1.f));
    auto req = comm.all_gather_async(send.data<float>(), recv2.data<float>(), count);
    req->wait();
    EXPECT_EQ(host(recv2), got) << "all_gather_async";

    std::vector<float> in_place(count * n, -1.f);
    std::copy(mine.begin(), mine.end(), in_place.begin() + static_cast<ptrdiff_t>(me * count));
    Tensor ip = buffer(in_place);
    comm.all_gather(ip.data<float>() + me * count, ip.data<float>(), count);
    EXPECT_EQ(host(ip), got) << "all_gather in place";

    Tensor bytes = buffer(std::vector<float>(count * n, -1.f));
    auto breq = comm.all_gather_bytes_async(send.raw(), bytes.raw(), count * sizeof(float));
    breq->wait();
    EXPECT_EQ(host(bytes), got) << "all_gather_bytes_async";
  }
  // reduce_scatter: recv[i] = sum over ranks of their block `me`.
  {
    std::vector<float> all(count * n);
    for (size_t i = 0; i < all.size(); ++i) all[i] = value(me, i);
    Tensor send = buffer(all), recv = buffer(std::vector<float>(count, 0.f));
    comm.reduce_scatter(send.data<float>(), recv.data<float>(), count);
    const std::vector<float> got = host(recv);
    for (size_t i = 0; i < count; i += 89) {
      double want = 0;
      for (int r = 0; r < n; ++r) want += value(r, me * count + i);
      EXPECT_EQ(got[i], static_cast<float>(want)) << "reduce_scatter " << i;
    }
  }
  // all_reduce (float, double, max) and broadcast.
  {
    Tensor buf = buffer(mine);
    comm.all_reduce(buf.data<float>(), count);
    const std::vector<float> got = host(buf);
    for (size_t i = 0; i < count; i += 101) {
      double want = 0;
      for (int r = 0; r < n; ++r) want += value(r, i);
      EXPECT_EQ(got[i], static_cast<float>(want)) << "all_reduce " << i;
    }
    std::vector<double> d = {1.0 + me, 0.5 * me};
    Tensor dd = kind == Device::CUDA ? Tensor::from_vector(d, {2}).to(Device::CUDA) : Tensor::from_vector(d, {2});
    comm.all_reduce_max(dd.data<double>(), 2);
    const Tensor dh = dd.to(Device::CPU);
    EXPECT_EQ(dh.data<double>()[0], static_cast<double>(n));
    EXPECT_EQ(dh.data<double>()[1], 0.5 * (n - 1));

    Tensor b = buffer(mine);
    comm.broadcast(b.raw(), count * sizeof(float), n - 1);
    const std::vector<float> bh = host(b);
    for (size_t i = 0; i < count; i += 103) EXPECT_EQ(bh[i], value(n - 1, i)) << "broadcast " << i;
  }
  // ring_shift_bytes_async (context parallelism): the previous rank's bytes, two shifts in flight.
  {
    Tensor send = buffer(mine), recv = buffer(std::vector<float>(count, -1.f));
    Tensor send2 = buffer(std::vector<float>(mine.rbegin(), mine.rend())), recv2 = buffer(std::vector<float>(count, -1.f));
    auto a = comm.ring_shift_bytes_async(send.raw(), recv.raw(), count * sizeof(float));
    auto b = comm.ring_shift_bytes_async(send2.raw(), recv2.raw(), count * sizeof(float));
    b->wait();
    a->wait();
    const std::vector<float> got = host(recv), got2 = host(recv2);
    const int prev = (me + n - 1) % n;
    for (size_t i = 0; i < count; i += 53) {
      EXPECT_EQ(got[i], value(prev, i)) << "ring_shift " << i;
      EXPECT_EQ(got2[i], value(prev, count - 1 - i)) << "ring_shift (second) " << i;
    }
    // By distance 2 (gather_to_owners' pairwise exchanges): rank me − 2's bytes.
    Tensor recv3 = buffer(std::vector<float>(count, -1.f));
    comm.ring_shift_bytes_async(send.raw(), recv3.raw(), count * sizeof(float), 2)->wait();
    const std::vector<float> got3 = host(recv3);
    const int from = ((me - 2) % n + n) % n;
    for (size_t i = 0; i < count; i += 53) EXPECT_EQ(got3[i], value(from, i)) << "shift by 2 " << i;
  }
}

TEST(CommCuda, WorldCommMovesDeviceBuffers) {
  SKIP_WITHOUT_GPUS();
  EXPECT_FALSE(world().native_device_buffers());
  check_collectives(world(), Device::CUDA, std::string(world().backend()) + " with device buffers (staged)");
  // Host backends time their collectives on the host clock (MPI since issue 41: each collective's
  // start to its completion as the rank saw it).
  const CommTimes t = world().take_device_times();
  if (world().size() > 1) {
    EXPECT_GT(t.busy_seconds, 0.0) << "MPI times the staged collectives above";
    EXPECT_GE(t.exposed_seconds, 0.0);
  }
}

TEST(CommCuda, NcclEqualsTheExpectedValues) {
  SKIP_WITHOUT_GPUS();
  auto nccl = nccl_or_null();
  if (!nccl) GTEST_SKIP() << (nccl_built() ? "ranks share a GPU: NCCL refuses that" : "built without NCCL");
  EXPECT_EQ(nccl->backend(), "nccl");
  EXPECT_EQ(nccl->rank(), world().rank());
  EXPECT_EQ(nccl->size(), world().size());
  check_collectives(*nccl, Device::CUDA, "nccl, device buffers");
  check_collectives(*nccl, Device::CPU, "nccl, host buffers (staged)");
  nccl->barrier();
  // Context parallelism's groups: the even and the odd ranks, each a NCCL communicator of its own
  // (ranked in reverse by key), whose collectives and ring shifts stay inside the group.
  const int me = world().rank();
  std::unique_ptr<Comm> group = nccl->split(me % 2, world().size() - me);
  EXPECT_EQ(group->backend(), "nccl");
  EXPECT_EQ(group->size(), (world().size() - me % 2 + 1) / 2);
  EXPECT_EQ(group->rank(), group->size() - 1 - me / 2);
  check_collectives(*group, Device::CUDA, "nccl split, device buffers");
  group->barrier();
}

// A gather of 64 MB followed at once by a device copy of its result: the copy must see the
// gathered data though the host never waited; the timers then account for the gather.
TEST(CommCuda, NcclAsyncGatherIsStreamOrderedAndTimed) {
  SKIP_WITHOUT_GPUS();
  auto nccl = nccl_or_null();
  if (!nccl) GTEST_SKIP() << "no NCCL comm here (shared GPU or no NCCL)";
  nccl->take_device_times();  // from now on
  const int n = nccl->size();
  const size_t count = (size_t{16} << 20) / static_cast<size_t>(n);
  std::vector<float> mine(count);
  for (size_t i = 0; i < count; ++i) mine[i] = value(nccl->rank(), i);
  Tensor send = on_device(mine), recv = Tensor::zeros({static_cast<int64_t>(count) * n}, DType::F32, Device::CUDA);
  Tensor copy = Tensor::empty(recv.shape(), DType::F32, Device::CUDA);
  auto req = nccl->all_gather_async(send.data<float>(), recv.data<float>(), count);
  req->wait();                      // orders compute after the gather; does not block the host
  copy.copy_from(recv);             // device-to-device on the compute stream
  const std::vector<float> got = to_host(copy);
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < count; i += 4099) EXPECT_EQ(got[r * count + i], value(r, i));
  cuda::synchronize();
  const CommTimes t = nccl->take_device_times();
  EXPECT_GT(t.busy_seconds, 0);
  EXPECT_GE(t.exposed_seconds, 0);
  EXPECT_LT(t.busy_seconds, 10);
  const CommTimes again = nccl->take_device_times();
  EXPECT_EQ(again.busy_seconds, 0) << "taken once";
}

// ---- FSDP on the device ---------------------------------------------------------------------

class Model : public ::testing::Environment {
 public:
  void SetUp() override {
    char path[4096] = {};
    if (world().is_main_rank()) {
      std::string tmpl = (fs::temp_directory_path() / "retain_fsdp_cuda_XXXXXX").string();
      if (mkdtemp(tmpl.data()) != nullptr) try {
        std::snprintf(path, sizeof path, "%s", tmpl.c_str());
        for (const bool tie : {true, false}) {
          TinyModelOptions o;
          o.layers = 3;
          o.hidden = 64;
          o.heads = 4;
          o.kv_heads = 2;
          o.head_dim = 64;  // the CUDA attention kernels take 64 and 128
          o.intermediate = 96;
          o.vocab = 301;
          o.tie = tie;
          o.seed = tie ? 5 : 6;
          make_tiny_model(std::string(path) + (tie ? "/tied" : "/untied"), o);
        }
      } catch (const std::exception& e) {  // every rank must still reach the broadcast
        std::fprintf(stderr, "making the test models: %s\n", e.what());
        path[0] = '\0';
      }
    }
    world().broadcast(path, sizeof path, 0);
    RETAIN_CHECK(path[0] != '\0', "rank 0 could not make the test models");
    root = path;
  }
  void TearDown() override {
    world().barrier();
    if (world().is_main_rank()) fs::remove_all(root);
  }
  static inline std::string root;
};
const auto* const g_model = ::testing::AddGlobalTestEnvironment(new Model);

bool same_bytes(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape() || a.device() != Device::CUDA || b.device() != Device::CUDA)
    return false;
  const Tensor x = a.to(Device::CPU), y = b.to(Device::CPU);
  return std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
}

// `force`: FsdpOptions::force_gather (a one-rank world gathers through `comm` too).
void check_fsdp(Comm& comm, const std::string& name, bool force = false) {
  SCOPED_TRACE(std::string(comm.backend()) + " " + name + (force ? " forced" : ""));
  const auto ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(Model::root + "/" + name));
  DeviceWeightProvider whole(ckpt);
  FsdpWeightProvider fsdp(ckpt, comm, {Device::CUDA, DType::BF16, force});
  EXPECT_EQ(fsdp.device(), Device::CUDA);
  EXPECT_EQ(fsdp.gathers(), force || comm.size() > 1);
  const int64_t L = ckpt->config().num_hidden_layers;
  std::vector<int64_t> order;
  for (int pass = 0; pass < 2; ++pass)
    for (int64_t l = 0; l < L; ++l) order.push_back(l);
  for (int64_t l = L - 1; l >= 0; --l) order.push_back(l);
  for (int64_t l : order) {
    LayerWeights got = fsdp.layer(l), ref = whole.layer(l);
    const auto g = layer_fields(got), w = layer_fields(ref);
    for (size_t i = 0; i < g.size(); ++i) EXPECT_TRUE(same_bytes(*g[i], *w[i])) << "layer " << l << " field " << i;
  }
  EXPECT_TRUE(same_bytes(fsdp.final_norm(), whole.final_norm()));
  EXPECT_TRUE(same_bytes(fsdp.embedding(), whole.embedding()));
  EXPECT_TRUE(same_bytes(fsdp.lm_head(), whole.lm_head()));

  // The forward on the device: the same kernels on the same weights give the same bits.
  const int64_t T = 37;
  std::mt19937 rng(9);
  std::vector<int32_t> ids(T), doc(T);
  for (int64_t t = 0; t < T; ++t) {
    ids[t] = static_cast<int32_t>(rng() % static_cast<uint32_t>(ckpt->config().vocab_size));
    doc[t] = t < 20 ? 0 : (t < 34 ? 1 : -1);
  }
  // On the device, as the trainer hands them to the model (the activations follow the ids).
  const Tensor ids_t = Tensor::from_vector(ids, {T}).to(Device::CUDA), doc_t = Tensor::from_vector(doc, {T}).to(Device::CUDA);
  const Tensor want = qwen3_forward(whole, ids_t, doc_t);
  for (int pass = 0; pass < 2; ++pass)
    EXPECT_TRUE(same_bytes(qwen3_forward(fsdp, ids_t, doc_t), want)) << "forward pass " << pass;
  if (fsdp.gathers()) {
    EXPECT_GT(fsdp.resident_bytes(), fsdp.shard_bytes()) << "layer buffers of its own";
  }
  EXPECT_GT(fsdp.stats().prefetch_hits, 0);
}

TEST(FsdpCuda, WorldCommEqualsTheWholeModel) {
  SKIP_WITHOUT_GPUS();
  for (const char* name : {"tied", "untied"}) check_fsdp(world(), name);
}

TEST(FsdpCuda, NcclEqualsTheWholeModel) {
  SKIP_WITHOUT_GPUS();
  auto nccl = nccl_or_null();
  if (!nccl) GTEST_SKIP() << "no NCCL comm here (shared GPU or no NCCL)";
  for (const char* name : {"tied", "untied"}) check_fsdp(*nccl, name);
}

// force_gather: one rank takes the N-rank path (layer buffers, prefetch, staged gathers here)
// and still gives the whole model's bytes and forward.
TEST(FsdpCuda, ForcedGatherEqualsTheWholeModel) {
  SKIP_WITHOUT_GPUS();
  for (const char* name : {"tied", "untied"}) check_fsdp(world(), name, /*force=*/true);
}

// The same over NCCL, where a one-rank world otherwise never gathers: the gathers run on the
// communication stream (a device copy for one rank), ordered by events, and the comm's device
// timers count them. What a single lent GPU can check of FSDP over NCCL.
TEST(FsdpCuda, NcclForcedGatherEqualsTheWholeModelAndIsTimed) {
  SKIP_WITHOUT_GPUS();
  auto nccl = nccl_or_null();
  if (!nccl) GTEST_SKIP() << "no NCCL comm here (shared GPU or no NCCL)";
  for (const char* name : {"tied", "untied"}) {
    nccl->take_device_times();  // from now on
    check_fsdp(*nccl, name, /*force=*/true);
    cuda::synchronize();
    const CommTimes t = nccl->take_device_times();
    EXPECT_GT(t.busy_seconds, 0) << name;
    EXPECT_GE(t.exposed_seconds, 0) << name;
    EXPECT_LT(t.busy_seconds, 10) << name;
  }
}

}  // namespace
}  // namespace retain::dist
