// Evaluation: the recall task's structure and determinism; evaluate_recall / evaluate_data vs
// an independent computation from the full forward (model/qwen3.cpp) for the full cache, the
// budget ≥ length case equal to full, bounded caches differing from it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <random>
#include <set>

#include <nlohmann/json.hpp>

#include "data/packed_dataset.h"
#include "kernels/base/atomic_file.h"
#include "model/infer/eval.h"
#include "model/qwen3.h"
#include "model/tiny.h"

using namespace retain;
using namespace retain::infer;
namespace fs = std::filesystem;

namespace {

fs::path scratch(const std::string& name) {
  return fs::path(::testing::TempDir()) / (name + "." + std::to_string(::getpid()));
}

struct Model {
  fs::path dir;
  std::shared_ptr<const Qwen3Checkpoint> ckpt;
  gates::RetentionGates gates;
};

const Model& model() {
  static Model m = [] {
    Model x;
    x.dir = scratch("retain_eval_tiny");
    TinyModelOptions o;
    o.layers = 2, o.hidden = 32, o.heads = 4, o.kv_heads = 2, o.head_dim = 16, o.intermediate = 64, o.vocab = 300;
    o.seed = 9, o.gate_kind = gates::GateKind::trimkv, o.gate_bias_init = 1.0;
    make_tiny_model(x.dir.string(), o);
    x.ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(x.dir.string()));
    x.gates = gates::RetentionGates::load((x.dir / "gates.safetensors").string(), x.ckpt->config());
    return x;
  }();
  struct RemoveAtExit {  // nothing is left in the temp folder
    fs::path p;
    ~RemoveAtExit() {
      std::error_code ec;
      fs::remove_all(p, ec);
    }
  };
  static const RemoveAtExit cleanup{m.dir};
  return m;
}

double log_softmax_at(const float* row, int64_t V, int64_t i) {
  double mx = -INFINITY, z = 0;
  for (int64_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(row[v]));
  for (int64_t v = 0; v < V; ++v) z += std::exp(row[v] - mx);
  return row[i] - mx - std::log(z);
}

}  // namespace

TEST(RecallTask, StructureAndDeterminism) {
  RecallSpec s;
  s.vocab = 300, s.samples = 20, s.context = 100, s.pairs = 5, s.key_len = 2, s.value_len = 3, s.seed = 4;
  const auto a = make_recall_task(s), b = make_recall_task(s);
  s.seed = 5;
  const auto c = make_recall_task(s);
  ASSERT_EQ(a.size(), 20u);
  EXPECT_NE(a[0].prompt, c[0].prompt);
  const int64_t R = (300 - kRecallFirstContent) / 2;
  for (size_t n = 0; n < a.size(); ++n) {
    EXPECT_EQ(a[n].prompt, b[n].prompt);
    const auto& p = a[n].prompt;
    ASSERT_EQ(static_cast<int64_t>(p.size()), 100 + 2 + 2);
    // Parse the context back into records: PAIR k k ARROW v v v, filler in between.
    std::map<std::vector<int32_t>, std::vector<int32_t>> records;
    std::map<std::vector<int32_t>, size_t> ends;
    for (size_t i = 0; i < 100;) {
      if (p[i] == kRecallPair) {
        ASSERT_EQ(p[i + 3], kRecallArrow);
        const std::vector<int32_t> k(p.begin() + i + 1, p.begin() + i + 3), v(p.begin() + i + 4, p.begin() + i + 7);
        for (int32_t x : k) EXPECT_TRUE(x >= kRecallFirstContent && x < kRecallFirstContent + R);
        for (int32_t x : v) EXPECT_TRUE(x >= kRecallFirstContent && x < kRecallFirstContent + R);
        EXPECT_TRUE(records.emplace(k, v).second) << "duplicate key";
        ends[k] = i + 7;
        i += 7;
      } else {
        EXPECT_GE(p[i], kRecallFirstContent + R) << "filler must not use key/value ids";
        EXPECT_LT(p[i], 300);
        ++i;
      }
    }
    EXPECT_EQ(records.size(), 5u);
    EXPECT_EQ(p[100], kRecallQuery);
    EXPECT_EQ(p[103], kRecallArrow);
    const std::vector<int32_t> key(p.begin() + 101, p.begin() + 103);
    ASSERT_TRUE(records.count(key));
    EXPECT_EQ(records[key], a[n].answer);
    EXPECT_EQ(a[n].depth, static_cast<int64_t>(p.size() - ends[key]));
  }
  RecallSpec bad = s;
  bad.pairs = 30;
  EXPECT_THROW(make_recall_task(bad), Error);
  bad = s;
  bad.vocab = 40;
  EXPECT_THROW(make_recall_task(bad), Error);
}

