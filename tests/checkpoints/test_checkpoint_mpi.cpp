// Checkpoints saved by every rank of a world (plainly: one rank; under mpirun -np 2: two), then
// loaded as the ranks of 1..5-rank worlds would, each slice checked value by value; and a
// failure on one rank making every rank throw instead of leaving the others in a collective.
// Every rank runs every test in the same order; checks are non-fatal where a collective follows.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "checkpoints/checkpoint.h"
#include "kernels/base/atomic_file.h"
#include "kernels/base/error.h"
#include "tests/checkpoints/checkpoint_test_util.h"
#include "kernels/dist/comm.h"

namespace retain::ckpt {
namespace {

using namespace retain::ckpt::test;

std::unique_ptr<dist::Comm> g_comm;
std::string g_root;  // one scratch folder shared by all ranks (rank 0 made it)

dist::Comm& comm() { return *g_comm; }

// A fresh run directory per test, the same path on every rank.
std::string fresh_run(const std::string& name) {
  const std::string run = g_root + "/" + name;
  if (comm().is_main_rank()) {
    fs::remove_all(run);
    fs::create_directories(run);
  }
  comm().barrier();
  return run;
}

TEST(CheckpointWorld, WorldSizeMatchesTheLauncher) {
  if (const char* env = std::getenv("RETAIN_TEST_WORLD_SIZE")) {
    EXPECT_EQ(comm().size(), std::atoi(env));
  }
}

TEST(CheckpointWorld, SavedShardsLoadOnEveryWorldSize) {
  const std::string run = fresh_run("resize");
  const gates::RetentionGates gates = random_gates(gates::GateKind::trimkv, 3);
  for (int64_t flat : {int64_t(1), int64_t(2), int64_t(11), int64_t(64)}) {
    SCOPED_TRACE(testing::Message() << "flat_size " << flat);
    SaveRequest req;
    req.step = flat;  // one checkpoint per case
    req.gates = &gates;
    req.state = {{"case", flat}};
    req.optimizer = shard_for(flat, comm().rank(), comm().size(), req.step);
    std::string dir;
    ASSERT_NO_THROW(dir = save_checkpoint(comm(), run, req));
    EXPECT_EQ(latest_checkpoint(run), dir);
    EXPECT_TRUE(fs::exists(fs::path(dir) / optimizer_file_name(comm().size() - 1, comm().size())));

    // Any rank of any world: its padded slice, padding included (zeros).
    for (int world = 1; world <= 5; ++world)
      for (int rank = 0; rank < world; ++rank) {
        SCOPED_TRACE(testing::Message() << "loading as rank " << rank << " of " << world);
        const auto [b, e] = slice_of(flat, rank, world);
        const Loaded l = load_checkpoint(dir, flat, b, e);
        EXPECT_EQ(l.step, req.step);
        EXPECT_EQ(l.state["case"], flat);
        EXPECT_EQ(l.state["world_size"], comm().size());
        expect_slice(l.optimizer, b, e, flat, req.step);
      }
    EXPECT_TRUE(same_values(gates::RetentionGates::load(dir + "/gates.safetensors", model_config()), gates));
    comm().barrier();  // nobody saves the next case while another rank still reads
  }
}

TEST(CheckpointWorld, KeepLastAcrossRanks) {
  const std::string run = fresh_run("keep");
  const gates::RetentionGates gates = random_gates(gates::GateKind::dbtrimkv, 4);
  for (int64_t step = 1; step <= 4; ++step) {
    SaveRequest req;
    req.step = step;
    req.gates = &gates;
    req.optimizer = shard_for(7, comm().rank(), comm().size(), step);
    req.keep_last = 2;
    save_checkpoint(comm(), run, req);
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(checkpoints_dir(run))) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step-00000003", "step-00000004"}));
  comm().barrier();
}

// A bad shard on the last rank: every rank throws (the bad one its own message), nothing hangs,
// `latest` keeps naming the previous checkpoint, and the next good save works.
TEST(CheckpointWorld, AFailureOnOneRankFailsEveryRank) {
  const std::string run = fresh_run("fail");
  const gates::RetentionGates gates = random_gates(gates::GateKind::trimkv, 5);
  SaveRequest req;
  req.gates = &gates;
  req.step = 1;
  req.optimizer = shard_for(9, comm().rank(), comm().size(), 1);
  const std::string first = save_checkpoint(comm(), run, req);

  req.step = 2;
  req.optimizer = shard_for(9, comm().rank(), comm().size(), 2);
  const bool bad = comm().rank() == comm().size() - 1;
  if (bad) req.optimizer.v.push_back(1.0f);
  std::string error = "(no error)";
  try {
    save_checkpoint(comm(), run, req);
  } catch (const Error& e) {
    error = e.what();
  }
  const std::string expected = bad ? "save_checkpoint: rank" : "failed on 1 other rank(s)";
  EXPECT_NE(error.find(expected), std::string::npos) << error;
  EXPECT_EQ(latest_checkpoint(run), first);

  req.optimizer = shard_for(9, comm().rank(), comm().size(), 2);
  EXPECT_EQ(latest_checkpoint(run), first);
  const std::string second = save_checkpoint(comm(), run, req);
  EXPECT_EQ(latest_checkpoint(run), second);
  comm().barrier();
}

// Non-main ranks print their failures only, each line tagged with the rank.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.message());
  }

 private:
  int rank_;
};

}  // namespace
}  // namespace retain::ckpt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  using namespace retain::ckpt;
  try {
    g_comm = retain::dist::make_comm();
    // Rank 0 makes the shared scratch folder and tells the others its name.
    char root[4096] = {};
    if (g_comm->is_main_rank()) {
      std::string tmpl = ::testing::TempDir() + "retain_ckpt_mpi.XXXXXX";
      if (!::mkdtemp(tmpl.data())) throw retain::Error("mkdtemp failed in " + ::testing::TempDir());
      std::snprintf(root, sizeof(root), "%s", tmpl.c_str());
    }
    g_comm->broadcast(root, sizeof(root), 0);
    g_root = root;

    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    if (!g_comm->is_main_rank()) {
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new FailurePrinter(g_comm->rank()));
    }
    const int local = RUN_ALL_TESTS();
    double failed = local != 0 ? 1.0 : 0.0;
    g_comm->all_reduce(&failed, 1);
    if (g_comm->is_main_rank()) fs::remove_all(g_root);
    if (failed > 0 && g_comm->is_main_rank())
      std::fprintf(stderr, "test_checkpoint_mpi: tests failed on %d rank(s) of %d\n", int(failed), g_comm->size());
    g_comm.reset();  // finalizes MPI
    return failed > 0 ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "test_checkpoint_mpi: %s\n", e.what());
    return 1;
  }
}
