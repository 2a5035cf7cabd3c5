// retain-generate, retain-eval and retain-plot as a user runs them: outputs, --json and
// metrics.json contents, PNG files, exit codes, one-line errors, no file left by a failure.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "kernels/base/atomic_file.h"

using namespace retain;
namespace fs = std::filesystem;

namespace {

struct Result {
  int code;
  std::string out, err;
};

fs::path root() {
  static const fs::path r = fs::path(::testing::TempDir()) / ("retain_infer_tools." + std::to_string(::getpid()));
  return r;
}

Result run(const std::string& args) {
  fs::create_directories(root());
  const std::string out = (root() / "stdout").string(), err = (root() / "stderr").string();
  const std::string cmd = std::string(RETAIN_BIN_DIR) + "/" + args + " >" + out + " 2>" + err;
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_file(out), read_file(err)};
}

int lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

bool is_png(const fs::path& p) {
  if (!fs::exists(p)) return false;
  const std::string s = read_file(p.string());
  return s.size() > 1000 && s.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0;
}

class InferTools : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    fs::remove_all(root());
    fs::create_directories(root());
    ASSERT_EQ(run("retain-make-tiny --out " + tiny() + " --gates trimkv --seed 4").code, 0);
    ASSERT_EQ(run("retain-make-tiny --out " + other() + " --layers 3 --gates trimkv --seed 5").code, 0);
  }
  static void TearDownTestSuite() { fs::remove_all(root()); }
  static std::string tiny() { return (root() / "tiny").string(); }
  static std::string other() { return (root() / "other").string(); }
  static std::string gates() { return tiny() + "/gates.safetensors"; }

  // Fails with one stderr line containing `needle`, exit `code`, and leaves `file` absent.
  static void expect_error(const std::string& args, const std::string& needle, int code, const fs::path& file) {
    fs::remove(file);
    const Result r = run(args);
    EXPECT_EQ(r.code, code) << args << "\n" << r.err;
    EXPECT_EQ(lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(file)) << file;
  }
};

}  // namespace

TEST_F(InferTools, HelpEverywhere) {
  for (const char* t : {"retain-generate --help", "retain-eval --help", "retain-plot --help", "retain-plot losses --help",
                        "retain-plot retention --help", "retain-plot eval --help"}) {
    const Result r = run(t);
    EXPECT_EQ(r.code, 0) << t;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << t;
  }
}

TEST_F(InferTools, GenerateJson) {
  const fs::path js = root() / "gen.json";
  const Result r = run("retain-generate --model " + tiny() + " --gates " + gates() +
                       " --policy trimkv --budget 8 --prompt \"Hello, bounded cache.\" --max-new 12 --greedy --ignore-eos --json " +
                       js.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("tokens/s"), std::string::npos);
  EXPECT_NE(r.err.find("cache: "), std::string::npos);
  const nlohmann::json j = nlohmann::json::parse(read_file(js.string()));
  EXPECT_EQ(j["prompt_ids"].size(), 21u);  // byte-level tokenizer: one id per byte
  EXPECT_EQ(j["generated_ids"].size(), 12u);
  ASSERT_EQ(j["kept_positions"].size(), 2u);
  for (size_t l = 0; l < 2; ++l) {
    size_t n = 0;
    for (const auto& head : j["kept_positions"][l]) {
      const auto pos = head.get<std::vector<int>>();
      EXPECT_TRUE(std::is_sorted(pos.begin(), pos.end()));
      EXPECT_LE(pos.size(), 8u);
      for (int p : pos) EXPECT_TRUE(p >= 0 && p < 21 + 11);  // the last token is not fed back
      n += pos.size();
    }
    EXPECT_EQ(j["cache_sizes"][l].get<size_t>(), n);
  }
  // Same seed, same sampled tokens; another seed, others.
  const Result a = run("retain-generate --model " + tiny() + " --policy window --budget 8 --prompt-ids \"5 6 7 8\" --max-new 16 --seed 3 --ignore-eos");
  const Result b = run("retain-generate --model " + tiny() + " --policy window --budget 8 --prompt-ids \"5 6 7 8\" --max-new 16 --seed 3 --ignore-eos");
  const Result c = run("retain-generate --model " + tiny() + " --policy window --budget 8 --prompt-ids \"5 6 7 8\" --max-new 16 --seed 4 --ignore-eos");
  EXPECT_EQ(a.out, b.out);
  EXPECT_NE(a.out, c.out);
}

