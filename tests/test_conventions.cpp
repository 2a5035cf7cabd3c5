// The conventions every tool follows (README, "Conventions"), as a new user meets them: usage
// errors exit 2 and everything else that fails exits 1, each with one line; outputs need an
// existing parent folder and are never left half-made; --help shows defaults as typed;
// nonsense options are refused; and the README's claims hold for this build.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>

#include "kernels/base/atomic_file.h"
#include "tests/trainer/train_helpers.h"

namespace retain {
namespace {

namespace fs = std::filesystem;
using trainer::test::bin;
using trainer::test::Result;
using trainer::test::run;
using trainer::test::TempDir;

const std::string kRepo = fs::path(RETAIN_FIXTURES_DIR).parent_path().parent_path().string();

int lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

void expect_error(const Result& r, int code, const std::string& needle, const std::string& what) {
  EXPECT_EQ(r.code, code) << what << "\n" << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << what << "\n" << r.err;
  EXPECT_EQ(lines(r.err), 1) << what << "\n" << r.err;
}

// Nothing but the names in `keep` under `dir` (no half-made outputs, no temporaries).
void expect_only(const TempDir& dir, const std::set<std::string>& keep) {
  for (const auto& e : fs::directory_iterator(dir.path())) {
    const std::string n = e.path().filename().string();
    if (n.rfind(".out", 0) == 0 || n.rfind(".err", 0) == 0) continue;  // run()'s captures
    EXPECT_TRUE(keep.count(n)) << "left behind: " << e.path();
  }
}

TEST(Conventions, TrainRefusesNonsenseAsUsageErrors) {
  TempDir dir;
  const std::string base = bin("retain-train") + " --model " + trainer::test::kModel + " --data x.h5 --out " +
                           (dir / "run") + " ";
  expect_error(run(base + "--steps 0", dir), 2, "--steps must be ≥ 1", "--steps 0");
  expect_error(run(base + "--lr 1e-4 --min-lr 1e-3", dir), 2, "--min-lr 0.001 exceeds --lr 0.0001", "--min-lr > --lr");
  expect_error(run(base + "--kl-weight 0 --ntp-weight 0 --cap-weight 0", dir), 2, "nothing to train", "all weights 0");
  expect_error(run(base + "--kl-weight -1", dir), 2, "--kl-weight must be a finite number ≥ 0", "negative weight");
  expect_error(run(base + "--save-every 0", dir), 2, "--save-every and --log-every must be ≥ 1", "--save-every 0");
  expect_only(dir, {});
}

// The same kind of mistake gets the same exit status in every tool.
TEST(Conventions, MalformedValuesExit2InEveryTool) {
  TempDir dir;
  ASSERT_EQ(run(bin("retain-make-tiny") + " --out " + (dir / "m"), dir).code, 0);
  const std::string m = dir / "m";
  const std::pair<std::string, std::string> cases[] = {
      {"retain-make-tiny --out " + (dir / "x") + " --gates foo", "unknown gate kind 'foo'"},
      {"retain-make-tiny --out " + (dir / "x") + " --layers 0", "--layers must be positive"},
      {"retain-make-tiny --out " + (dir / "x") + " --heads 4 --kv-heads 3", "--heads 4 must be a multiple of --kv-heads 3"},
      {"retain-forward --model " + m + " --ids '1 x' --out " + (dir / "o"), "--ids: 'x' is not an integer"},
      {"retain-forward --model " + m + " --ids '' --out " + (dir / "o"), "--ids: no token ids given"},
      {"retain-forward --model " + m + " --ids '1 2' --doc-ids '0' --out " + (dir / "o"), "--doc-ids: 1 ids given"},
      {"retain-forward --model " + m + " --ids '1' --gates " + m + "/x --gate-kind foo --out " + (dir / "o"),
       "unknown gate kind 'foo'"},
      {"retain-tokenize --tokenizer " + m + " --decode 'x'", "--decode: 'x' is not an integer"},
      {"retain-pack --tokenizer " + m + " --seq-len 0 --out " + (dir / "p.h5") + " x.jsonl", "--seq-len"},
      {"retain-bench attention --device cpu --seq 0", "--seq: '0'"},
      {"retain-export --from x --format onnx --out " + (dir / "e"), "--format must be"},
      {"retain-train --model " + m + " --data x.h5 --out " + (dir / "r") + " --gate foo", "--gate"},
      {"retain-train --model " + m + " --data x.h5 --out " + (dir / "r") + " --device tpu", "--device: unknown device 'tpu'"},
      {"retain-forward --model " + m + " --ids '1' --device tpu --out " + (dir / "o"), "--device must be cpu or cuda"},
      {"retain-generate --model " + m + " --policy lru --budget 8 --prompt-ids '1 2'", "lru"},
      {"retain-eval --model " + m + " --task recall --policy full --budget x", "--budget"},
  };
  for (const auto& [cmd, needle] : cases) expect_error(run(bin(cmd), dir), 2, needle, cmd);
  expect_only(dir, {"m"});
}

TEST(Conventions, HelpShowsDefaultsAsTyped) {
  TempDir dir;
  const Result r = run(bin("retain-train") + " --help", dir);
  ASSERT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("--lr arg (=2e-4)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--weight-decay arg (=1e-6)"), std::string::npos) << r.out;
  for (const char* tool : {"retain-train", "retain-forward", "retain-make-tiny", "retain-pack", "retain-tokenize",
                           "retain-export", "retain-bench attention", "retain-generate", "retain-eval",
                           "retain-plot retention"}) {
    const Result h = run(bin(tool) + " --help", dir);
    EXPECT_EQ(h.code, 0) << tool;
    EXPECT_EQ(h.out.find("0000000"), std::string::npos) << tool << " prints a float default in full:\n" << h.out;
  }
}

// A bad --init-gates, or a run directory whose parent is missing: one line, exit 1, and no run
// folder (no config.json, no empty metrics.jsonl) left behind.
TEST(Conventions, TrainLeavesNothingWhenItCannotStart) {
  TempDir dir;
  const std::string data = trainer::test::pack_fixture_corpus(dir);
  const std::string base = bin("retain-train") + " --model " + trainer::test::kModel + " --data " + data +
                           " --steps 2 --global-batch 2 ";
  expect_error(run(base + "--out " + (dir / "run") + " --gate dbtrimkv --init-gates " + kRepo +
                       "/tests/fixtures/gates/dbtrimkv_mha_f16/gates.safetensors",
                   dir),
               1, "has shape", "gates of another model");
  expect_error(run(base + "--out " + (dir / "missing/run"), dir), 1, "does not exist", "missing parent");
  expect_only(dir, {"data.h5"});
  // A good run then makes the folder with its files.
  const Result ok = run(base + "--out " + (dir / "run"), dir);
  ASSERT_EQ(ok.code, 0) << ok.err;
  for (const char* f : {"config.json", "metrics.jsonl", "gates.safetensors"}) EXPECT_TRUE(fs::exists(dir / ("run/" + std::string(f)))) << f;
  // The gates name their base model by identity: an absolute directory, and its config's hash.
  const std::string gates = read_file(dir / "run/gates.safetensors");
  EXPECT_NE(gates.find("\"base_model\":\"" + fs::absolute(trainer::test::kModel).lexically_normal().string() + "\""),
            std::string::npos);
  EXPECT_NE(gates.find("\"base_config_sha256\":\""), std::string::npos);
  // Log lines read the same in a file as on a terminal: no colour codes.
  EXPECT_EQ(ok.out.find('\x1b'), std::string::npos) << ok.out;
  EXPECT_NE(ok.out.find("1 rank × 2 micro-batches of 1"), std::string::npos) << ok.out;
}

// A run's options as a TOML file: every run writes RUN/config.toml; --config reads it back (the
// command line wins), and the same options give the same gates.
TEST(Conventions, TrainConfigFileRepeatsARun) {
  TempDir dir;
  const std::string data = trainer::test::pack_fixture_corpus(dir);
  const Result a = run(bin("retain-train") + " --model " + trainer::test::kModel + " --data " + data + " --out " +
                           (dir / "a") + " --steps 2 --global-batch 2 --lr 3e-3 --gate dbtrimkv --gate-hidden 8",
                       dir);
  ASSERT_EQ(a.code, 0) << a.err;
  const std::string toml = read_file(dir / "a/config.toml");
  EXPECT_NE(toml.find("\nlr = 0.003\n"), std::string::npos) << toml;
  EXPECT_NE(toml.find("\ngate = \"dbtrimkv\"\n"), std::string::npos) << toml;
  const Result b = run(bin("retain-train") + " --config " + (dir / "a/config.toml") + " --out " + (dir / "b"), dir);
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_TRUE(read_file(dir / "a/gates.safetensors") == read_file(dir / "b/gates.safetensors"));
  // The command line wins over the file.
  const Result c = run(bin("retain-train") + " --config " + (dir / "a/config.toml") + " --out " + (dir / "c") +
                           " --lr 1e-3",
                       dir);
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_NE(read_file(dir / "c/config.json").find("\"lr\": 0.001"), std::string::npos);
  // Mistakes in the file name the file, the line and the key.
  write_file_atomic(dir / "bad.toml", "lr = 0.01\n[optimizer]\nmomentum = 0.9\n");
  expect_error(run(bin("retain-train") + " --config " + (dir / "bad.toml") + " --model m --data d --out " + (dir / "x"), dir),
               1, "bad.toml:3: 'momentum' is not a retain-train option", "unknown key");
  write_file_atomic(dir / "bad2.toml", "steps = \n");
  expect_error(run(bin("retain-train") + " --config " + (dir / "bad2.toml") + " --model m --data d --out " + (dir / "x"), dir),
               1, "bad2.toml:1:", "syntax error");
  write_file_atomic(dir / "bad3.toml", "resume = 1\n");
  expect_error(run(bin("retain-train") + " --config " + (dir / "bad3.toml") + " --model m --data d --out " + (dir / "x"), dir),
               1, "'resume' takes true or false", "switch");
}

TEST(Conventions, MakeTinyRefusesNonsenseAndLeavesNothing) {
  TempDir dir;
  expect_error(run(bin("retain-make-tiny") + " --out " + (dir / "m") + " --yarn-factor 0.5", dir), 2,
               "--yarn-factor must be 0 (no YaRN) or > 1", "--yarn-factor 0.5");
  expect_error(run(bin("retain-make-tiny") + " --out " + (dir / "m") + " --hidden 65536 --intermediate 65536 --layers 8", dir),
               1, "retain-make-tiny makes test models of at most 1 GiB (--max-gib raises it)", "size guard");
  expect_error(run(bin("retain-make-tiny") + " --out " + (dir / "m") + " --hidden 65536 --intermediate 65536 --layers 8"
                   " --max-gib 2.5", dir),
               1, "(192.4 GiB of BF16); retain-make-tiny makes test models of at most 2.5 GiB", "raised guard");
  expect_error(run(bin("retain-make-tiny") + " --out " + (dir / "m") + " --max-gib 0", dir), 2,
               "--max-gib must be > 0", "--max-gib 0");
  expect_error(run(bin("retain-make-tiny") + " --out " + (dir / "no/m"), dir), 1, "does not exist", "missing parent");
  expect_only(dir, {});
  ASSERT_EQ(run(bin("retain-make-tiny") + " --out " + (dir / "m"), dir).code, 0);
  expect_only(dir, {"m"});
}

TEST(Conventions, TokenizeIsStrictAboutItsInput) {
  TempDir dir;
  ASSERT_EQ(run(bin("retain-make-tiny") + " --out " + (dir / "m"), dir).code, 0);
  write_file_atomic(dir / "bad.txt", std::string("ok \xff\xfe"));
  const std::string tok = bin("retain-tokenize") + " --tokenizer " + (dir / "m");
  expect_error(run(tok + " < " + (dir / "bad.txt"), dir), 1, "stdin: invalid UTF-8 at byte 3 (0xff)", "bad stdin");
  EXPECT_EQ(run(tok + " --lossy < " + (dir / "bad.txt"), dir).code, 0);
  const Result ids = run(tok + " --text Hi", dir);
  ASSERT_EQ(ids.code, 0) << ids.err;
  const Result d = run(tok + " --decode \"" + ids.out.substr(0, ids.out.size() - 1) + "\"", dir);
  EXPECT_EQ(d.out, "Hi\n");  // a line, like every other output
  expect_error(run(bin("retain-tokenize") + " --tokenizer " + (dir / "m/config.json") + " --text hi", dir), 1,
               "is a model config.json, not a tokenizer.json", "config.json as tokenizer");
}

TEST(Conventions, OutputsAreCheckedBeforeTheWork) {
  TempDir dir;
  expect_error(run(bin("retain-bench") + " attention --device cpu --json " + (dir / "no/x.json"), dir), 1,
               "does not exist", "--json into a missing folder");
  // retain-forward checks its --out before running the model.
  ASSERT_EQ(run(bin("retain-make-tiny") + " --out " + (dir / "m"), dir).code, 0);
  expect_error(run(bin("retain-forward") + " --model " + (dir / "m") + " --ids '1 2' --out " + (dir / "no/x.st"), dir),
               1, "--out " + (dir / "no/x.st") + ": the folder", "--out into a missing folder");
}

// The README's tool table names exactly the tools this build makes, none "planned" that exists,
// and the quickstart comment states the step count launch/quickstart.sh runs.
TEST(Conventions, ReadmeMatchesTheBuild) {
  const std::string readme = read_file(kRepo + "/README.md");
  std::set<std::string> listed, built;
  const std::regex row(R"(\n\| `(retain-[a-z-]+)` \| ([^|]*) \|)");
  for (auto it = std::sregex_iterator(readme.begin(), readme.end(), row); it != std::sregex_iterator(); ++it) {
    listed.insert((*it)[1]);
    EXPECT_EQ((*it)[2].str().find("planned"), std::string::npos) << (*it)[1] << " is built but the README says planned";
  }
  for (const auto& e : fs::directory_iterator(RETAIN_BIN_DIR)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("retain-", 0) == 0) built.insert(n);
  }
  EXPECT_EQ(listed, built) << "README tool table vs " << RETAIN_BIN_DIR;
  const std::string quickstart = read_file(kRepo + "/launch/quickstart.sh");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(quickstart, m, std::regex(R"(--steps ([0-9]+))")));
  EXPECT_NE(readme.find("for " + m[1].str() + " steps"), std::string::npos)
      << "the README's quickstart line should say " << m[1] << " steps";
}

}  // namespace
}  // namespace retain
