// retain-pack as a process: exit codes (0 ok, 1 bad input, 2 usage), one line on stderr naming
// file:line, and no output, temporary or spill file left behind on failure.
#include <sys/wait.h>

#include "tests/data/pack_helpers.h"

namespace retain::data::test {
namespace {

struct Result {
  int code = -1;
  std::string out, err;
};

class PackCliTest : public ::testing::Test {
 protected:
  void SetUp() override { tiny_tokenizer(dir_.path()); }

  Result run(const std::string& args) {
    const std::string cmd = std::string(RETAIN_BIN_DIR) + "/retain-pack " + args + " >" + (dir_ / ".stdout").string() +
                            " 2>" + (dir_ / ".stderr").string();
    Result r;
    const int status = std::system(cmd.c_str());
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    auto slurp = [](const fs::path& p) {
      std::ifstream in(p);
      return std::string(std::istreambuf_iterator<char>(in), {});
    };
    r.out = slurp(dir_ / ".stdout");
    r.err = slurp(dir_ / ".stderr");
    fs::remove(dir_ / ".stdout");
    fs::remove(dir_ / ".stderr");
    return r;
  }
  std::string base() const {
    return "--tokenizer " + dir_.path().string() + " --out " + (dir_ / "out.h5").string() + " ";
  }

  TempDir dir_;
};

size_t lines(const std::string& s) { return static_cast<size_t>(std::count(s.begin(), s.end(), '\n')); }

TEST_F(PackCliTest, PacksAndLeavesOnlyTheOutput) {
  write_text(dir_ / "a.jsonl", R"({"text": "hello"})" "\n");
  write_text(dir_ / "b.txt", "one\ntwo\n");
  const Result r = run(base() + "--seq-len 8 --packing bfd --txt-mode line -q " + (dir_ / "a.jsonl").string() +
                       " --input " + (dir_ / "b.txt").string());
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_NE(r.out.find("documents 3"), std::string::npos) << r.out;
  EXPECT_EQ(dir_.files(), (std::vector<std::string>{"a.jsonl", "b.txt", "out.h5", "tokenizer.json"}));
  EXPECT_EQ(PackedDataset::open(dir_ / "out.h5").packing(), "bfd");
  EXPECT_EQ(run("--help").code, 0);
}

TEST_F(PackCliTest, BadInputExitsOneWithOneLineNamingFileAndLine) {
  write_text(dir_ / "bad.jsonl", R"({"text": "fine"})" "\n" R"({"text": 5})" "\n");
  Result r = run(base() + "--seq-len 8 " + (dir_ / "bad.jsonl").string());
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(lines(r.err), 1u) << r.err;
  EXPECT_NE(r.err.find("retain-pack: error: " + (dir_ / "bad.jsonl").string() + ":2: \"text\" is not a string"),
            std::string::npos)
      << r.err;
  write_text(dir_ / "bad.jsonl", R"({"input_ids": [1, 70000]})" "\n");
  r = run(base() + "--seq-len 8 " + (dir_ / "bad.jsonl").string());
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(lines(r.err), 1u) << r.err;
  EXPECT_NE(r.err.find("bad.jsonl:1: input_ids[1] = 70000 is outside the vocabulary [0, 259)"), std::string::npos)
      << r.err;
  EXPECT_EQ(dir_.files(), (std::vector<std::string>{"bad.jsonl", "tokenizer.json"}));
}

TEST_F(PackCliTest, UsageErrorsExitTwo) {
  write_text(dir_ / "a.jsonl", R"({"text": "hello"})" "\n");
  std::string in(1, ' ');
  in += (dir_ / "a.jsonl").string();
  for (const std::string& args : {base() + "--seq-len 1" + in, base() + "--seq-len 8 --packing greedy" + in,
                                  base() + "--seq-len 8", "--out x.h5 --seq-len 8" + in,
                                  base() + "--seq-len 8 --threads 0" + in, base() + "--seq-len 8 --targets some" + in}) {
    const Result r = run(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.err;
    EXPECT_EQ(lines(r.err), 1u) << r.err;
  }
  EXPECT_EQ(dir_.files(), (std::vector<std::string>{"a.jsonl", "tokenizer.json"}));
}

TEST_F(PackCliTest, MissingTokenizerOrInputNamesThePath) {
  write_text(dir_ / "a.jsonl", R"({"text": "hello"})" "\n");
  Result r = run("--tokenizer " + (dir_ / "nowhere").string() + " --out " + (dir_ / "out.h5").string() +
                 " --seq-len 8 " + (dir_ / "a.jsonl").string());
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(lines(r.err), 1u) << r.err;
  EXPECT_NE(r.err.find("nowhere"), std::string::npos) << r.err;
  r = run(base() + "--seq-len 8 " + (dir_ / "missing.jsonl").string());
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("missing.jsonl: cannot open"), std::string::npos) << r.err;
    EXPECT_EQ(dir_.files(), (std::vector<std::string>{"a.jsonl", "tokenizer.json"}));
}

TEST_F(PackCliTest, InterruptedRunLeavesNothing) {
  // A corpus big enough to take a while, then SIGINT: exit 1, no output, no temporaries.
  std::string big;
  for (int i = 0; i < 200000; ++i) big += R"({"text": "a line of text that takes some time to tokenize )" + std::to_string(i) + "\"}\n";
  write_text(dir_ / "big.jsonl", big);
  const std::string cmd = std::string(RETAIN_BIN_DIR) + "/retain-pack " + base() + "--seq-len 64 -q " +
                          (dir_ / "big.jsonl").string() + " >/dev/null 2>" + (dir_ / "err.txt").string() +
                          " & pid=$!; sleep 0.3; kill -INT $pid; wait $pid";
  const int status = std::system(("bash -c '" + cmd + "'").c_str());
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(dir_ / "err.txt");
  const std::string err((std::istreambuf_iterator<char>(in)), {});
  if (code == 0) GTEST_SKIP() << "finished before the signal";
  EXPECT_EQ(code, 1) << err;
  EXPECT_NE(err.find("interrupted"), std::string::npos) << err;
  fs::remove(dir_ / "err.txt");
  EXPECT_EQ(dir_.files(), (std::vector<std::string>{"big.jsonl", "tokenizer.json"}));
}

}  // namespace
}  // namespace retain::data::test