TEST_F(InferTools, GenerateErrors) {
  const fs::path js = root() / "bad.json";
  const std::string base = "retain-generate --model " + tiny() + " --prompt-ids \"1 2 3\" --json " + js.string();
  expect_error(base + " --policy kvpop --budget 64", "ranks tokens by KVPOP scorers: give --gates", 2, js);
  expect_error(base + " --policy oracle-m --budget 64 --gates " + gates(), "generation does not know", 2, js);
  // What no file can fix is a usage error (2); what the files or this build decide is 1.
  expect_error(base + " --policy trimkv --budget 8", "--gates", 2, js);
  expect_error(base + " --policy window --budget 4", "below the minimum 5", 2, js);
  expect_error(base + " --policy h2o --budget 1", "below the minimum 2", 2, js);
  expect_error(base + " --policy lru --budget 8", "unknown policy 'lru'", 2, js);
  expect_error(base + " --policy window --budget 8 --buffer 0", "--buffer must be at least 1", 2, js);
  expect_error(base + " --policy trimkv --budget 8 --lookahead=-1", "--lookahead must be >= 0, got -1", 2, js);
  expect_error(base + " --policy window --budget 8 --lookahead 3", "--lookahead is for --policy trimkv or dbtrimkv", 2, js);
  expect_error("retain-generate --model " + tiny() + " --prompt-ids \"1 2 3\" --policy full --json " +
                   (root() / "missing" / "x.json").string(),
               "does not exist", 1, root() / "missing" / "x.json");
  expect_error(base + " --policy trimkv --budget 8 --gates " + other() + "/gates.safetensors", "gates.safetensors", 1, js);
  expect_error(base + " --policy trimkv", "needs --budget", 2, js);
  expect_error("retain-generate --model " + tiny() + " --policy full --json " + js.string(), "exactly one of", 2, js);
  expect_error(base + " --policy full --prompt x", "exactly one of", 2, js);
  expect_error("retain-generate --model " + tiny() + " --policy full --prompt-ids \"1 999\"", "outside the vocabulary", 1, js);
}

TEST_F(InferTools, EvalRecallMetricsAndPlot) {
  const fs::path m = root() / "metrics.json", png = root() / "quality.png", task = root() / "task.jsonl";
  const Result r = run("retain-eval --model " + tiny() + " --gates " + gates() +
                       " --task recall --policy full,window,trimkv,dbtrimkv,h2o --budget 8,16 --samples 2 --context 48 --pairs 3 --out " +
                       m.string() + " --plot " + png.string() + " --dump-task " + task.string());
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(read_file(m.string()));
  ASSERT_EQ(j["results"].size(), 9u);  // full once + 4 policies x 2 budgets
  EXPECT_TRUE(j["results"][0]["budget"].is_null());
  for (const auto& e : j["results"]) {
    for (const char* k : {"policy", "budget", "nll", "accuracy", "perplexity", "tokens"}) EXPECT_TRUE(e.contains(k)) << k;
    EXPECT_EQ(e["tokens"].get<int>(), 4);  // 2 samples x 2 answer tokens
  }
  EXPECT_TRUE(is_png(png));
  // The dumped task is retain-pack input: one JSON object per sample, the answer as the target.
  std::ifstream f(task);
  std::string line;
  int n = 0;
  while (std::getline(f, line)) {
    const nlohmann::json s = nlohmann::json::parse(line);
    EXPECT_EQ(s["input_ids"].size(), 48u + 4u + 2u);
    EXPECT_EQ(s["target_mask"].back().get<int>(), 1);
    ++n;
  }
  EXPECT_EQ(n, 2);
  EXPECT_EQ(j["task"]["content_ids"][1].get<int>(), 256) << "the tiny model's <|endoftext|> = 256 ends the content ids";
  // --queries 3: every query's value is a target; no id is a special token.
  const fs::path task3 = root() / "task3.jsonl";
  const fs::path no_metrics = root() / "not-written.json";
  ASSERT_EQ(run("retain-eval --model " + tiny() + " --task recall --samples 2 --context 48 --pairs 3 --queries 3 --out " +
                no_metrics.string() + " --dump-task " + task3.string()).code, 0);
  EXPECT_FALSE(fs::exists(no_metrics)) << "without --policy only the task is written";
  std::ifstream f3(task3);
  while (std::getline(f3, line)) {
    const nlohmann::json s = nlohmann::json::parse(line);
    EXPECT_EQ(s["input_ids"].size(), 48u + 2 * 6 + 4u + 2u);
    int targets = 0;
    for (const auto& t : s["target_mask"]) targets += t.get<int>();
    EXPECT_EQ(targets, 6);
    for (const auto& id : s["input_ids"]) EXPECT_LT(id.get<int>(), 256);
  }
  // Per-policy gates: trimkv=FILE gives what --gates FILE gave; window needs none.
  const fs::path m2 = root() / "per_policy.json";
  ASSERT_EQ(run("retain-eval --model " + tiny() + " --gates trimkv=" + gates() +
                " --task recall --policy full,window,trimkv --budget 8,16 --samples 2 --context 48 --pairs 3 --out " + m2.string()).code, 0);
  const nlohmann::json j2 = nlohmann::json::parse(read_file(m2.string()));
  EXPECT_EQ(j2["gates"]["trimkv"].get<std::string>(), gates());
  for (const auto& e : j2["results"])
    for (const auto& e1 : j["results"])
      if (e1["policy"] == e["policy"] && e1["budget"] == e["budget"]) {
        EXPECT_EQ(e1["nll"], e["nll"]) << e.dump();
      }
  // Re-plot from the file.
  const fs::path png2 = root() / "replot.png";
  ASSERT_EQ(run("retain-plot eval --metrics " + m.string() + " --out " + png2.string()).code, 0);
  EXPECT_TRUE(is_png(png2));
}

