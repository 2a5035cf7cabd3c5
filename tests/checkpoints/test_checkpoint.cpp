// Trainer checkpoints on one rank: save → load round trip (gates bit-exact, optimizer state,
// trainer state), resuming on other world sizes, keep-last pruning, `latest` surviving
// interrupted saves (simulated and real SIGKILLs), and one clear error naming the file for
// every damaged checkpoint.
#include <poll.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "checkpoints/checkpoint.h"
#include "kernels/base/atomic_file.h"
#include "kernels/base/error.h"
#include "data/formats/safetensors.h"
#include "tests/checkpoints/checkpoint_test_util.h"

namespace retain::ckpt {
namespace {

using namespace retain::ckpt::test;
using gates::GateKind;
using gates::RetentionGates;

constexpr int64_t kFlat = 11;  // odd: every world size > 1 pads

class Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    run_ = fs::path(::testing::TempDir()) /
           ("retain_ckpt." + std::to_string(::getpid()) + "." +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(run_);
    fs::create_directories(run_);
    comm_ = dist::make_local_comm();
  }
  void TearDown() override { fs::remove_all(run_); }

  std::string save(int64_t step, int keep_last = 3, nlohmann::json state = {{"cursor", 0}}) {
    SaveRequest req;
    req.step = step;
    req.gates = &gates_;
    req.state = std::move(state);
    req.optimizer = shard_for(kFlat, 0, 1, step);
    req.keep_last = keep_last;
    return save_checkpoint(*comm_, run_.string(), req);
  }
  fs::path ckpts() const { return run_ / "checkpoints"; }
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(ckpts())) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
  std::string latest_text() const { return read_file((ckpts() / "latest").string()); }
  // The retain::Error message of f(), or "(no error)".
  template <typename F>
  static std::string error_of(F&& f) {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  }

  fs::path run_;
  std::unique_ptr<dist::Comm> comm_;
  RetentionGates gates_ = random_gates(GateKind::dbtrimkv, 5);
};

TEST_F(Checkpoint, RoundTripIsExactForBothGateKinds) {
  for (GateKind kind : {GateKind::trimkv, GateKind::dbtrimkv}) {
    gates_ = random_gates(kind, 11);
    const nlohmann::json state = {{"cursor", {{"epoch", 2}, {"index", 12345}}}, {"rng", "0123456789abcdef"}};
    const std::string dir = save(42, 3, state);
    EXPECT_EQ(dir, (ckpts() / "step-00000042").string());
    EXPECT_EQ(latest_text(), "step-00000042\n");
    ASSERT_EQ(latest_checkpoint(run_.string()), dir);

    const Loaded l = load_checkpoint(dir, kFlat, 0, kFlat);
    EXPECT_EQ(l.step, 42);
    EXPECT_EQ(l.state["cursor"], state["cursor"]);
    EXPECT_EQ(l.state["rng"], state["rng"]);
    EXPECT_EQ(l.state["step"], 42);
    EXPECT_EQ(l.state["world_size"], 1);
    expect_slice(l.optimizer, 0, kFlat, kFlat, 42);

    EXPECT_EQ(l.gates_path, dir + "/gates.safetensors");
    const RetentionGates back = RetentionGates::load(l.gates_path, model_config(), kind);
    EXPECT_TRUE(same_values(back, gates_)) << gates::gate_kind_name(kind);
    EXPECT_EQ(formats::SafetensorsFile::open(l.gates_path).metadata().at("step"), "42");
    fs::remove_all(ckpts());
  }
}

TEST_F(Checkpoint, NoCheckpointYetIsNullopt) {
  EXPECT_EQ(latest_checkpoint(run_.string()), std::nullopt);
  EXPECT_EQ(latest_checkpoint((run_ / "does-not-exist").string()), std::nullopt);
  remove_stale_temporaries(run_.string());  // no checkpoints folder: nothing to do
}

TEST_F(Checkpoint, OneRankSaveResumesOnAnyWorldSize) {
  const std::string dir = save(9);
  for (int world = 1; world <= 5; ++world)
    for (int rank = 0; rank < world; ++rank) {
      SCOPED_TRACE(testing::Message() << "rank " << rank << " of " << world);
      const auto [b, e] = slice_of(kFlat, rank, world);  // e may pass kFlat: padding, zeros
      expect_slice(load_checkpoint(dir, kFlat, b, e).optimizer, b, e, kFlat, 9);
    }
}

