// retain-train end to end on the fixture model: 2 ranks equal 1 rank, resume equals an
// uninterrupted run (after --stop-after, SIGTERM and SIGKILL), and bad inputs give one clear
// line and a non-zero exit; the NVTX ranges cover every phase.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "data/formats/safetensors.h"
#include "tests/trainer/nvtx_log.h"
#include "tests/trainer/train_helpers.h"

namespace retain::trainer::test {
namespace {

using namespace std::chrono_literals;

class TrainRuns : public ::testing::Test {
 protected:
  void SetUp() override { data_ = pack_fixture_corpus(dir_); }
  Result train(const std::string& extra, int ranks = 1) {
    // A hang (ranks waiting for each other) fails the test instead of blocking it.
    const std::string cmd = "timeout 120 " + (ranks > 1 ? mpirun(ranks) : std::string()) + bin("retain-train") + extra;
    return run(cmd, dir_);
  }
  // Each command line is a usage error (exit 2) whose message names `option`.
  void expect_usage_errors(const std::vector<std::string>& args, const std::string& option) {
    for (const std::string& a : args) {
      const Result u = train(a);
      EXPECT_EQ(u.code, 2) << a << ": " << u.err;
      EXPECT_NE(u.err.find(option), std::string::npos) << u.err;
    }
  }
  // Fresh gates (no --init-gates) of `gate` (the --gate value and its options) with a visible decay.
  std::string fresh_gate_args(const std::string& gate) {
    return " --model " + kModel + " --data " + data_ + " --gate " + gate +
           " --bias-init 2 --memory 4 --global-batch 4 --seed 3 --warmup 1 --loss-chunk 16 --lr 0.01";
  }
  // A kvpop run's command line (for options kvpop refuses).
  std::string kvpop_args(const std::string& extra) {
    return " --model " + kModel + " --data " + data_ + " --out " + (dir_ / "bad") + " --gate kvpop --topk 4" + extra;
  }
  TempDir dir_;
  std::string data_;
};

// The counters of the run's "fsdp: ..." log line (trainer/train.cpp), or nothing without one.
struct FsdpLine {
  int layer_requests = 0, layer_gathers = 0, prefetch_hits = 0, global_gathers = 0;
};
std::optional<FsdpLine> fsdp_line(const std::string& log) {
  std::smatch m;
  if (!std::regex_search(log, m,
                         std::regex(R"(fsdp: (\d+) layer requests, (\d+) layer all-gathers \((\d+) prefetched and used, )"
                                    R"(\d+ prefetched and discarded, \d+ waited for\), (\d+) embedding/lm_head all-gathers)")))
    return std::nullopt;
  return FsdpLine{std::stoi(m[1]), std::stoi(m[2]), std::stoi(m[3]), std::stoi(m[4])};
}

TEST_F(TrainRuns, TwoRanksEqualOneRank) {
  for (const char* kind : {"trimkv", "dbtrimkv"}) {
    const std::string one = dir_ / (std::string("one-") + kind), two = dir_ / (std::string("two-") + kind);
    Result r = train(train_args(data_, one, kind, 5) + " --micro-batch 2");
    ASSERT_EQ(r.code, 0) << r.err;
    r = train(train_args(data_, two, kind, 5) + " --micro-batch 1", 2);
    ASSERT_EQ(r.code, 0) << r.err;
    expect_same_gates(one, two, 1e-5);
    expect_same_losses(one, two, 1e-5);
    // The gates did move: training is not a no-op.
    const formats::SafetensorsFile init = formats::SafetensorsFile::open(kFixtures + "/gates-" + kind + ".safetensors");
    const formats::SafetensorsFile end = formats::SafetensorsFile::open(one + "/gates.safetensors");
    for (const std::string& n : init.names()) EXPECT_GT(rel_diff(end.tensor(n), init.tensor(n)), 1e-4) << n;
  }
}

// --context-parallel (issue 39): each micro-batch's tokens split over the ranks of a group, as
// front and back chunks (40 tokens over 2 or 3 ranks: chunks of 10, or 6 and 7, documents
// crossing their edges) equal one rank to rounding — 2 ranks as one group, 4 as two groups of
// 2 (data parallelism around it), 3 as one group of 3 — for trimkv (local capacity) and dbtrimkv
// (global); the statistics of the logged steps too (effective cache: the ring's capacity sums).
TEST_F(TrainRuns, ContextParallelEqualsOneRank) {
  for (const char* kind : {"trimkv", "dbtrimkv"}) {
    const std::string one = dir_ / (std::string("one-") + kind);
    Result r = train(train_args(data_, one, kind, 3) + " --micro-batch 2");
    ASSERT_EQ(r.code, 0) << r.err;
    const struct {
      int ranks, group, micro_batch;
    } runs[] = {{2, 2, 2}, {4, 2, 1}, {3, 3, 4}};
    for (const auto& c : runs) {
      const std::string dir = dir_ / fmt::format("cp{}-of-{}-{}", c.group, c.ranks, kind);
      r = train(train_args(data_, dir, kind, 3) + fmt::format(" --micro-batch {} --context-parallel {}", c.micro_batch,
                                                              c.group),
                c.ranks);
      ASSERT_EQ(r.code, 0) << r.err;
      SCOPED_TRACE(dir);
      expect_same_gates(one, dir, 1e-5);
      expect_same_losses(one, dir, 1e-5);
      const auto a = metrics(one), b = metrics(dir);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i)
        for (const char* key : {"effective_cache", "mean_beta"}) {
          ASSERT_TRUE(a[i].contains(key) && b[i].contains(key)) << key;
          for (size_t l = 0; l < a[i][key].size(); ++l)
            EXPECT_NEAR(b[i][key][l].get<double>(), a[i][key][l].get<double>(),
                        1e-5 * std::abs(a[i][key][l].get<double>()))
                << key << " step " << i << " layer " << l;
        }
      EXPECT_NE(slurp(dir + "/config.toml").find(fmt::format("context_parallel = {}", c.group)), std::string::npos);
    }
  }
}

// A run saved with one group size resumes with another (the option is not part of the
// trajectory; the micro-batch is): 2 ranks as a group of 2, then 1 rank, then 2 ranks as two
// groups of 1.
TEST_F(TrainRuns, ContextParallelResumesAcrossAChangeOfGroupSize) {
  const std::string full = dir_ / "full", parts = dir_ / "parts";
  Result r = train(train_args(data_, full, "trimkv", 6) + " --micro-batch 2 --save-every 2");
  ASSERT_EQ(r.code, 0) << r.err;
  r = train(train_args(data_, parts, "trimkv", 6) + " --micro-batch 2 --save-every 2 --stop-after 2 --context-parallel 2",
            2);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(latest_step(parts), 2);
  r = train(train_args(data_, parts, "trimkv", 6) + " --micro-batch 2 --save-every 2 --stop-after 2 --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(latest_step(parts), 4);
  r = train(train_args(data_, parts, "trimkv", 6) + " --micro-batch 2 --save-every 2 --resume", 2);
  ASSERT_EQ(r.code, 0) << r.err;
  expect_same_gates(full, parts, 1e-5);
}

// Context parallelism divides a rank's memory: one 4,096-token step (12 random documents, some
// crossing the chunk edges) on 1, 2 and 4 ranks, trimkv and kvpop; rank 0's live-tensor peak
// (tensor_peak_gb) is ~1.4/N of one rank's (the T-proportional buffers divided by N, plus the
// ring's packets), the loss the same. A rank that held the whole sequence's activations anywhere would fail it.
TEST_F(TrainRuns, ContextParallelDividesTheMemory) {
  {
    std::ofstream corpus(dir_ / "long.jsonl");
    std::mt19937 rng(1);
    const char* words[] = {"alpha", "beta", "gamma", "delta", "retain", "cache", "token", "gate", "ring", "chunk"};
    for (int d = 0; d < 12; ++d) {
      std::string text;
      for (int w = 0, n = 200 + static_cast<int>(rng() % 700); w < n; ++w) text += std::string(words[rng() % 10]) + " ";
      corpus << nlohmann::json{{"text", text}}.dump() << "\n";
    }
  }
  Result r = run(bin("retain-pack") + " --tokenizer " + kModel + " --input " + (dir_ / "long.jsonl") + " --out " +
                     (dir_ / "long.h5") + " --seq-len 4096 --packing concat -q",
                 dir_);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string data = " --model " + kModel + " --data " + (dir_ / "long.h5") + " --global-batch 1 --steps 1";
  // trimkv, and kvpop (its teacher's activations and targets split the same way; each rank then
  // holds its share of the heads' whole-sequence inputs, 1/N of them): measured 0.60× and 0.31×.
  const std::string gates[] = {
      " --gate trimkv --init-gates " + kFixtures + "/gates-trimkv.safetensors --memory 4 --loss-chunk 16",
      " --gate kvpop --window 64 --sinks 4 --topk 32"};
  for (size_t g = 0; g < std::size(gates); ++g) {
    const std::string& gate = gates[g];
    SCOPED_TRACE(gate);
    std::map<int, nlohmann::json> step;
    for (int n : {1, 2, 4}) {
      const std::string out = dir_ / fmt::format("mem{}-gate{}", n, g);
      r = train(data + gate + " --out " + out + (n > 1 ? fmt::format(" --context-parallel {}", n) : std::string()), n);
      ASSERT_EQ(r.code, 0) << r.err;
      step[n] = metrics(out).back();
      ASSERT_TRUE(step[n]["tensor_peak_gb"].is_number()) << step[n].dump();
    }
    const double one = step[1]["tensor_peak_gb"].get<double>();
    EXPECT_LT(step[2]["tensor_peak_gb"].get<double>(), 0.75 * one) << step[2].dump() << " vs " << one;
    EXPECT_LT(step[4]["tensor_peak_gb"].get<double>(), 0.45 * one) << step[4].dump() << " vs " << one;
    EXPECT_NEAR(step[4]["loss"].get<double>(), step[1]["loss"].get<double>(), 1e-5);
    EXPECT_GT(step[4]["ring_mb"].get<double>(), 0.0);
    EXPECT_TRUE(step[1]["ring_mb"].is_null());
  }
}

// What --context-parallel refuses, in one line each: a group size that does not divide the
// ranks, a micro-batch too short to cut into 2N chunks, a size below 1.
TEST_F(TrainRuns, ContextParallelBadInputs) {
  expect_usage_errors({train_args(data_, dir_ / "x", "trimkv", 2) + " --context-parallel 0",
                       kvpop_args(" --steps 2 --context-parallel 0")},
                      "--context-parallel");
  Result r = train(train_args(data_, dir_ / "y", "trimkv", 2) + " --context-parallel 2");  // 1 rank, groups of 2
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find("--context-parallel 2: the 1 ranks do not divide into groups of 2"), std::string::npos) << r.err;
  r = train(train_args(data_, dir_ / "z", "trimkv", 2) + " --context-parallel 3", 3);  // 40 tokens: 6 chunks fit
  EXPECT_EQ(r.code, 0) << r.err;
  r = train(train_args(data_, dir_ / "w", "trimkv", 2) + " --context-parallel 2 --micro-batch 3", 2);
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find("context-parallel groups"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "y"));
  EXPECT_FALSE(fs::exists(dir_ / "w"));
}

