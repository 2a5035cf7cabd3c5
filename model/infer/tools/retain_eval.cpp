// retain-eval: quality of bounded-KV decoding per policy and budget (DESIGN §7, §8).
#include <algorithm>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "data/packed_dataset.h"
#include "kernels/base/atomic_file.h"
#include "model/gates/gate_containers.h"
#include "model/kvpop/scorer_containers.h"
#include "kernels/base/cli.h"
#include "model/infer/eval.h"
#include "model/infer/figures.h"
#include "model/infer/tools/tool_args.h"

using namespace retain;
using namespace retain::infer;
namespace fs = std::filesystem;

namespace {

constexpr const char* kUsage =
    "Usage: retain-eval --model DIR [--gates [POLICY=]FILE ...] --data FILE.h5|--task recall\n"
    "                   --policy P,... --budget B,... [--out metrics.json] [--plot PNG]\n"
    "                   [--sequences N] [--prefill-chunk C] [--buffer N] [--lookahead A]\n"
    "                   [--samples N --context N --pairs N --queries N --key-len N --value-len N\n"
    "                    --seed S]\n"
    "                   [--dump-task FILE.jsonl]\n\n"
    "For each policy (full, window, h2o, trimkv, dbtrimkv, kvpop, oracle-m) and budget (entries per layer\n"
    "and KV head), feeds text through the bounded-KV decoder one token per forward (--prefill-chunk to\n"
    "feed more), evicting as generation would, and scores its predictions.\n"
    "oracle-m is kvpop's cache ranked by the KVPOP training target log m of the whole teacher-forced\n"
    "sequence instead of the scorers, with the window, sinks and decay of a kvpop scorer file\n"
    "(--gates oracle-m=FILE, else kvpop's file, else the common one): the ceiling of those scorers.\n"
    "  --data FILE.h5   a packed dataset (retain-pack): NLL and perplexity of the target tokens,\n"
    "                   KL(full cache || bounded cache) and top-1 agreement with the full cache,\n"
    "                   over the documents of the first --sequences sequences;\n"
    "  --task recall    the synthetic key-value recall task (model/infer/recall_task.h): exact-\n"
    "                   match accuracy and NLL of the answers. --dump-task writes its samples as\n"
    "                   JSON lines {input_ids, target_mask} that retain-pack reads (training data;\n"
    "                   without --policy it only writes them). --queries N asks N keys at the end,\n"
    "                   every answer a target; the last is scored. Task ids stop at the model's\n"
    "                   first special token (bos/eos id >= 16).\n"
    "full runs once (no budget). Writes metrics.json (`results`: policy, budget, nll, perplexity,\n"
    "kl + top1_agreement or accuracy, tokens, mean cache, tokens/s, eviction share) atomically,\n"
    "and with --plot a PNG of quality vs budget per policy.";

// "1:02:03", "12:03" or "45s".
std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "--";
  const int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60);
  if (t >= 60) return fmt::format("{}:{:02}", t / 60, t % 60);
  return fmt::format("{}s", t);
}

template <typename T>
std::vector<T> parse_list(const std::string& text, const char* option, T (*one)(const std::string&, const char*)) {
  std::vector<T> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(one(item, option));
  if (out.empty()) throw cli::UsageError(fmt::format("{}: empty list", option));
  return out;
}

