// The command-line tools as a user runs them: real processes, exit codes, one-line
// errors on stderr, and no output file left behind when the input is bad.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "kernels/base/atomic_file.h"
#include "model/gates/gates.h"
#include "model/qwen3.h"
#include "data/formats/safetensors.h"
#include "model/weights.h"

using namespace retain;
namespace fs = std::filesystem;

namespace {

struct Result {
  int code;
  std::string out, err;
};

// CTest runs each test as its own process, in parallel: every process gets its own dirs.
fs::path scratch(const char* name) {
  return fs::path(::testing::TempDir()) / (std::string(name) + "." + std::to_string(::getpid()));
}

Result run(const std::string& args) {
  const fs::path dir = scratch("retain_tools_io");
  fs::create_directories(dir);
  const std::string out = (dir / "stdout").string(), err = (dir / "stderr").string();
  const std::string cmd = std::string(RETAIN_BIN_DIR) + "/" + args + " >" + out + " 2>" + err;
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_file(out), read_file(err)};
}

int lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

class Tools : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = scratch("retain_tools");
    fs::remove_all(root_);
    fs::create_directories(root_);
    const Result r = run("retain-make-tiny --out " + tiny().string() + " --seed 7");
    ASSERT_EQ(r.code, 0) << r.err;
  }
  static void TearDownTestSuite() {
    fs::remove_all(root_);
    fs::remove_all(scratch("retain_tools_io"));
  }
  static fs::path tiny() { return root_ / "tiny"; }

  // A copy of the tiny model whose config.json is edited by `edit`.
  static fs::path edited_copy(const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
    const fs::path dir = root_ / name;
    fs::remove_all(dir);
    fs::copy(tiny(), dir);
    nlohmann::json cfg = nlohmann::json::parse(read_file((dir / "config.json").string()));
    edit(cfg);
    write_file_atomic((dir / "config.json").string(), cfg.dump());
    return dir;
  }

  // Runs retain-forward expecting failure: non-zero exit, one stderr line containing
  // `needle`, and no output file.
  static void expect_forward_error(const std::string& args, const std::string& needle) {
    const fs::path out = root_ / "bad.safetensors";
    fs::remove(out);
    const Result r = run("retain-forward --out " + out.string() + " " + args);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_EQ(lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << "wanted '" << needle << "' in: " << r.err;
    EXPECT_FALSE(fs::exists(out)) << args;
    for (const auto& e : fs::directory_iterator(root_))
      EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << "temporary left: " << e.path();
  }

  static fs::path root_;
};
fs::path Tools::root_;

}  // namespace

TEST_F(Tools, HelpPrintsUsage) {
  for (const char* tool : {"retain-forward", "retain-make-tiny"}) {
    const Result r = run(std::string(tool) + " --help");
    EXPECT_EQ(r.code, 0);
    EXPECT_NE(r.out.find("Usage: "), std::string::npos) << r.out;
  }
}

TEST_F(Tools, ForwardWritesTheLibraryLogits) {
  const fs::path out = root_ / "logits.safetensors";
  // --device cpu: the CPU library's logits, bit for bit (a GPU, when present, is the default).
  const Result r = run("retain-forward --device cpu --model " + tiny().string() +
                       " --ids \"5 10 7 256 3,4\" --doc-ids \"0 0 0 1 1 1\" --out " + out.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("wrote logits [6, 512]"), std::string::npos) << r.out;
  const formats::SafetensorsFile f = formats::SafetensorsFile::open(out.string());
  const Tensor logits = f.tensor("logits");
  ASSERT_EQ(logits.shape(), (Shape{6, 512}));
  ASSERT_EQ(logits.dtype(), DType::F32);

  auto ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(tiny().string()));
  LocalWeightProvider w(ckpt);
  const Tensor want = qwen3_forward(w, Tensor::from_vector<int32_t>({5, 10, 7, 256, 3, 4}, {6}),
                                    Tensor::from_vector<int32_t>({0, 0, 0, 1, 1, 1}, {6}));
  for (int64_t i = 0; i < want.numel(); ++i) ASSERT_EQ(logits.data<float>()[i], want.data<float>()[i]);
}