// --fsdp-force-gather: one rank takes the FSDP provider and gathers every layer through its
// comm, as N ranks do (on a GPU: what measures the overlap). The values are the same, so the run
// is the plain one bit for bit; the log's counters show the gathers, and the run's config.toml
// keeps the option (a plain run's does not mention it).
TEST_F(TrainRuns, ForcedGatherEqualsThePlainRun) {
  const std::string plain = dir_ / "plain", forced = dir_ / "forced";
  Result r = train(train_args(data_, plain, "dbtrimkv", 3));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ((r.out + r.err).find("fsdp: "), std::string::npos) << "one rank uses the checkpoint in place";
  r = train(train_args(data_, forced, "dbtrimkv", 3) + " --fsdp-force-gather");
  ASSERT_EQ(r.code, 0) << r.err;
  expect_same_gates(plain, forced, 0);
  expect_same_losses(plain, forced, 0);
  const std::string log = r.out + r.err;
  const std::optional<FsdpLine> fsdp = fsdp_line(log);
  ASSERT_TRUE(fsdp) << log;
  // Each of the 3 steps' 4 micro-batches: the teacher, the student and the backward ask for
  // both layers of the fixture model, and the loss for the embedding and the lm_head. (Two
  // layers fit the two layer buffers, so after the first two gathers every request finds its
  // layer there: a deeper model gathers all along.)
  const int layers = 2, micro_batches = 3 * 4;
  EXPECT_GE(fsdp->layer_requests, micro_batches * 3 * layers) << log;
  EXPECT_GE(fsdp->layer_gathers, layers) << log;
  EXPECT_GT(fsdp->prefetch_hits, 0) << log;
  EXPECT_GE(fsdp->global_gathers, micro_batches) << log;
  EXPECT_NE(slurp(forced + "/config.toml").find("fsdp_force_gather = true"), std::string::npos);
  EXPECT_EQ(slurp(plain + "/config.toml").find("fsdp_force_gather"), std::string::npos);
}

