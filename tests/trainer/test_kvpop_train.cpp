// retain-train --gate kvpop (DESIGN §5): --dump-grads against the float64 reference of the
// whole step (tests/fixtures/kvpop/make_step_fixture.py: transformers' Qwen3 for k, v and the
// attention probabilities, brute-force selection, mlstm-kernels, autograd) on one rank, with
// gradient accumulation and on 2 ranks; 2 ranks train as 1; --stop-after + --resume is exact;
// kvpop options are checked on the command line.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "data/formats/safetensors.h"
#include "kernels/base/atomic_file.h"
#include "model/kvpop/scorer_containers.h"
#include "tests/trainer/train_helpers.h"

namespace retain::trainer::test {
namespace {

const std::string kStep = std::string(RETAIN_FIXTURES_DIR) + "/kvpop/step";
const std::string kKvpopArgs = " --gate kvpop --window 6 --sinks 2 --topk 3 --global-batch 4 --seed 3";

// ‖a − b‖ / max(‖b‖, 1e-3): out.bias cancels in ŝ_new − ŝ_b, so its true gradient is 0.
double grad_error(const Tensor& got, const Tensor& want) {
  const Tensor x = got.to_dtype(DType::F64), y = want.to_dtype(DType::F64);
  double num = 0, den = 0;
  for (int64_t i = 0; i < y.numel(); ++i) {
    num += (x.data<double>()[i] - y.data<double>()[i]) * (x.data<double>()[i] - y.data<double>()[i]);
    den += y.data<double>()[i] * y.data<double>()[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-3);
}

struct Launch {
  const char* name;
  int ranks;
  int micro_batch;
  const char* args;      // besides kKvpopArgs
  const char* expected;  // the fixture of make_step_fixture.py for those args
};

class KvpopDumpGrads : public ::testing::TestWithParam<Launch> {};

TEST_P(KvpopDumpGrads, MatchesFloat64Reference) {
  const Launch launch = GetParam();
  TempDir dir;
  const std::string data = pack_fixture_corpus(dir), dump = dir / "dump.safetensors";
  const std::string cmd = (launch.ranks > 1 ? mpirun(launch.ranks) : std::string()) + bin("retain-train") +
                          " --model " + kModel + " --data " + data + kKvpopArgs + " --init-gates " + kStep +
                          "/scorers.safetensors --dump-grads " + dump + " --micro-batch " +
                          std::to_string(launch.micro_batch) + " " + launch.args;
  const Result r = run(cmd, dir);
  ASSERT_EQ(r.code, 0) << cmd << "\n" << r.err;

  const formats::SafetensorsFile got = formats::SafetensorsFile::open(dump);
  const formats::SafetensorsFile want =
      formats::SafetensorsFile::open(kStep + "/" + launch.expected);
  const formats::SafetensorsFile init = formats::SafetensorsFile::open(kStep + "/scorers.safetensors");
  for (const char* b : {"batch/input_ids", "batch/doc_ids", "batch/target_mask"})
    EXPECT_TRUE(bytes_equal(got.tensor(b), want.tensor(b))) << b;
  EXPECT_EQ(got.metadata().at("decisions"), want.metadata().at("decisions"));
  int grads = 0;
  double worst = 0;
  for (const std::string& param : init.names()) {
    ++grads;
    ASSERT_TRUE(got.contains("grad/" + param)) << param;
    EXPECT_TRUE(bytes_equal(got.tensor(param), init.tensor(param))) << param << " is not the --init-gates value";
    const double e = grad_error(got.tensor("grad/" + param), want.tensor("grad/" + param));
    EXPECT_LE(e, 1e-4) << param;
    worst = std::max(worst, e);
  }
  EXPECT_EQ(grads, 20);  // 2 layers × 10 tensors
  RecordProperty("worst_grad_error", std::to_string(worst));
  EXPECT_LE(rel_diff(got.tensor("loss/kvpop"), want.tensor("loss/kvpop")), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Launches, KvpopDumpGrads,
                         ::testing::Values(
                             Launch{"one_rank", 1, 4, "", "expected.safetensors"},
                             Launch{"accumulate", 1, 1, "", "expected.safetensors"},
                             Launch{"plain", 1, 2, "--no-margin-weight", "expected-plain.safetensors"},
                             Launch{"two_ranks", 2, 2, "", "expected.safetensors"},
                             Launch{"two_ranks_accumulate", 2, 1, "--no-margin-weight", "expected-plain.safetensors"},
                             // --target-cutoff raw: the rule before issue 38 (log m alone)
                             Launch{"raw_cutoff", 1, 4, "--target-cutoff raw", "expected-raw.safetensors"},
                             // --decay-every and the decay range, in the loss and the effective targets
                             Launch{"decay_every_and_range", 1, 2, "--decay-every 3 --decay-min 0.9 --decay-max 0.99",
                                    "expected-decay.safetensors"},
                             Launch{"decay_two_ranks", 2, 1, "--decay-every 3 --decay-min 0.9 --decay-max 0.99",
                                    "expected-decay.safetensors"},
                             // --context-parallel (issue 39): each micro-batch's tokens over a group
                             // of 2 or 3 ranks (the target's ring, the heads gathered to owners),
                             // and two groups of 2 with data parallelism around them
                             Launch{"context_parallel_2", 2, 4, "--context-parallel 2", "expected.safetensors"},
                             Launch{"context_parallel_3", 3, 4, "--context-parallel 3", "expected.safetensors"},
                             Launch{"context_parallel_2x2", 4, 2, "--context-parallel 2 --no-margin-weight",
                                    "expected-plain.safetensors"},
                             Launch{"decay_context_parallel_2", 2, 2,
                                    "--context-parallel 2 --decay-every 3 --decay-min 0.9 --decay-max 0.99",
                                    "expected-decay.safetensors"}),
                         [](const auto& info) { return std::string(info.param.name); });

class KvpopRuns : public ::testing::Test {
 protected:
  void SetUp() override { data_ = pack_fixture_corpus(dir_); }
  Result train(const std::string& out, int steps, const std::string& extra, int ranks = 1,
               const std::string& kvpop = kKvpopArgs) {
    const std::string cmd = "timeout 120 " + (ranks > 1 ? mpirun(ranks) : std::string()) + bin("retain-train") +
                            " --model " + kModel + " --data " + data_ + " --out " + out + kvpop +
                            " --init-gates " + kStep + "/scorers.safetensors --warmup 2 --lr 0.01 --steps " +
                            std::to_string(steps) + " " + extra;
    return run(cmd, dir_);
  }
  // The per-step metrics of two runs: equal (tol = 0) or within tol relative (scale ≥ 1e-2).
  static void expect_same_metrics(const std::string& a_dir, const std::string& b_dir, double tol) {
    const auto a = metrics(a_dir), b = metrics(b_dir);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i)
      for (const char* f : {"step", "loss", "agreement", "gamma", "decisions", "grad_norm", "lr"}) {
        const double x = a[i].at(f).get<double>(), y = b[i].at(f).get<double>();
        EXPECT_LE(std::abs(x - y), tol * std::max(std::abs(y), 1e-2)) << "step " << i + 1 << " " << f;
      }
  }
  TempDir dir_;
  std::string data_;
};

TEST_F(KvpopRuns, TwoRanksEqualOneRankAndScorersMove) {
  const std::string one = dir_ / "one", two = dir_ / "two";
  Result r = train(one, 4, "--micro-batch 2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE((r.out + r.err).find(" agree "), std::string::npos) << r.out << r.err;  // the per-step line
  r = train(two, 4, "--micro-batch 1", 2);
  ASSERT_EQ(r.code, 0) << r.err;
  // Rounding of the reductions only (measured 1.03e-5 in q_proj after 4 steps at lr 0.01 with the
  // default --target-cutoff effective; 1e-5 held with the raw rule).
  expect_same_gates(one, two, 2e-5);
  expect_same_metrics(one, two, 2e-5);
  const formats::SafetensorsFile init = formats::SafetensorsFile::open(kStep + "/scorers.safetensors");
  const formats::SafetensorsFile end = formats::SafetensorsFile::open(one + "/gates.safetensors");
  EXPECT_EQ(end.metadata().at("gate_kind"), "kvpop");
  EXPECT_EQ(end.metadata().at("topk"), "3");
  for (const std::string& n : init.names())
    if (n.find("out.bias") == std::string::npos) {  // no gradient (it cancels), only weight decay
      EXPECT_GT(rel_diff(end.tensor(n), init.tensor(n)), 1e-4) << n;
    } else {
      EXPECT_LT(rel_diff(end.tensor(n), init.tensor(n)), 1e-6) << n;
    }
}

// --context-parallel trains as one rank: a group of 2 (the micro-batch's 160 tokens in chunks
// of 40), and a group of 3 (chunks of 26–27, the heads' owners unbalanced: 4 heads over 3 ranks);
// and a run resumes with another group size.
TEST_F(KvpopRuns, ContextParallelTrainsAsOneRank) {
  const std::string one = dir_ / "one";
  Result r = train(one, 3, "--micro-batch 4");
  ASSERT_EQ(r.code, 0) << r.err;
  for (int n : {2, 3}) {
    const std::string cp = dir_ / ("cp" + std::to_string(n));
    r = train(cp, 3, "--micro-batch 4 --context-parallel " + std::to_string(n), n);
    ASSERT_EQ(r.code, 0) << r.err;
    SCOPED_TRACE(cp);
    // Rounding: the ring's attention and target sum in another order. One step's gradients agree
    // within 2.6e-6 (relative, the worst tensor; --dump-grads, 2 ranks); after 3 Adam steps the
    // weights within 2.4e-5 (q_proj; Adam scales each element's rounding by 1/√v).
    expect_same_gates(one, cp, 5e-5);
    expect_same_metrics(one, cp, 2e-5);
    const auto m = metrics(cp);
    EXPECT_GT(m.back().at("ring_mb").get<double>(), 0.0);
    EXPECT_EQ(m.back().at("tokens"), metrics(one).back().at("tokens"));
  }
  // Resumed with another group size (not part of the trajectory): 2 steps as a group of 2, the
  // third on one rank.
  const std::string parts = dir_ / "parts";
  r = train(parts, 3, "--micro-batch 4 --save-every 1 --stop-after 2 --context-parallel 2", 2);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(latest_step(parts), 2);
  r = train(parts, 3, "--micro-batch 4 --save-every 1 --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  expect_same_gates(one, parts, 5e-5);
}

TEST_F(KvpopRuns, ResumeAfterStopAfterIsExact) {
  const std::string full = dir_ / "full", parts = dir_ / "parts";
  Result r = train(full, 5, "--save-every 2");
  ASSERT_EQ(r.code, 0) << r.err;
  r = train(parts, 5, "--save-every 2 --stop-after 3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(latest_step(parts), 3);
  EXPECT_FALSE(fs::exists(parts + "/gates.safetensors"));
  r = train(parts, 5, "--save-every 2 --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  expect_same_gates(full, parts, 0);
  expect_same_metrics(full, parts, 0);
  // Another geometry is another run.
  r = train(parts, 5, "--resume", 1, " --gate kvpop --window 6 --sinks 2 --topk 4 --global-batch 4 --seed 3");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("topk: 3 in the checkpoint, 4 now"), std::string::npos) << r.err;
}

// A kvpop checkpoint written before issue 38 (its state.json config has none of the new keys)
// was trained with Adam betas 0.9/0.999, n = 1, the default range and raw targets: it resumes
// with --target-cutoff raw, and the new default (effective) is refused as another run.
TEST_F(KvpopRuns, CheckpointsFromBeforeTheOptionsResumeAsTheRawRule) {
  const std::string run_dir = dir_ / "old";
  Result r = train(run_dir, 4, "--save-every 2 --stop-after 2 --target-cutoff raw");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string state = run_dir + "/checkpoints/step-00000002/state.json";
  nlohmann::json j = nlohmann::json::parse(read_file(state));
  for (const char* k : {"adam_beta1", "adam_beta2", "decay_every", "decay_min", "decay_max", "target_cutoff"}) {
    ASSERT_TRUE(j["config"].contains(k)) << k;
    j["config"].erase(k);
  }
  write_file_atomic(state, j.dump(2));
  r = train(run_dir, 4, "--save-every 2 --resume");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("target_cutoff: \"raw\" in the checkpoint, \"effective\" now"), std::string::npos) << r.err;
  r = train(run_dir, 4, "--save-every 2 --resume --target-cutoff raw");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(latest_step(run_dir), 4);
}

TEST_F(KvpopRuns, KvpopOptionsAreCheckedOnTheCommandLine) {
  const std::string base = bin("retain-train") + " --model " + kModel + " --data " + data_ + " --out " + (dir_ / "x");
  Result r = run(base + " --gate kvpop", dir_);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--gate kvpop needs --topk K"), std::string::npos) << r.err;
  r = run(base + " --gate trimkv --topk 3", dir_);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("are for --gate kvpop"), std::string::npos) << r.err;
  r = run(base + " --gate kvpop --topk 3 --window 0", dir_);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--window must be ≥ 1"), std::string::npos) << r.err;
  // Issue 38's options: one line naming the option, exit 2.
  for (const auto& [args, what] :
       {std::pair{" --gate kvpop --topk 3 --decay-every 0", "--decay-every must be ≥ 1"},
        std::pair{" --gate kvpop --topk 3 --decay-min 0", "--decay-min must be in (0, 1]"},
        std::pair{" --gate kvpop --topk 3 --decay-min 1.5", "--decay-min must be in (0, 1]"},
        std::pair{" --gate kvpop --topk 3 --decay-min 0.99 --decay-max 0.9", "--decay-max must be in [--decay-min, 1]"},
        std::pair{" --gate kvpop --topk 3 --decay-max nan", "--decay-max"},
        std::pair{" --gate kvpop --topk 3 --target-cutoff best", "--target-cutoff: unknown rule 'best'"},
        std::pair{" --gate trimkv --decay-every 2", "are for --gate kvpop"},
        std::pair{" --gate trimkv --target-cutoff raw", "are for --gate kvpop"},
        std::pair{" --gate kvpop --topk 3 --adam-beta1 1", "--adam-beta1 must be in [0, 1)"},
        std::pair{" --gate trimkv --adam-beta2=-0.1", "--adam-beta2 must be in [0, 1)"}}) {
    r = run(base + args, dir_);
    EXPECT_EQ(r.code, 2) << args;
    EXPECT_NE(r.err.find(what), std::string::npos) << args << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << ": " << r.err;
  }
}

// --adam-beta1/--adam-beta2 and the decay options are part of the run: config.json records them,
// a resume keeps them (exactly as the uninterrupted run) and refuses other values; the betas
// change the trajectory; the decay travels into the checkpoint's and the final scorers.
TEST_F(KvpopRuns, NewOptionsAreKeptByResumeAndFiles) {
  // Every option once per command line: the common part and the three that a resume varies.
  const std::string common = "--save-every 2 --adam-beta1 0.8 --decay-min 0.9 --decay-max 0.99";
  auto with = [&](const char* beta2, const char* every, const char* cutoff) {
    return common + " --adam-beta2 " + beta2 + " --decay-every " + every + " --target-cutoff " + cutoff;
  };
  const std::string opts = with("0.95", "3", "effective");
  const std::string full = dir_ / "full", parts = dir_ / "parts", plain = dir_ / "plain";
  Result r = train(full, 4, opts);
  ASSERT_EQ(r.code, 0) << r.err;
  r = train(parts, 4, opts + " --stop-after 2");
  ASSERT_EQ(r.code, 0) << r.err;
  r = train(parts, 4, with("0.999", "3", "effective") + " --resume");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("adam_beta2: 0.95 in the checkpoint, 0.999 now"), std::string::npos) << r.err;
  r = train(parts, 4, with("0.95", "1", "effective") + " --resume");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("decay_every: 3 in the checkpoint, 1 now"), std::string::npos) << r.err;
  r = train(parts, 4, with("0.95", "3", "raw") + " --resume");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("target_cutoff: \"effective\" in the checkpoint, \"raw\" now"), std::string::npos) << r.err;
  r = train(parts, 4, opts + " --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  expect_same_gates(full, parts, 0);
  expect_same_metrics(full, parts, 0);
  std::ifstream cf(full + "/config.json");
  const nlohmann::json cfg = nlohmann::json::parse(cf);
  EXPECT_EQ(cfg.at("adam_beta1").get<double>(), 0.8);
  EXPECT_EQ(cfg.at("adam_beta2").get<double>(), 0.95);
  EXPECT_EQ(cfg.at("decay_every").get<int64_t>(), 3);
  EXPECT_EQ(cfg.at("target_cutoff").get<std::string>(), "effective");
  const formats::SafetensorsFile end = formats::SafetensorsFile::open(full + "/gates.safetensors");
  EXPECT_EQ(end.metadata().at("decay_every"), "3");
  EXPECT_EQ(end.metadata().at("decay_min"), "0.9");
  EXPECT_EQ(end.metadata().at("decay_max"), "0.99");
  // The export of a run (GGUF) carries the decay; reading it back gives the run's.
  r = run(bin("retain-export") + " --from " + full + " --model " + kModel + " --format gguf --out " + (dir_ / "x.gguf"),
          dir_);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("decay every 3 in [0.9, 0.99]"), std::string::npos) << r.out;
  EXPECT_EQ(kvpop::load_scorers(dir_ / "x.gguf", Qwen3Config::load(kModel + "/config.json")).scorers.decay(),
            (kvpop::Decay{3, 0.9, 0.99}));
  // Other betas, same everything else: another trajectory.
  r = train(plain, 4, "--save-every 2 --decay-every 3 --decay-min 0.9 --decay-max 0.99");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_GT(rel_diff(formats::SafetensorsFile::open(plain + "/gates.safetensors").tensor(
                         "model.layers.0.self_attn.kvpop.q_proj.weight"),
                     end.tensor("model.layers.0.self_attn.kvpop.q_proj.weight")),
            1e-4);
}

}  // namespace
}  // namespace retain::trainer::test