TEST_F(Tools, ForwardRejectsBadArguments) {
  const std::string m = "--model " + tiny().string();
  expect_forward_error("--ids \"1 2\"", "model");  // missing --model: usage error
  expect_forward_error(m + " --ids \"1 512\"", "token id 512 at position 1");
  expect_forward_error(m + " --ids \"1 -3\"", "token id -3");
  expect_forward_error(m + " --ids \"  \"", "no token ids");
  expect_forward_error(m + " --ids \"1 x2\"", "'x2' is not an integer");
  expect_forward_error(m + " --ids \"1 2 3\" --doc-ids \"0 0\"", "2 ids given for 3 tokens");
  expect_forward_error(m + " --ids \"1 2 3\" --doc-ids \"0 1 0\"", "not contiguous");
  expect_forward_error(m + " --ids \"1 2\" --device tpu", "--device");
  if (cuda_device_count() == 0) {  // where a GPU is visible, --device cuda runs
    expect_forward_error(m + " --ids \"1 2\" --device cuda", "--device cuda: ");
    const Result r = run("retain-train --model " + tiny().string() + " --data x.h5 --out " + (root_ / "run").string() +
                         " --device cuda");
    EXPECT_EQ(r.code, 1) << r.err;
    EXPECT_EQ(lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(cuda_built() ? "--device cuda: no CUDA device is visible" : "has no CUDA support"),
              std::string::npos)
        << r.err;
    EXPECT_FALSE(fs::exists(root_ / "run"));
  }
  expect_forward_error("--model " + (root_ / "nope").string() + " --ids \"1\"", "not a model directory");
}

TEST_F(Tools, ForwardRejectsBadCheckpoints) {
  // Truncated weights.
  const fs::path trunc = edited_copy("trunc", [](nlohmann::json&) {});
  fs::resize_file(trunc / "model.safetensors", fs::file_size(trunc / "model.safetensors") - 10);
  expect_forward_error("--model " + trunc.string() + " --ids \"1\"", "model.safetensors");
  // Config and weights disagree.
  expect_forward_error("--model " + edited_copy("vocab", [](auto& c) { c["vocab_size"] = 600; }).string() + " --ids \"1\"",
                       "has shape [512, 64], config.json implies [600, 64]");
  expect_forward_error("--model " + edited_copy("deeper", [](auto& c) { c["num_hidden_layers"] = 3; }).string() +
                           " --ids \"1\"",
                       "missing tensor 'model.layers.2.");
  expect_forward_error("--model " + edited_copy("shallower", [](auto& c) { c["num_hidden_layers"] = 1; }).string() +
                           " --ids \"1\"",
                       "unexpected tensor 'model.layers.1.");
  expect_forward_error("--model " + edited_copy("untied", [](auto& c) { c["tie_word_embeddings"] = false; }).string() +
                           " --ids \"1\"",
                       "missing tensor 'lm_head.weight'");
  expect_forward_error("--model " + edited_copy("llama", [](auto& c) { c["model_type"] = "llama"; }).string() +
                           " --ids \"1\"",
                       "model_type 'llama' is not supported");
  // Missing config.json.
  const fs::path nocfg = edited_copy("nocfg", [](nlohmann::json&) {});
  fs::remove(nocfg / "config.json");
  expect_forward_error("--model " + nocfg.string() + " --ids \"1\"", "missing config.json");
  // Unwritable output: nothing is created.
  const Result r = run("retain-forward --model " + tiny().string() + " --ids 1 --out " + (root_ / "no/such/dir/x.st").string());
  EXPECT_NE(r.code, 0);
  EXPECT_EQ(lines(r.err), 1) << r.err;
}