TEST_F(Checkpoint, KeepLastPrunesTheOldest) {
  for (int64_t s = 1; s <= 6; ++s) save(s, 3);
  EXPECT_EQ(entries(), (std::vector<std::string>{"latest", "step-00000004", "step-00000005", "step-00000006"}));
  save(7, 1);
  EXPECT_EQ(entries(), (std::vector<std::string>{"latest", "step-00000007"}));
  for (int64_t s = 8; s <= 10; ++s) save(s, 0);  // 0 keeps all
  EXPECT_EQ(entries().size(), 5u);
  save(11, -1);
  EXPECT_EQ(entries().size(), 6u);
  EXPECT_EQ(latest_text(), "step-00000011\n");
}

TEST_F(Checkpoint, PruningNeverTouchesNewerLeftovers) {
  // A run resumed from step 2 while step 5 of the abandoned timeline is still on disk.
  save(2);
  save(5);
  fs::remove(ckpts() / "latest");
  write_file_atomic((ckpts() / "latest").string(), "step-00000002\n");
  save(3, 1);
  EXPECT_EQ(entries(), (std::vector<std::string>{"latest", "step-00000003", "step-00000005"}));
  EXPECT_EQ(latest_text(), "step-00000003\n");
}

TEST_F(Checkpoint, InterruptedSaveLeavesLatestOnTheOldCheckpoint) {
  const std::string old_dir = save(10);
  // A save of step 20 killed before its rename: a partial temporary directory.
  fs::create_directories(ckpts() / "step-00000020.tmp");
  write_file_atomic((ckpts() / "step-00000020.tmp" / optimizer_file_name(0, 1)).string(), "partial");
  // ... and a kill during the `latest` rewrite: the AtomicFile temporary.
  write_file_atomic((ckpts() / "latest.tmp.12345").string(), "step-00000020\n");
  // A save of step 30 killed after its rename but before `latest`: complete, not named.
  fs::copy(old_dir, ckpts() / "step-00000030");
  {
    nlohmann::json s = nlohmann::json::parse(read_file((ckpts() / "step-00000030" / "state.json").string()));
    s["step"] = 30;
    write_file_atomic((ckpts() / "step-00000030" / "state.json").string(), s.dump());
  }
  EXPECT_EQ(latest_checkpoint(run_.string()), old_dir);

  remove_stale_temporaries(run_.string());
  EXPECT_EQ(entries(), (std::vector<std::string>{"latest", "step-00000010", "step-00000030"}));
  EXPECT_EQ(latest_checkpoint(run_.string()), old_dir);

  // The resumed run reaches step 30 again: the leftover is replaced by the new save.
  const std::string dir30 = save(30, 3, {{"cursor", 30}});
  EXPECT_EQ(latest_checkpoint(run_.string()), dir30);
  EXPECT_EQ(load_checkpoint(dir30, kFlat, 0, kFlat).state["cursor"], 30);
}

TEST_F(Checkpoint, SavingTheSameStepAgainReplacesIt) {
  save(4);
  save(5, 3, {{"cursor", 1}});
  const std::string dir = save(5, 3, {{"cursor", 2}});
  EXPECT_EQ(latest_checkpoint(run_.string()), dir);
  EXPECT_EQ(load_checkpoint(dir, kFlat, 0, kFlat).state["cursor"], 2);
  EXPECT_EQ(entries(), (std::vector<std::string>{"latest", "step-00000004", "step-00000005"}));
}

// Real kills. A child saves checkpoints in a loop (keep_last 2, so pruning runs too); the parent
// SIGKILLs it at a chosen moment, then checks that `latest` names a checkpoint that loads
// completely and that the startup cleanup leaves no temporaries. Kill moments: right after the
// k-th change inotify reports in RUN/checkpoints once the first save is done (the temporary
// created, its rename, `latest`'s temporary, `latest`'s rename, a pruned directory's removal,
// ... — the steps where a wrong order would show), and after delays spread over a save
// (mostly inside the temporary's fsyncs).
class SigkillTest : public Checkpoint {
 protected:
  // Forks the saver, waits for its first `latest`, kills it after `events` more directory
  // changes plus `delay`, and checks what it left.
  void kill_and_check(int events, std::chrono::microseconds delay) {
    fs::remove_all(ckpts());
    fs::create_directories(ckpts());
    const int fd = ::inotify_init1(IN_CLOEXEC);
    ASSERT_GE(fd, 0);
    ASSERT_GE(::inotify_add_watch(fd, ckpts().c_str(), IN_CREATE | IN_MOVED_TO | IN_DELETE), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      try {
        for (int64_t s = 1;; ++s) save(s, 2, {{"cursor", s}});
      } catch (...) {
      }
      ::_exit(3);
    }
    bool seen_latest = false;
    int after = 0;
    alignas(inotify_event) char buf[4096];
    while (!seen_latest || after < events) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 20000) <= 0) break;  // the child is stuck: kill it and let the checks fail
      const ssize_t n = ::read(fd, buf, sizeof(buf));
      for (ssize_t off = 0; off < n;) {
        const auto* ev = reinterpret_cast<const inotify_event*>(buf + off);
        if (seen_latest) ++after;
        if ((ev->mask & IN_MOVED_TO) && ev->len && std::string(ev->name) == "latest") seen_latest = true;
        off += ssize_t(sizeof(inotify_event) + ev->len);
      }
    }
    std::this_thread::sleep_for(delay);
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ::close(fd);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the saving child stopped by itself";

    std::optional<std::string> dir;
    ASSERT_NO_THROW(dir = latest_checkpoint(run_.string()));
    ASSERT_TRUE(dir.has_value());
    Loaded l;
    ASSERT_NO_THROW(l = load_checkpoint(*dir, kFlat, 0, kFlat));
    EXPECT_EQ(l.state["cursor"], l.step);
    expect_slice(l.optimizer, 0, kFlat, kFlat, l.step);
    EXPECT_TRUE(same_values(RetentionGates::load(l.gates_path, model_config()), gates_));
    remove_stale_temporaries(run_.string());
    for (const std::string& n : entries()) EXPECT_EQ(n.find(".tmp"), std::string::npos) << n;
  }
};