// The NVTX ranges of a run, read back through an injection library (nvtx_recorder.cpp) as a
// profiler sees them. Every step is a "step" range whose children are one range per phase the
// step log times, per micro-batch (count pass, teacher, student, loss, backward; capacity twice:
// forward and backward), then "reduce" and "optimizer"; pushes and pops pair up on each thread.
// With --fsdp-force-gather the FSDP provider's "layer l" spans open and close once per layer
// request and "all-gather" once per gather: the counts the run's own fsdp line reports.
TEST_F(TrainRuns, NvtxRangesCoverEveryPhase) {
#ifndef RETAIN_NVTX_RECORDER
  GTEST_SKIP() << "built without NVTX (no CUDA toolkit at configure time): no ranges to record";
#else
  Result r;
  const NvtxLog nvtx = run_recorded(RETAIN_NVTX_RECORDER,
                                    "timeout 120 " + bin("retain-train") + train_args(data_, dir_ / "run", "trimkv", 3) +
                                        " --micro-batch 2 --fsdp-force-gather",
                                    dir_, &r);
  ASSERT_EQ(r.code, 0) << r.err;
  ASSERT_TRUE(nvtx.problems.empty()) << nvtx.problems.front();

  const int micro_batches = 2;  // --global-batch 4, --micro-batch 2, one rank
  const std::map<std::string, int> want = {{"count pass", micro_batches}, {"teacher", micro_batches},
                                           {"student", micro_batches},    {"capacity", 2 * micro_batches},
                                           {"loss", micro_batches},       {"backward", micro_batches},
                                           {"reduce", 1},                 {"optimizer", 1}};
  ASSERT_EQ(nvtx.steps.size(), 3u);
  for (const auto& counted : nvtx.steps) EXPECT_EQ(counted, want);

  const std::optional<FsdpLine> fsdp = fsdp_line(r.out + r.err);
  ASSERT_TRUE(fsdp) << r.out + r.err;
  const int requests = fsdp->layer_requests;
  EXPECT_EQ(nvtx.spans_started, requests);
  EXPECT_EQ(nvtx.spans, (std::map<std::string, int>{{"layer 0", requests / 2}, {"layer 1", requests / 2}}));
  EXPECT_EQ(nvtx.pushes.at("all-gather"), fsdp->layer_gathers + fsdp->global_gathers);
#endif
}