TEST_F(Tools, MakeTinyValidatesOptions) {
  for (const auto& [args, needle] : std::vector<std::pair<std::string, std::string>>{
           {"--vocab 100", "too small"},
           {"--heads 3 --kv-heads 2", "multiple"},
           {"--head-dim 7", "even"},
           {"--tie --no-tie", "exclusive"},
           {"--layers 0", "positive"},
           {"--gates lstm", "--gates: unknown gate kind 'lstm'"},
           {"--gates dbtrimkv --gate-hidden 0", "--gate-hidden must be positive (or 0, a linear trimkv gate)"},
           {"--gates trimkv --gate-hidden -2", "--gate-hidden must be positive"},
           {"--gates trimkv --gate-input keys", "--gate-input: unknown gate input 'keys'"},
           {"--gate-input kv", "need --gates"},
           {"--bias-init 3", "need --gates"},
           {"--gates trimkv --bias-init nan", "--bias-init must be a finite number, got nan"},
           {"--yarn-factor inf", "--yarn-factor must be a finite number, got inf"}}) {
    const fs::path out = root_ / "badtiny";
    const Result r = run("retain-make-tiny --out " + out.string() + " " + args);
    EXPECT_EQ(r.code, 2) << args << ": a command-line mistake";
    EXPECT_EQ(lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << "wanted '" << needle << "' in: " << r.err;
    EXPECT_FALSE(fs::exists(out)) << args;
  }
}

TEST_F(Tools, MakeTinyWritesGatesAndForwardRunsTheStudent) {
  const fs::path dir = root_ / "tiny_gated";
  Result r = run("retain-make-tiny --out " + dir.string() + " --seed 7 --gates dbtrimkv --gate-hidden 8 --bias-init 1.5");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("dbtrimkv gates G=8 bias 1.5"), std::string::npos) << r.out;
  // Adding gates leaves the model itself unchanged.
  EXPECT_EQ(read_file((dir / "model.safetensors").string()), read_file((tiny() / "model.safetensors").string()));
  auto ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(dir.string()));
  const gates::RetentionGates g = gates::RetentionGates::load((dir / "gates.safetensors").string(), ckpt->config());
  EXPECT_EQ(g.kind(), gates::GateKind::dbtrimkv);
  EXPECT_EQ(g.dims().gate_hidden, 8);
  EXPECT_EQ(g.bias_init(), 1.5);

  const fs::path out = root_ / "student.safetensors";
  r = run("retain-forward --device cpu --model " + dir.string() + " --gates " + (dir / "gates.safetensors").string() +
          " --ids \"5 10 7 256 3 4\" --doc-ids \"0 0 0 1 1 1\" --out " + out.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("dbtrimkv gates G=8"), std::string::npos) << r.out;
  const Tensor logits = formats::SafetensorsFile::open(out.string()).tensor("logits");
  LocalWeightProvider w(ckpt);
  const Tensor ids = Tensor::from_vector<int32_t>({5, 10, 7, 256, 3, 4}, {6});
  const Tensor docs = Tensor::from_vector<int32_t>({0, 0, 0, 1, 1, 1}, {6});
  const Tensor want = qwen3_forward(w, ids, docs, {}, &g), teacher = qwen3_forward(w, ids, docs);
  double diff_teacher = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    ASSERT_EQ(logits.data<float>()[i], want.data<float>()[i]);
    diff_teacher = std::max(diff_teacher, double(std::fabs(want.data<float>()[i] - teacher.data<float>()[i])));
  }
  EXPECT_GT(diff_teacher, 1e-3) << "bias 1.5 must make the student differ from the teacher";
}

TEST_F(Tools, ForwardRejectsBadGates) {
  const fs::path dir = root_ / "tiny_trimkv";
  ASSERT_EQ(run("retain-make-tiny --out " + dir.string() + " --seed 7 --gates trimkv").code, 0);
  const std::string gates = (dir / "gates.safetensors").string();
  const std::string m = "--model " + tiny().string() + " --ids \"1 2\"";
  expect_forward_error(m + " --gate-kind trimkv", "--gate-kind needs --gates");
  expect_forward_error(m + " --gates " + gates + " --gate-kind trim", "--gate-kind: unknown gate kind 'trim'");
  expect_forward_error(m + " --gates " + gates + " --gate-kind dbtrimkv",
                       "holds trimkv gates (no linear3.weight), but dbtrimkv gates were asked for");
  expect_forward_error(m + " --gates " + (root_ / "none.safetensors").string(), "none.safetensors");
  expect_forward_error(m + " --gates " + (tiny() / "model.safetensors").string(),
                       "unexpected tensor 'model.embed_tokens.weight'");
  // Gates made for other models: 3 layers; 4 KV heads.
  const fs::path deep = root_ / "tiny_deep", wide = root_ / "tiny_wide";
  ASSERT_EQ(run("retain-make-tiny --out " + deep.string() + " --layers 3 --gates trimkv").code, 0);
  ASSERT_EQ(run("retain-make-tiny --out " + wide.string() + " --kv-heads 4 --gates trimkv").code, 0);
  expect_forward_error(m + " --gates " + (deep / "gates.safetensors").string(),
                       "has gates for 3 layers (layer indices 0..2), the model has 2");
  expect_forward_error(m + " --gates " + (wide / "gates.safetensors").string(), "has shape [4, 16], expected [2, 16]");
  // A shared dbtrimkv tensor whose copies differ.
  const fs::path db = root_ / "tiny_db";
  ASSERT_EQ(run("retain-make-tiny --out " + db.string() + " --seed 7 --gates dbtrimkv").code, 0);
  const formats::SafetensorsFile f = formats::SafetensorsFile::open((db / "gates.safetensors").string());
  std::vector<std::pair<std::string, Tensor>> t;
  for (const std::string& n : f.names()) t.emplace_back(n, f.tensor(n).clone());
  for (auto& [n, v] : t)
    if (n == gates::gate_tensor_name(1, "bias")) v.data<float>()[0] += 1;
  const std::string edited = (root_ / "edited_gates.safetensors").string();
  formats::write_safetensors(edited, t);
  expect_forward_error(m + " --gates " + edited, "shared tensor 'model.layers.1.self_attn.retention_gate.bias' differs");
}