TEST(RecallTask, SeveralQueriesAndContentLimit) {
  RecallSpec one;
  one.vocab = 512, one.content_limit = 256, one.samples = 10, one.context = 200, one.pairs = 6, one.seed = 9;
  RecallSpec three = one;
  three.queries = 3;
  const auto a = make_recall_task(one), c = make_recall_task(three);
  const int64_t R = (256 - kRecallFirstContent) / 2;
  for (size_t n = 0; n < a.size(); ++n) {
    const auto& p = c[n].prompt;
    ASSERT_EQ(p.size(), 200u + 2 * 6 + 4);  // two answered queries, then the scored one
    if (n == 0) {  // later samples differ: the extra queries draw from the same stream
      EXPECT_TRUE(std::equal(p.begin(), p.begin() + 200, a[n].prompt.begin())) << "the same context";
      EXPECT_EQ(c[n].answer, a[n].answer) << "the scored query is the one a one-query task asks";
    }
    std::map<std::vector<int32_t>, std::vector<int32_t>> records;
    for (size_t i = 0; i < 200;) {
      if (p[i] == kRecallPair) {
        records[{p[i + 1], p[i + 2]}] = {p[i + 4], p[i + 5]};
        i += 6;
      } else {
        EXPECT_TRUE(p[i] >= kRecallFirstContent + R && p[i] < 256) << "filler below the content limit";
        ++i;
      }
    }
    ASSERT_EQ(c[n].answer_starts.size(), 2u);
    std::set<std::vector<int32_t>> asked;
    for (size_t q = 0; q < 3; ++q) {
      const size_t at = 200 + 6 * q;
      EXPECT_EQ(p[at], kRecallQuery);
      EXPECT_EQ(p[at + 3], kRecallArrow);
      const std::vector<int32_t> key{p[at + 1], p[at + 2]};
      ASSERT_TRUE(records.count(key));
      EXPECT_TRUE(asked.insert(key).second) << "queries ask distinct keys";
      if (q < 2) {
        EXPECT_EQ(c[n].answer_starts[q], static_cast<int64_t>(at + 4));
        EXPECT_EQ(std::vector<int32_t>(p.begin() + at + 4, p.begin() + at + 6), records[key]);
      } else {
        EXPECT_EQ(records[key], c[n].answer);
      }
    }
  }
  RecallSpec bad = three;
  bad.queries = 7;
  EXPECT_THROW(make_recall_task(bad), Error);
}

TEST(Eval, RecallFullEqualsIndependentForward) {
  const Model& m = model();
  ResidentWeightProvider w(m.ckpt);
  RecallSpec s;
  s.vocab = 300, s.samples = 3, s.context = 40, s.pairs = 3, s.seed = 1;
  EvalOptions o;
  const auto res = evaluate_recall(w, &m.gates, s, {{PolicyKind::full, 0}, {PolicyKind::trimkv, 64}, {PolicyKind::window, 8}}, o);
  // The reference: one plain forward over prompt + answer per sample, teacher-forced.
  double nll = 0;
  int64_t tokens = 0, exact = 0;
  LocalWeightProvider lw(m.ckpt);
  for (const RecallSample& smp : make_recall_task(s)) {
    std::vector<int32_t> ids = smp.prompt;
    ids.insert(ids.end(), smp.answer.begin(), smp.answer.end());
    const int64_t T = static_cast<int64_t>(ids.size()), V = 300;
    const Tensor logits = qwen3_forward(lw, Tensor::from_vector(ids, {T}), Tensor::zeros({T}, DType::I32));
    bool ok = true;
    for (size_t j = 0; j < smp.answer.size(); ++j) {
      const int64_t t = static_cast<int64_t>(smp.prompt.size() + j) - 1;
      const float* row = logits.data<float>() + t * V;
      nll -= log_softmax_at(row, V, smp.answer[j]);
      ok = ok && std::max_element(row, row + V) - row == smp.answer[j];
      ++tokens;
    }
    exact += ok;
  }
  EXPECT_EQ(res[0].tokens, tokens);
  EXPECT_NEAR(res[0].nll, nll / static_cast<double>(tokens), 1e-5);
  EXPECT_DOUBLE_EQ(res[0].accuracy, static_cast<double>(exact) / 3.0);
  EXPECT_DOUBLE_EQ(res[1].nll, res[0].nll);  // budget 64 > 46 tokens: nothing evicted
  EXPECT_GT(std::fabs(res[2].nll - res[0].nll), 1e-4);
  EXPECT_LE(res[2].mean_cache, 9.0);
}