TEST_F(TrainRuns, ResumeAfterStopAfterIsExact) {
  const std::string full = dir_ / "full", parts = dir_ / "parts", parts2 = dir_ / "parts2";
  Result r = train(train_args(data_, full, "trimkv", 6) + " --save-every 2");
  ASSERT_EQ(r.code, 0) << r.err;
  r = train(train_args(data_, parts, "trimkv", 6) + " --save-every 2 --stop-after 3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(latest_step(parts), 3);
  EXPECT_FALSE(fs::exists(parts + "/gates.safetensors"));  // not finished
  r = train(train_args(data_, parts, "trimkv", 6) + " --save-every 2 --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  expect_same_gates(full, parts, 0);
  expect_same_losses(full, parts, 0);
  // Saved by one rank, resumed by two (the optimizer state is re-sharded).
  r = train(train_args(data_, parts2, "trimkv", 6) + " --save-every 2 --stop-after 3");
  ASSERT_EQ(r.code, 0) << r.err;
  r = train(train_args(data_, parts2, "trimkv", 6) + " --save-every 2 --resume", 2);
  ASSERT_EQ(r.code, 0) << r.err;
  expect_same_gates(full, parts2, 1e-5);
}

TEST_F(TrainRuns, SigkillAtAnyMomentThenResume) {
  const std::string full = dir_ / "full";
  Result r = train(train_args(data_, full, "dbtrimkv", 40) + " --save-every 1 --keep-last 2");
  ASSERT_EQ(r.code, 0) << r.err;
  // Killed at three different moments (while saving every step, a kill often lands mid-save).
  const std::string killed = dir_ / "killed";
  for (int round = 0; round < 3; ++round) {
    const pid_t pid = spawn(bin("retain-train") + train_args(data_, killed, "dbtrimkv", 40) +
                            " --save-every 1 --keep-last 2" + (round ? " --resume" : ""));
    const int before = latest_step(killed);
    if (wait_for_checkpoint(killed, before + 2, pid)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(3 * round));
      kill(pid, SIGKILL);
    }
    int status;
    waitpid(pid, &status, 0);
  }
  r = train(train_args(data_, killed, "dbtrimkv", 40) + " --save-every 1 --keep-last 2 --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  expect_same_gates(full, killed, 0);
  expect_same_losses(full, killed, 0);
}

TEST_F(TrainRuns, SigtermOnOneRankStopsEveryRankAndResumes) {
  const std::string full = dir_ / "full", term = dir_ / "term";
  Result r = train(train_args(data_, full, "trimkv", 24) + " --save-every 6");
  ASSERT_EQ(r.code, 0) << r.err;
  // As a scheduler's preemption signal reaching only one rank: the ranks agree on the step to
  // stop at, every rank saves its shard, every rank exits 0.
  const pid_t pid = spawn(mpirun(2) + bin("retain-train") + train_args(data_, term, "trimkv", 24) + " --save-every 6");
  ASSERT_TRUE(wait_for_checkpoint(term, 6, pid)) << "no checkpoint appeared";
  const std::vector<pid_t> ranks = children(pid);
  ASSERT_EQ(ranks.size(), 2u);
  kill(ranks.back(), SIGTERM);
  int status;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  EXPECT_EQ(WEXITSTATUS(status), 0);
  const int stopped = latest_step(term);
  ASSERT_GE(stopped, 6);
  if (stopped < 24) {
    EXPECT_FALSE(fs::exists(term + "/gates.safetensors"));
    r = train(train_args(data_, term, "trimkv", 24) + " --save-every 6 --resume", 2);
    ASSERT_EQ(r.code, 0) << r.err;
  }
  expect_same_gates(full, term, 1e-5);
}

TEST_F(TrainRuns, NonFiniteValuesStopWithStepAndLayer) {
  // Gates overflowed to ±inf after step 1 (what a learning rate of 1e30 did before the command
  // line refused it; injected now, kernels/base/fault.h): the next forward's logβ is NaN. The run
  // stops with the step, the layer and the last good checkpoint.
  const std::string out = dir_ / "nan";
  const Result r = run("RETAIN_FAULT_OVERFLOW_AFTER_STEP=1 timeout 120 " + bin("retain-train") +
                           train_args(data_, out, "trimkv", 5) + " --save-every 1",
                       dir_);
  EXPECT_EQ(r.code, 1);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.err, m, std::regex("step ([0-9]+): layer 0: gated_attention: log_beta\\[.*nan")))
      << r.err;
  const int bad = std::stoi(m[1]);
  EXPECT_GE(bad, 2);
  EXPECT_NE(r.err.find("last good checkpoint is " + out + "/checkpoints/step-0000000" + std::to_string(bad - 1)),
            std::string::npos)
      << r.err;
  EXPECT_EQ(latest_step(out), bad - 1);
  EXPECT_FALSE(fs::exists(out + "/gates.safetensors"));
}