// --lookahead reaches retain-eval's policies and its metrics: the recorded value, and a long
// lookahead scoring differently from the default on the same samples (the decisions differ;
// their brute-force check is Decoder.LookaheadKeptSetsMatchBruteForce).
TEST_F(InferTools, EvalLookahead) {
  auto eval = [&](const std::string& extra, const fs::path& m) {
    const Result r = run("retain-eval --model " + tiny() + " --gates " + gates() +
                         " --task recall --policy trimkv,dbtrimkv --budget 6 --samples 2 --context 48 --pairs 3 --out " +
                         m.string() + extra);
    EXPECT_EQ(r.code, 0) << r.err;
    return nlohmann::json::parse(read_file(m.string()));
  };
  const nlohmann::json a = eval("", root() / "la1.json"), b = eval(" --lookahead 100000", root() / "la2.json");
  EXPECT_FALSE(a.contains("lookahead"));
  EXPECT_EQ(b["lookahead"].get<int>(), 100000);
  ASSERT_EQ(a["results"].size(), b["results"].size());
  bool differ = false;
  for (size_t i = 0; i < a["results"].size(); ++i)
    differ = differ || a["results"][i]["nll"].get<double>() != b["results"][i]["nll"].get<double>();
  EXPECT_TRUE(differ) << "--lookahead 100000 scored the same as the default";
}

TEST_F(InferTools, EvalErrors) {
  const fs::path m = root() / "bad_metrics.json";
  const std::string base = "retain-eval --model " + tiny() + " --task recall --samples 1 --context 32 --pairs 2 --out " + m.string();
  expect_error(base + " --policy window --budget 8,4", "below the minimum 5", 2, m);
  expect_error(base + " --policy trimkv --budget 8", "--gates", 2, m);
  expect_error(base + " --policy full --plot " + (root() / "missing" / "q.png").string(), "does not exist", 1, m);
  expect_error(base + " --policy kvpop --budget 8", "ranks tokens by KVPOP scorers: give --gates", 2, m);
  // oracle-m takes window, sinks and decay from KVPOP scorers (its own file, kvpop's, or the common one).
  expect_error(base + " --policy oracle-m --budget 8", "oracle-m takes the window, sinks and decay of KVPOP scorers: give --gates", 2, m);
  expect_error(base + " --policy oracle-m --budget 8 --gates " + gates(), "holds retention gates", 2, m);
  expect_error(base + " --policy oracle-m --budget 8 --gates trimkv=" + gates(), "give --gates", 2, m);
  expect_error(base + " --policy window", "needs --budget", 2, m);
  expect_error(base + " --policy full --data x.h5", "exactly one of", 2, m);
  expect_error(base, "give --policy", 2, m);
  expect_error(base + " --policy dbtrimkv --budget 8 --gates trimkv=" + gates(), "--policy dbtrimkv ranks tokens", 2, m);
  expect_error(base + " --policy trimkv --budget 8 --gates " + gates() + " --gates " + gates(), "two files for every policy", 2, m);
  expect_error(base + " --policy trimkv --budget 8 --gates trimkv=", "no file after", 2, m);
  expect_error(base + " --policy trimkv --budget 8 --gates " + gates() + " --lookahead=-2", "--lookahead must be >= 0, got -2", 2, m);
  expect_error(base + " --policy window,h2o --budget 8 --lookahead 2", "--lookahead is for --policy trimkv or dbtrimkv", 2, m);
  expect_error("retain-eval --model " + tiny() + " --task recall --context 32 --pairs 20 --policy full --out " + m.string(),
               "do not fit", 1, m);
  expect_error("retain-eval --model " + tiny() + " --data " + (root() / "missing.h5").string() + " --policy full --out " + m.string(),
               "missing.h5", 1, m);
}