TEST_F(SigkillTest, AtEveryDirectoryChange) {
  for (int events = 0; events < 11; ++events) {
    SCOPED_TRACE(testing::Message() << "killed after " << events << " directory changes");
    kill_and_check(events, std::chrono::microseconds(0));
  }
}

TEST_F(SigkillTest, DuringASave) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  save(1);
  const auto one_save = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0);
  for (int trial = 1; trial <= 6; ++trial) {
    SCOPED_TRACE(testing::Message() << "killed " << trial * 0.2 << " saves after the first");
    kill_and_check(0, one_save * trial / 5);
  }
}

// ---- bad requests: nothing written, `latest` unchanged ------------------------------------

TEST_F(Checkpoint, BadRequestsAreErrorsThatLeaveLatestAlone) {
  const std::string good = save(1);
  SaveRequest req;
  req.step = 2;
  req.gates = &gates_;
  req.optimizer = shard_for(kFlat, 0, 1, 2);
  req.optimizer.m.pop_back();
  EXPECT_NE(error_of([&] { save_checkpoint(*comm_, run_.string(), req); }).find("m has 10 and v 11 values"),
            std::string::npos);
  req.optimizer = shard_for(kFlat, 0, 1, 2);
  req.optimizer.end = kFlat + 1;
  EXPECT_NE(error_of([&] { save_checkpoint(*comm_, run_.string(), req); }).find("its shard is [0, 11)"),
            std::string::npos);
  req.optimizer = shard_for(kFlat, 0, 1, 2);
  req.gates = nullptr;
  EXPECT_NE(error_of([&] { save_checkpoint(*comm_, run_.string(), req); }).find("no gates"), std::string::npos);
  req.gates = &gates_;
  req.state = nlohmann::json::array({1, 2});
  EXPECT_NE(error_of([&] { save_checkpoint(*comm_, run_.string(), req); }).find("JSON object"), std::string::npos);
  EXPECT_EQ(latest_checkpoint(run_.string()), good);
  EXPECT_EQ(entries(), (std::vector<std::string>{"latest", "step-00000001"}));
}

// ---- damaged checkpoints: one error naming the file -----------------------------------------

class DamagedCheckpoint : public Checkpoint {
 protected:
  void SetUp() override {
    Checkpoint::SetUp();
    dir_ = save(8);
  }
  std::string load_error(int64_t flat = kFlat) {
    return error_of([&] { load_checkpoint(dir_, flat, 0, flat); });
  }
  std::string file(const std::string& name) const { return (fs::path(dir_) / name).string(); }
  // Rewrites the checkpoint as a 2-rank save (shards written here, independently of the saver).
  void make_two_rank(int64_t t1, float bad_value = 0.0f) {
    fs::remove(file(optimizer_file_name(0, 1)));
    for (int r = 0; r < 2; ++r) {
      OptimizerShard o = shard_for(kFlat, r, 2, 8);
      if (r == 1) {
        o.t = t1;
        o.v[0] = bad_value != 0.0f ? bad_value : o.v[0];
      }
      const int64_t n = o.end - o.begin;
      formats::write_safetensors(file(optimizer_file_name(r, 2)),
                        {{"m", Tensor::from_vector(o.m, {n})}, {"v", Tensor::from_vector(o.v, {n})}},
                        {{"t", std::to_string(o.t)},
                         {"flat_size", std::to_string(kFlat)},
                         {"begin", std::to_string(o.begin)},
                         {"end", std::to_string(o.end)},
                         {"world_size", "2"}});
    }
    nlohmann::json s = nlohmann::json::parse(read_file(file("state.json")));
    s["world_size"] = 2;
    write_file_atomic(file("state.json"), s.dump());
  }
  std::string dir_;
};