// One line on stderr naming the problem, a non-zero exit, no run directory left behind.
void expect_clean_error(const Result& r, const std::string& needle) {
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

// --capacity-skip E is opt-in: the default (60, exact) leaves the run as it was; a small E skips
// decayed capacity tiles, is recorded in the checkpoint's config, and a resume must keep it.
// The fixture's documents are short, so only an extreme E (1e-6: every tile off the diagonal
// whose keys decay at all) drops terms here: micro-batches of 4 × 40 tokens put documents across
// 64-token tiles, and the capacity loss changes (the sums fall, and so may the count of positive
// hinges it is averaged over).
TEST_F(TrainRuns, CapacitySkipIsOptInAndKeptOnResume) {
  const std::string exact = dir_ / "exact", skip = dir_ / "skip", same = dir_ / "same";
  const std::string mb = " --micro-batch 4";
  ASSERT_EQ(train(train_args(data_, exact, "trimkv", 1) + mb).code, 0);
  ASSERT_EQ(train(train_args(data_, same, "trimkv", 1) + mb + " --capacity-skip 60").code, 0);
  expect_same_losses(exact, same, 0);
  const Result r = train(train_args(data_, skip, "trimkv", 1) + mb + " --capacity-skip 1e-6");
  ASSERT_EQ(r.code, 0) << r.err;
  const double cap_exact = metrics(exact).at(0).at("cap").get<double>();
  const double cap_skip = metrics(skip).at(0).at("cap").get<double>();
  EXPECT_GT(cap_exact, 0);
  EXPECT_GT(std::abs(cap_skip - cap_exact), 1e-3 * cap_exact) << "E = 1e-6 should drop terms";
  expect_clean_error(train(train_args(data_, skip, "trimkv", 1) + mb + " --resume"),
                     "cannot resume with a different configuration: capacity_skip: missing in the new config");
  expect_clean_error(train(train_args(data_, exact, "trimkv", 1) + mb + " --capacity-skip 20 --resume"),
                     "capacity_skip: missing in the checkpoint");
  const std::string bad = train_args(data_, dir_ / "bad", "trimkv", 1);
  expect_usage_errors({bad + " --capacity-skip 0", bad + " --capacity-skip -3", bad + " --capacity-skip nan"},
                      "--capacity-skip");
}

TEST_F(TrainRuns, ReverseKlIsOptInAndKeptOnResume) {
  const std::string fwd = dir_ / "fwd", rev = dir_ / "rev", same = dir_ / "same";
  const std::string mb = " --micro-batch 4";
  ASSERT_EQ(train(train_args(data_, fwd, "trimkv", 1) + mb).code, 0);
  ASSERT_EQ(train(train_args(data_, same, "trimkv", 1) + mb + " --kl forward").code, 0);
  expect_same_losses(fwd, same, 0);
  const Result r = train(train_args(data_, rev, "trimkv", 1) + mb + " --kl reverse");
  ASSERT_EQ(r.code, 0) << r.err;
  const double kl_fwd = metrics(fwd).at(0).at("kl").get<double>(), kl_rev = metrics(rev).at(0).at("kl").get<double>();
  EXPECT_GT(kl_fwd, 0);
  EXPECT_GT(kl_rev, 0);
  EXPECT_GT(std::abs(kl_rev - kl_fwd), 1e-4 * kl_fwd) << "the two directions are different losses";
  expect_clean_error(train(train_args(data_, rev, "trimkv", 1) + mb + " --resume"),
                     "cannot resume with a different configuration: kl: \"reverse\" in the checkpoint, \"forward\" now");
  expect_clean_error(train(train_args(data_, fwd, "trimkv", 1) + mb + " --kl reverse --resume"),
                     "kl: \"forward\" in the checkpoint, \"reverse\" now");
  expect_usage_errors({train_args(data_, dir_ / "bad", "trimkv", 1) + " --kl backward", kvpop_args(" --kl reverse")},
                      "--kl");
}

TEST_F(TrainRuns, CapacityModeIsAnOptionKeptOnResume) {
  const std::string local = dir_ / "local", global = dir_ / "global", same = dir_ / "same";
  const std::string mb = " --micro-batch 4";
  ASSERT_EQ(train(train_args(data_, local, "trimkv", 1) + mb).code, 0);
  ASSERT_EQ(train(train_args(data_, same, "trimkv", 1) + mb + " --capacity local").code, 0);
  expect_same_losses(local, same, 0);
  const Result r = train(train_args(data_, global, "trimkv", 1) + mb + " --capacity global");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(metrics(local).at(0).at("cap").get<double>(), metrics(global).at(0).at("cap").get<double>());
  expect_clean_error(train(train_args(data_, global, "trimkv", 1) + mb + " --resume"),
                     "cannot resume with a different configuration: capacity: \"global\" in the checkpoint, \"local\" now");
  // The run's config.toml repeats it.
  const Result again = train(" --config " + (global + "/config.toml") + " --out " + (dir_ / "again"));
  ASSERT_EQ(again.code, 0) << again.err;
  expect_same_losses(global, dir_ / "again", 0);
  expect_usage_errors(
      {train_args(data_, dir_ / "bad", "trimkv", 1) + " --capacity both", kvpop_args(" --capacity global")},
      "--capacity");
}

// --gate-hidden 0: a fresh linear trimkv gate (TRIM-KV Fig. 10) trains, its gates file holds
// linear.weight [K, D] and bias [K] per layer, and a stopped run resumes exactly; dbtrimkv and a
// negative width are usage errors.
TEST_F(TrainRuns, LinearGateTrainsAndResumesExactly) {
  const std::string full = dir_ / "full", parts = dir_ / "parts";
  const std::string args = fresh_gate_args("trimkv --gate-hidden 0") + " --steps 4 --save-every 2 --out ";
  Result r = train(args + full);
  ASSERT_EQ(r.code, 0) << r.err;
  const formats::SafetensorsFile f = formats::SafetensorsFile::open(full + "/gates.safetensors");
  EXPECT_EQ(f.names().size(), 2u * 2);
  EXPECT_EQ(f.entry("model.layers.1.self_attn.retention_gate.linear.weight").shape, (Shape{2, 32}));
  EXPECT_EQ(f.metadata().at("gate_hidden"), "0");
  const auto m = metrics(full);
  ASSERT_EQ(m.size(), 4u);
  EXPECT_GT(m.at(0).at("cap").get<double>(), 0) << "bias 2 decays: a capacity loss to learn from";
  r = train(args + parts + " --stop-after 2");
  ASSERT_EQ(r.code, 0) << r.err;
  r = train(args + parts + " --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  expect_same_gates(full, parts, 0);
  expect_same_losses(full, parts, 0);
  const std::string bad = " --model " + kModel + " --data " + data_ + " --out " + (dir_ / "bad");
  expect_usage_errors({bad + " --gate dbtrimkv --gate-hidden 0", bad + " --gate trimkv --gate-hidden -1"},
                      "--gate-hidden");
}

// --gate-input kv: fresh dbtrimkv gates reading [k ‖ v] train (linear1.weight [G, 2·K·head_dim],
// gate_input "kv" in the file), the option is kept on resume and in config.toml, --init-gates must
// agree with it, and kvpop or an unknown input are usage errors.
TEST_F(TrainRuns, KvGateInputIsAnOptionKeptOnResume) {
  const std::string kv = dir_ / "kv", again = dir_ / "again";
  const std::string args = fresh_gate_args("dbtrimkv --gate-hidden 8") + " --steps 3 --save-every 1";
  Result r = train(args + " --gate-input kv --stop-after 2 --out " + kv);
  ASSERT_EQ(r.code, 0) << r.err;
  expect_clean_error(train(args + " --resume --out " + kv),
                     "cannot resume with a different configuration: gate_input: \"kv\" in the checkpoint, \"hidden\" now");
  r = train(args + " --gate-input kv --resume --out " + kv);
  ASSERT_EQ(r.code, 0) << r.err;
  const formats::SafetensorsFile f = formats::SafetensorsFile::open(kv + "/gates.safetensors");
  EXPECT_EQ(f.metadata().at("gate_input"), "kv");
  EXPECT_EQ(f.entry("model.layers.0.self_attn.retention_gate.linear1.weight").shape, (Shape{8, 2 * 2 * 16}));
  r = train(" --config " + (kv + "/config.toml") + " --out " + again);  // config.toml repeats it
  ASSERT_EQ(r.code, 0) << r.err;
  expect_same_losses(kv, again, 0);
  expect_clean_error(train(train_args(data_, dir_ / "bad", "dbtrimkv", 1) + " --gate-input kv"),
                     "these gates read hidden, but --gate-input is kv");
  const std::string bad = " --model " + kModel + " --data " + data_ + " --out " + (dir_ / "bad");
  expect_usage_errors({bad + " --gate-input keys", kvpop_args(" --gate-input kv")}, "--gate-input");
  EXPECT_FALSE(fs::exists(dir_ / "bad"));
}

TEST_F(TrainRuns, BadInputsAreClearErrors) {
  const std::string out = dir_ / "run";
  expect_clean_error(train(train_args(dir_ / "missing.h5", out, "trimkv", 1)), "missing.h5");
  EXPECT_FALSE(fs::exists(out));
  expect_clean_error(train(train_args(data_, out, "trimkv", 1) + " --seq-len 64"), "--seq-len");
  EXPECT_FALSE(fs::exists(out));
  expect_clean_error(train(" --model " + (dir_ / "nomodel") + " --data " + data_ + " --out " + out), "nomodel");

  // A model whose tokenizer.json differs from the one the data was packed with.
  const std::string other = dir_ / "other-model";
  fs::copy(kModel, other);
  { std::ofstream(other + "/tokenizer.json", std::ios::app) << "\n"; }
  expect_clean_error(train(" --model " + other + " --data " + data_ + " --out " + out), "tokenizer");
  // Data packed with a tokenizer of 300 tokens (41 extra added tokens) for a model of 259.
  const std::string small = dir_ / "small-model";
  ASSERT_EQ(run(bin("retain-make-tiny") + " --out " + small + " --vocab 259", dir_).code, 0);
  nlohmann::json tok = nlohmann::json::parse(slurp(small + "/tokenizer.json"));
  for (int id = 259; id < 300; ++id)
    tok["added_tokens"].push_back({{"id", id}, {"content", "<extra_" + std::to_string(id) + ">"}, {"single_word", false},
                                   {"lstrip", false}, {"rstrip", false}, {"normalized", false}, {"special", true}});
  std::ofstream(small + "/tokenizer.json") << tok.dump();
  const std::string wide = dir_ / "wide.h5";
  ASSERT_EQ(run(bin("retain-pack") + " --tokenizer " + small + " --input " + kFixtures + "/corpus.jsonl --out " + wide +
                    " --seq-len 40 -q",
                dir_)
                .code,
            0);
  expect_clean_error(train(" --model " + small + " --data " + wide + " --out " + out), "vocab");
  EXPECT_FALSE(fs::exists(out));

  // A finished run: no restart over it without --resume; a resume must keep the trajectory.
  ASSERT_EQ(train(train_args(data_, out, "trimkv", 2)).code, 0);
  expect_clean_error(train(train_args(data_, out, "trimkv", 2)), "--resume");
  expect_clean_error(train(train_args(data_, out, "trimkv", 4, "0.5") + " --resume"),
                     "cannot resume with a different configuration: lr: 0.01 in the checkpoint, 0.5 now");
  expect_clean_error(train(train_args(data_, out, "trimkv", 4) + " --resume"), "steps: 2 in the checkpoint, 4 now");
  // Two ranks parse alike: --help and usage errors end every rank (no rank waits in a
  // collective for one that left), and print once.
  Result help = train(" --help", 2);
  EXPECT_EQ(help.code, 0) << help.err;
  EXPECT_EQ(std::count(help.out.begin(), help.out.end(), '\n') > 10, true) << help.out;
  EXPECT_EQ(help.out.find("Usage:"), help.out.rfind("Usage:")) << "printed twice: " << help.out;
  for (const char* bad : {" --bogus 1", " stray"}) {
    const Result u = train(train_args(data_, dir_ / "run3", "trimkv", 1) + bad, 2);
    EXPECT_EQ(u.code, 2) << bad << ": " << u.err;
    EXPECT_EQ(u.err.find("retain-train: error:"), u.err.rfind("retain-train: error:")) << u.err;
  }
  // Two ranks: one error line, from one rank (mpirun adds its own summary of the exit codes).
  const Result two = train(train_args(dir_ / "missing.h5", dir_ / "run2", "trimkv", 1), 2);
  EXPECT_NE(two.code, 0);
  size_t lines = 0;
  for (size_t at = two.err.find("retain-train: error:"); at != std::string::npos;
       at = two.err.find("retain-train: error:", at + 1))
    ++lines;
  EXPECT_EQ(lines, 1u) << two.err;
  EXPECT_NE(two.err.find("missing.h5"), std::string::npos) << two.err;
}

}  // namespace
}  // namespace retain::trainer::test