int run(int argc, char** argv) {
  cli::po::options_description opts("Options");
  std::vector<std::string> gate_args;
  std::string model, data_path, task, policies_text, budgets_text, out = "metrics.json", plot, dump;
  EvalOptions eopt;
  RecallSpec spec;
  opts.add_options()
      ("model", cli::po::value(&model)->required(), "Hugging Face model directory")
      ("gates", cli::po::value(&gate_args)->composing(),
       "retention gates (trimkv, dbtrimkv: .safetensors, .gguf, a TRIM-KV directory, .pth) or kvpop scorers "
       "(kvpop: .safetensors, .gguf); FILE for every "
       "gated policy, or POLICY=FILE for one (repeat the option)")
      ("data", cli::po::value(&data_path), "packed dataset (.h5) to score")
      ("task", cli::po::value(&task), "built-in task: recall")
      ("policy", cli::po::value(&policies_text), "policies, comma-separated (none: only --dump-task)")
      ("budget", cli::po::value(&budgets_text), "budgets, comma-separated (not needed for full alone)")
      ("out", cli::po::value(&out)->default_value("metrics.json"), "metrics file (JSON, written atomically)")
      ("plot", cli::po::value(&plot), "PNG of quality vs budget per policy")
      ("sequences", cli::po::value(&eopt.max_sequences)->default_value(16), "data: first N sequences (0: all)")
      ("prefill-chunk", cli::po::value(&eopt.prefill_chunk)->default_value(1), "tokens per forward")
      ("buffer", cli::po::value(&eopt.buffer)->default_value(1), "evict at budget + buffer entries")
      ("lookahead", cli::po::value(&eopt.lookahead)->default_value(1),
       "trimkv, dbtrimkv: rank entries by (q + A − i)·logβ_i, q = tokens seen (1: the TRIM-KV authors' code)")
      ("samples", cli::po::value(&spec.samples)->default_value(32), "recall: samples")
      ("context", cli::po::value(&spec.context)->default_value(512), "recall: tokens before the query")
      ("pairs", cli::po::value(&spec.pairs)->default_value(8), "recall: key-value records")
      ("queries", cli::po::value(&spec.queries)->default_value(1),
       "recall: keys asked at the end; the last is scored, the others are answered in the prompt")
      ("key-len", cli::po::value(&spec.key_len)->default_value(2), "recall: tokens per key")
      ("value-len", cli::po::value(&spec.value_len)->default_value(2), "recall: tokens per value")
      ("seed", cli::po::value(&spec.seed)->default_value(0), "recall: task seed")
      ("dump-task", cli::po::value(&dump), "recall: also write the samples as JSON lines");
  cli::po::variables_map vm;
  if (!cli::parse(argc, argv, kUsage, opts, vm)) return 0;

  if (vm.count("data") == vm.count("task")) throw cli::UsageError("give exactly one of --data FILE.h5, --task recall");
  const bool recall = vm.count("task");
  if (recall && task != "recall") throw cli::UsageError(fmt::format("--task: unknown task '{}' (recall)", task));
  const bool dump_only = !vm.count("policy");
  if (dump_only && !(recall && vm.count("dump-task")))
    throw cli::UsageError("give --policy (only --task recall --dump-task FILE may go without)");
  if (eopt.prefill_chunk < 1) throw cli::UsageError("--prefill-chunk must be >= 1");
  if (eopt.max_sequences < 0) throw cli::UsageError("--sequences must be >= 0");
  if (eopt.lookahead < 0) throw cli::UsageError(fmt::format("--lookahead must be >= 0, got {}", eopt.lookahead));
  // --gates FILE (every gated policy) or POLICY=FILE (that one), repeatable.
  std::map<std::optional<PolicyKind>, std::string> gate_files;
  for (const std::string& g : gate_args) {
    std::optional<PolicyKind> kind;
    std::string file = g;
    for (PolicyKind k : {PolicyKind::trimkv, PolicyKind::dbtrimkv, PolicyKind::kvpop, PolicyKind::oracle_m})
      if (g.starts_with(std::string(policy_name(k)) + "=")) kind = k, file = g.substr(policy_name(k).size() + 1);
    if (file.empty()) throw cli::UsageError(fmt::format("--gates {}: no file after '='", g));
    if (!gate_files.emplace(kind, file).second)
      throw cli::UsageError(kind ? fmt::format("--gates: two files for policy {}", policy_name(*kind))
                                 : std::string("--gates: two files for every policy (name one with POLICY=FILE)"));
  }
  const std::vector<PolicyKind> policies =
      dump_only ? std::vector<PolicyKind>{}
                : parse_list<PolicyKind>(policies_text, "--policy",
                                         [](const std::string& s, const char* o) { return policy_arg(s, o); });
  std::vector<int64_t> budgets;
  if (vm.count("budget"))
    budgets = parse_list<int64_t>(budgets_text, "--budget", [](const std::string& s, const char* o) {
      const auto v = cli::parse_int_list(s, o);
      return v.at(0);
    });
  if (!vm["lookahead"].defaulted() &&
      std::none_of(policies.begin(), policies.end(),
                   [](PolicyKind p) { return p == PolicyKind::trimkv || p == PolicyKind::dbtrimkv; }))
    throw cli::UsageError("--lookahead is for --policy trimkv or dbtrimkv");
  std::vector<EvalRun> runs;
  for (PolicyKind p : policies) {
    if (p == PolicyKind::full) {
      runs.push_back({p, 0});
      continue;
    }
    if (budgets.empty()) throw cli::UsageError(fmt::format("--policy {} needs --budget", policy_name(p)));
    for (int64_t b : budgets) runs.push_back({p, b});
  }
  for (const EvalRun& r : runs) {  // every policy/budget error before any loading
    PolicyOptions po;
    po.kind = r.policy, po.budget = r.budget, po.buffer = eopt.buffer;
    check_policy_args(po, gate_files.count(r.policy) || gate_files.count(std::nullopt) ||
                              (r.policy == PolicyKind::oracle_m && gate_files.count(PolicyKind::kvpop)));
  }
  std::vector<std::string> inputs = {model, data_path};
  for (const auto& [kind, file] : gate_files) inputs.push_back(file);
  if (!dump_only) cli::check_output("--out", out, inputs);
  if (vm.count("plot")) cli::check_output("--plot", plot, inputs);
  if (vm.count("dump-task")) cli::check_output("--dump-task", dump, inputs);

  auto ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(model));
  // Each file once; a file holds retention gates or kvpop scorers. (std::map: stable addresses.)
  std::map<std::string, gates::RetentionGates> loaded_gates;
  std::map<std::string, kvpop::Scorers> loaded_scorers;
  for (const auto& [kind, file] : gate_files) {
    if (loaded_gates.count(file) || loaded_scorers.count(file)) continue;
    if (kvpop::holds_kvpop(file)) loaded_scorers.emplace(file, kvpop::load_scorers(file, ckpt->config()).scorers);
    else loaded_gates.emplace(file, gates::load_gates(file, ckpt->config()).gates);  // any container
  }
  for (EvalRun& r : runs) {
    auto f = gate_files.find(r.policy);
    if (f == gate_files.end() && r.policy == PolicyKind::oracle_m) f = gate_files.find(PolicyKind::kvpop);
    if (f == gate_files.end()) f = gate_files.find(std::nullopt);
    if (f == gate_files.end()) continue;
    if (auto g = loaded_gates.find(f->second); g != loaded_gates.end()) r.gates = &g->second;
    if (auto c = loaded_scorers.find(f->second); c != loaded_scorers.end()) r.scorers = &c->second;
    if (r.policy == PolicyKind::oracle_m && !r.scorers)
      throw cli::UsageError(fmt::format(
          "--policy oracle-m takes the window, sinks and decay of KVPOP scorers: {} holds retention gates", f->second));
    // kvpop and oracle-m: the budget's minimum comes from the scorers' window and sinks.
    if (policy_needs_scorers(r.policy) && r.scorers && r.scorers->geometry()) {
      PolicyOptions po;
      po.kind = r.policy, po.budget = r.budget, po.buffer = eopt.buffer;
      po.window = r.scorers->geometry()->window, po.sinks = r.scorers->geometry()->sinks;
      check_policy_args(po, true);
    }
  }
  spec.vocab = ckpt->config().vocab_size;
  // No special token may be content: the task's ids stop at the model's first bos/eos id ≥ 16.
  for (const auto& id : {ckpt->config().bos_token_id, ckpt->config().eos_token_id})
    if (id && *id >= kRecallFirstContent) spec.content_limit = std::min(spec.content_limit, *id);

  const auto start = std::chrono::steady_clock::now();
  const bool tty = ::isatty(STDERR_FILENO);
  double last_print = -1;
  eopt.progress = [&](int64_t done, int64_t total) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (done != total && s - last_print < (tty ? 0.2 : 10.0)) return;
    last_print = s;
    const double eta = s / static_cast<double>(done) * static_cast<double>(total - done);
    std::cerr << fmt::format("{}retain-eval: {}/{} runs  {}  ETA {}{}", tty ? "\r" : "", done, total,
                             format_duration(s), format_duration(eta), tty && done != total ? "   " : "\n")
              << std::flush;
  };

  nlohmann::json m;
  m["model"] = model;
  if (gate_files.size() == 1 && gate_files.count(std::nullopt)) {
    m["gates"] = gate_files.at(std::nullopt);
  } else if (!gate_files.empty()) {  // {"trimkv": FILE, ..., "*": FILE}
    for (const auto& [kind, file] : gate_files) m["gates"][kind ? std::string(policy_name(*kind)) : "*"] = file;
  }
  m["prefill_chunk"] = eopt.prefill_chunk;
  m["buffer"] = eopt.buffer;
  if (eopt.lookahead != 1) m["lookahead"] = eopt.lookahead;  // only when set: metrics of the default as before
  std::vector<EvalResult> results;
  if (recall) {
    const std::vector<RecallSample> task_samples = make_recall_task(spec);  // spec errors before any output
    if (vm.count("dump-task")) {
      std::string lines;
      for (const RecallSample& s : task_samples) {
        nlohmann::json j;
        std::vector<int32_t> ids = s.prompt;
        ids.insert(ids.end(), s.answer.begin(), s.answer.end());
        std::vector<int> mask(ids.size(), 0);  // 1 on every query's value
        std::fill(mask.end() - static_cast<std::ptrdiff_t>(s.answer.size()), mask.end(), 1);
        for (int64_t at : s.answer_starts)
          std::fill_n(mask.begin() + at, static_cast<std::ptrdiff_t>(s.answer.size()), 1);
        j["input_ids"] = ids, j["target_mask"] = mask;
        lines += j.dump() + "\n";
      }
      write_file_atomic(dump, lines);
      if (dump_only) {
        std::cerr << fmt::format("retain-eval: wrote {} ({})\n", dump, describe(spec));
        return 0;
      }
    }
    ResidentWeightProvider weights(ckpt);  // every layer in F32: not for a dump alone
    std::cerr << fmt::format("retain-eval: {} on {} ({} runs)\n", describe(spec), model, runs.size());
    results = evaluate_recall(weights, nullptr, spec, runs, eopt);
    m["task"] = {{"name", "recall"}, {"samples", spec.samples}, {"context", spec.context}, {"pairs", spec.pairs},
                 {"queries", spec.queries}, {"key_len", spec.key_len}, {"value_len", spec.value_len},
                 {"content_ids", {kRecallFirstContent, std::min(spec.vocab, spec.content_limit)}}, {"seed", spec.seed}};
  } else {
    const data::PackedDataset ds = data::PackedDataset::open(data_path);
    data::check_dataset_matches_model(ds, model, ckpt->config().vocab_size);
    std::cerr << fmt::format("retain-eval: {} ({} sequences of {} tokens; scoring the first {}) on {} ({} runs)\n",
                             data_path, ds.num_sequences(), ds.seq_len(),
                             eopt.max_sequences ? std::min(eopt.max_sequences, ds.num_sequences()) : ds.num_sequences(),
                             model, runs.size());
    ResidentWeightProvider weights(ckpt);
    results = evaluate_data(weights, nullptr, ds, runs, eopt);
    m["data"] = data_path;
    m["sequences"] = eopt.max_sequences;
  }
  m["results"] = nlohmann::json::array();
  std::cout << (recall ? fmt::format("{:<9} {:>7} {:>9} {:>9} {:>9} {:>8} {:>9}\n", "policy", "budget", "accuracy",
                                     "nll", "ppl", "tokens", "tok/s")
                       : fmt::format("{:<9} {:>7} {:>9} {:>9} {:>9} {:>7} {:>8} {:>9}\n", "policy", "budget", "nll",
                                     "ppl", "kl", "top1", "tokens", "tok/s"));
  for (const EvalResult& r : results) {
    m["results"].push_back(result_json(r, recall));
    const std::string b = r.run.policy == PolicyKind::full ? "-" : std::to_string(r.run.budget);
    if (recall)
      std::cout << fmt::format("{:<9} {:>7} {:>9.4f} {:>9.4f} {:>9.3f} {:>8} {:>9.0f}\n", policy_name(r.run.policy), b,
                               r.accuracy, r.nll, std::exp(r.nll), r.tokens, r.tokens_per_s);
    else
      std::cout << fmt::format("{:<9} {:>7} {:>9.4f} {:>9.3f} {:>9.5f} {:>7.4f} {:>8} {:>9.0f}\n",
                               policy_name(r.run.policy), b, r.nll, std::exp(r.nll), r.kl, r.top1, r.tokens,
                               r.tokens_per_s);
  }
  write_file_atomic(out, m.dump(1) + "\n");
  std::cerr << fmt::format("retain-eval: wrote {}\n", out);
  if (vm.count("plot")) {
    plot_eval_metrics(m, plot, out);
    std::cerr << fmt::format("retain-eval: wrote {}\n", plot);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return cli::run_tool("retain-eval", [&] { return run(argc, argv); });
}