TEST_F(DamagedCheckpoint, TwoRankShardsAssembleAndHandCraftedFilesLoad) {
  make_two_rank(1008);
  expect_slice(load_checkpoint(dir_, kFlat, 3, 9).optimizer, 3, 9, kFlat, 8);
}

TEST_F(DamagedCheckpoint, ShardsDisagreeingOnT) {
  make_two_rank(1009);
  EXPECT_EQ(load_error(), file(optimizer_file_name(1, 2)) + ": __metadata__ t 1009 but rank 0's shard has t 1008");
}

TEST_F(DamagedCheckpoint, NaNOrNegativeSecondMoment) {
  make_two_rank(1008, std::nanf(""));
  EXPECT_EQ(load_error(), file(optimizer_file_name(1, 2)) + ": tensor 'v' has an invalid value (nan) at index 0");
  make_two_rank(1008, -1.0f);
  EXPECT_EQ(load_error(), file(optimizer_file_name(1, 2)) + ": tensor 'v' has an invalid value (-1) at index 0");
}

TEST_F(DamagedCheckpoint, MissingShard) {
  make_two_rank(1008);
  fs::remove(file(optimizer_file_name(1, 2)));
  EXPECT_EQ(load_error(), file(optimizer_file_name(1, 2)) + ": missing (state.json world_size is 2)");
  EXPECT_NE(error_of([&] { latest_checkpoint(run_.string()); }).find(file(optimizer_file_name(1, 2)) + ": missing"),
            std::string::npos);
}

TEST_F(DamagedCheckpoint, ShardOfAnotherWorldSize) {
  fs::copy(file(optimizer_file_name(0, 1)), file(optimizer_file_name(0, 2)));
  EXPECT_EQ(load_error(), file(optimizer_file_name(0, 2)) +
                              ": a shard of a 2-rank save, but state.json says world_size 1");
}

TEST_F(DamagedCheckpoint, FlatSizeOfOtherGates) {
  EXPECT_EQ(load_error(12), file(optimizer_file_name(0, 1)) + ": optimizer state of 11 scalars, but the gates have 12");
}

TEST_F(DamagedCheckpoint, TruncatedShard) {
  const std::string p = file(optimizer_file_name(0, 1));
  fs::resize_file(p, fs::file_size(p) - 4);
  const std::string e = load_error();
  EXPECT_EQ(e.rfind(p + ": ", 0), 0u) << e;
}

TEST_F(DamagedCheckpoint, StateJson) {
  write_file_atomic(file("state.json"), "{\"step\": 8, ");
  EXPECT_EQ(load_error().rfind(file("state.json") + ": invalid JSON", 0), 0u);
  write_file_atomic(file("state.json"), "{\"step\": 8}");
  EXPECT_EQ(load_error(), file("state.json") + ": field 'world_size' is missing or not an integer");
  write_file_atomic(file("state.json"), "{\"step\": 9, \"world_size\": 1}");
  EXPECT_EQ(load_error(), file("state.json") + ": step 9 disagrees with its directory name step-00000008");
  fs::remove(file("state.json"));
  EXPECT_EQ(load_error(), file("state.json") + ": missing");
}

TEST_F(DamagedCheckpoint, GatesFile) {
  fs::resize_file(file("gates.safetensors"), 5);
  EXPECT_EQ(load_error().rfind(file("gates.safetensors") + ": ", 0), 0u);
  fs::remove(file("gates.safetensors"));
  EXPECT_EQ(load_error(), file("gates.safetensors") + ": missing");
  const std::string latest = (ckpts() / "latest").string();
  EXPECT_EQ(error_of([&] { latest_checkpoint(run_.string()); }),
            latest + ": names " + dir_ + ", which is not a complete checkpoint: " + file("gates.safetensors") +
                ": missing");
}

TEST_F(DamagedCheckpoint, LatestNamingNothing) {
  const std::string latest = (ckpts() / "latest").string();
  write_file_atomic(latest, "step-00000099\n");
  EXPECT_EQ(error_of([&] { latest_checkpoint(run_.string()); }),
            latest + ": names " + (ckpts() / "step-00000099").string() + ", which is not a complete checkpoint: " +
                (ckpts() / "step-00000099").string() + ": no such checkpoint directory");
  write_file_atomic(latest, "../../etc\n");
  EXPECT_EQ(error_of([&] { latest_checkpoint(run_.string()); }),
            latest + ": does not name a checkpoint directory: '../../etc'");
}

TEST_F(DamagedCheckpoint, MissingDirectory) {
  fs::remove_all(dir_);
  EXPECT_EQ(load_error(), dir_ + ": no such checkpoint directory");
}

}  // namespace
}  // namespace retain::ckpt