TEST(Eval, DataFullHasZeroKLAndMatchesForward) {
  const Model& m = model();
  // A packed file through retain-pack (input_ids + target_mask records), two documents per sequence.
  const fs::path dir = scratch("retain_eval_data");
  fs::create_directories(dir);
  std::string jsonl;
  std::mt19937_64 rng(3);
  for (int d = 0; d < 5; ++d) {
    nlohmann::json j;
    std::vector<int> ids, mask;
    const int n = 10 + d * 7;
    for (int i = 0; i < n; ++i) ids.push_back(static_cast<int>(rng() % 256)), mask.push_back(i >= 3);
    j["input_ids"] = ids, j["target_mask"] = mask;
    jsonl += j.dump() + "\n";
  }
  write_file_atomic((dir / "in.jsonl").string(), jsonl);
  const std::string cmd = std::string(RETAIN_BIN_DIR) + "/retain-pack --tokenizer " + m.dir.string() +
                          " --seq-len 64 --order input --out " + (dir / "d.h5").string() + " " + (dir / "in.jsonl").string() +
                          " > /dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const data::PackedDataset ds = data::PackedDataset::open(dir / "d.h5");
  ResidentWeightProvider w(m.ckpt);
  EvalOptions o;
  o.max_sequences = 0;
  const auto res = evaluate_data(w, &m.gates, ds,
                                 {{PolicyKind::full, 0}, {PolicyKind::trimkv, 64}, {PolicyKind::h2o, 6}, {PolicyKind::trimkv, 6}}, o);
  EXPECT_LT(res[0].kl, 1e-9);
  EXPECT_DOUBLE_EQ(res[0].top1, 1.0);
  EXPECT_NEAR(res[1].nll, res[0].nll, 1e-12);
  EXPECT_GT(res[2].kl, 1e-4);
  EXPECT_GT(res[3].kl, 1e-4);
  EXPECT_LT(res[3].top1, 1.0);
  // The reference NLL: each document's plain forward, loss positions of DESIGN §4.
  LocalWeightProvider lw(m.ckpt);
  double nll = 0;
  int64_t tokens = 0;
  for (int64_t i = 0; i < ds.num_sequences(); ++i) {
    const data::PackedSequence s = ds.read(i);
    const int64_t T = static_cast<int64_t>(s.input_ids.size());
    const Tensor logits = qwen3_forward(lw, Tensor::from_vector(s.input_ids, {T}), Tensor::from_vector(s.doc_ids, {T}));
    for (int64_t t = 0; t + 1 < T; ++t)
      if (s.doc_ids[t] >= 0 && s.doc_ids[t + 1] == s.doc_ids[t] && s.target_mask[t + 1]) {
        nll -= log_softmax_at(logits.data<float>() + t * 300, 300, s.input_ids[t + 1]);
        ++tokens;
      }
  }
  EXPECT_EQ(res[0].tokens, tokens);
  EXPECT_NEAR(res[0].nll, nll / static_cast<double>(tokens), 1e-5);
  // Feeding 7 tokens per forward scores the same positions; the full cache gives the same numbers.
  EvalOptions o7 = o;
  o7.prefill_chunk = 7;
  const auto res7 = evaluate_data(w, &m.gates, ds, {{PolicyKind::full, 0}, {PolicyKind::trimkv, 6}}, o7);
  EXPECT_EQ(res7[0].tokens, tokens);
  EXPECT_NEAR(res7[0].nll, res[0].nll, 1e-6);
  EXPECT_LT(res7[0].kl, 1e-9);
  // …while a bounded cache now sees up to 6 + 7 entries inside a chunk: closer to full than with 1.
  EXPECT_LT(res7[1].kl, res[3].kl);
  fs::remove_all(dir);
}