// oracle-m as a user runs it: with kvpop's scorer file it takes their window, sinks and decay.
TEST_F(InferTools, EvalOracle) {
  const fs::path m = root() / "oracle_metrics.json";
  const std::string fx = RETAIN_FIXTURES_DIR;
  const Result r = run("retain-eval --model " + fx + "/trainer/model --gates kvpop=" + fx +
                       "/kvpop/step/scorers.safetensors --task recall --samples 3 --context 40 --pairs 2 "
                       "--policy kvpop,oracle-m --budget 12,20 --out " + m.string());
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(read_file(m.string()));
  std::vector<std::string> got;
  for (const auto& e : j["results"]) got.push_back(e["policy"].get<std::string>() + "@" + e["budget"].dump());
  EXPECT_EQ(got, (std::vector<std::string>{"kvpop@12", "kvpop@20", "oracle-m@12", "oracle-m@20"}));
  for (const auto& e : j["results"]) EXPECT_LE(e["mean_cache_per_head"].get<double>(), e["budget"].get<double>() + 1);
  EXPECT_NE(r.out.find("oracle-m"), std::string::npos) << r.out;
  expect_error("retain-eval --model " + fx + "/trainer/model --gates kvpop=" + fx +
                   "/kvpop/step/scorers.safetensors --task recall --samples 1 --context 40 --pairs 2 --policy oracle-m "
                   "--budget 8 --out " + m.string(),
               "below the minimum 9 of policy oracle-m", 2, m);
}

TEST_F(InferTools, PlotLossesAndRetention) {
  const fs::path jl = root() / "metrics.jsonl", png = root() / "losses.png";
  std::string text;
  for (int s = 1; s <= 30; ++s)
    text += nlohmann::json({{"step", s}, {"loss", 1.0 / s}, {"kl", 0.5 / s}, {"ntp", 6.0 - 0.01 * s}, {"cap", 0.3 / (s * s)},
                            {"lr", 1e-3}}).dump() + "\n";
  write_file_atomic(jl.string(), text);
  ASSERT_EQ(run("retain-plot losses --metrics " + jl.string() + " --out " + png.string()).code, 0);
  EXPECT_TRUE(is_png(png));
  write_file_atomic(jl.string(), text + "{not json\n");
  expect_error("retain-plot losses --metrics " + jl.string() + " --out " + png.string(), "metrics.jsonl:31", 1, png);
  const fs::path rp = root() / "retention.png";
  const Result r = run("retain-plot retention --model " + tiny() + " --gates " + gates() +
                       " --text \"The cache keeps what matters.\" --budget 8 --heads 0:0,1:1 --out " + rp.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(is_png(rp));
  expect_error("retain-plot retention --model " + tiny() + " --gates " + gates() + " --ids \"1 2 3\" --heads 5:0 --out " + rp.string(),
               "--heads", 1, rp);
  expect_error("retain-plot frobnicate", "unknown command", 2, rp);
  expect_error("retain-plot losses --metrics " + jl.string() + " --out " + (root() / "missing" / "l.png").string(),
               "does not exist", 1, root() / "missing" / "l.png");
  expect_error("retain-plot retention --model " + tiny() + " --gates " + gates() + " --ids \"1 2 3\" --policies lru --out " +
                   rp.string(),
               "unknown policy", 2, rp);
}
