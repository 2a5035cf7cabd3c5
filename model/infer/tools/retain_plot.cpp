// retain-plot: figures of a policy and a run — retention matrices and eviction decisions of a
// text (in the style of the TRIM-KV paper's Figures 4, 12, 13), training curves from a run's
// metrics.jsonl, quality vs budget from retain-eval's metrics.json.
#include <cmath>
#include <filesystem>
#include <iostream>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "data/tokenizer/tokenizer.h"
#include "kernels/base/atomic_file.h"
#include "kernels/base/cli.h"
#include "model/gates/gate_containers.h"
#include "model/infer/decoder.h"
#include "model/infer/figures.h"
#include "model/infer/plot.h"
#include "model/infer/tools/tool_args.h"

using namespace retain;
using namespace retain::infer;
namespace fs = std::filesystem;

namespace {

constexpr const char* kUsage =
    "Usage: retain-plot retention --model DIR --gates FILE (--text T|--text-file F|--ids \"1 2 3\")\n"
    "                             --out PNG [--budget B] [--policies trimkv,window,h2o]\n"
    "                             [--heads L:H,...] [--max-tokens N]\n"
    "       retain-plot losses --metrics RUN/metrics.jsonl --out PNG\n"
    "       retain-plot eval --metrics metrics.json --out PNG\n\n"
    "retention: decodes the text token by token and draws, for each chosen layer and KV head,\n"
    "  the retention matrix beta_i^(t-i) (row t = query, column i = key; from the gates with the\n"
    "  full cache) and, per policy, the eviction decisions: 1 where key i is still in the cache\n"
    "  after token t was processed (budget B, default 32), 0 where it was evicted.\n"
    "losses: total/KL, NTP, capacity loss and learning rate vs step from retain-train's log.\n"
    "eval: retain-eval's quality-vs-budget figure again from its metrics.json.";

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

int retention(int argc, char** argv) {
  cli::po::options_description opts("Options");
  std::string model, gates_path, text, text_file, ids_text, out, policies_text = "trimkv,window,h2o", heads_text;
  int64_t budget = 32, max_tokens = 256;
  opts.add_options()
      ("model", cli::po::value(&model)->required(), "Hugging Face model directory")
      ("gates", cli::po::value(&gates_path)->required(), "retention gates: .safetensors, .gguf, a TRIM-KV directory or .pth")
      ("text", cli::po::value(&text), "text (tokenized with DIR/tokenizer.json)")
      ("text-file", cli::po::value(&text_file), "file holding the text")
      ("ids", cli::po::value(&ids_text), "token ids instead of text")
      ("out", cli::po::value(&out)->required(), "output PNG")
      ("budget", cli::po::value(&budget)->default_value(32), "cache budget of the policies")
      ("policies", cli::po::value(&policies_text)->default_value("trimkv,window,h2o"), "policies to show")
      ("heads", cli::po::value(&heads_text), "layer:KV-head pairs (default: up to 4 spread over the layers)")
      ("max-tokens", cli::po::value(&max_tokens)->default_value(256), "use at most the first N tokens");
  cli::po::variables_map vm;
  if (!cli::parse(argc, argv, kUsage, opts, vm)) return 0;
  if (vm.count("text") + vm.count("text-file") + vm.count("ids") != 1)
    throw cli::UsageError("give exactly one of --text, --text-file, --ids");
  if (max_tokens < 2) throw cli::UsageError("--max-tokens must be >= 2");
  std::vector<PolicyOptions> policies;
  for (const std::string& p : split(policies_text)) {
    PolicyOptions o;
    o.kind = policy_arg(p, "--policies"), o.budget = budget;
    check_policy_args(o, true);
    policies.push_back(o);
  }

  cli::check_output("--out", out, {model, gates_path, vm.count("text-file") ? text_file : std::string()});
  auto ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(model));
  const Qwen3Config& cfg = ckpt->config();
  const gates::RetentionGates gates = gates::load_gates(gates_path, cfg).gates;  // any container retain-export writes
  std::vector<int32_t> ids;
  if (vm.count("ids")) {
    for (int64_t v : cli::parse_int_list(ids_text, "--ids")) {
      if (v < 0 || v >= cfg.vocab_size) fail("--ids: token id {} is outside the vocabulary [0, {})", v, cfg.vocab_size);
      ids.push_back(static_cast<int32_t>(v));
    }
  } else {
    const fs::path tok_path = fs::path(model) / "tokenizer.json";
    if (!fs::exists(tok_path)) fail("{}: no tokenizer.json for --text (use --ids)", model);
    ids = data::Tokenizer::load(tok_path).encode(vm.count("text") ? text : read_file(text_file));
  }
  if (static_cast<int64_t>(ids.size()) > max_tokens) ids.resize(static_cast<size_t>(max_tokens));
  if (ids.size() < 2) fail("the text has fewer than 2 tokens");
  const int64_t T = static_cast<int64_t>(ids.size()), L = cfg.num_hidden_layers, K = cfg.num_key_value_heads;

  std::vector<std::pair<int64_t, int64_t>> heads;
  if (vm.count("heads")) {
    for (const std::string& h : split(heads_text)) {
      const auto colon = h.find(':');
      if (colon == std::string::npos) throw cli::UsageError(fmt::format("--heads: '{}' is not LAYER:HEAD", h));
      const auto l = cli::parse_int_list(h.substr(0, colon), "--heads"), k = cli::parse_int_list(h.substr(colon + 1), "--heads");
      if (l.size() != 1 || k.size() != 1 || l[0] < 0 || l[0] >= L || k[0] < 0 || k[0] >= K)
        fail("--heads: '{}' is not a layer < {} and a KV head < {}", h, L, K);
      heads.emplace_back(l[0], k[0]);
    }
  } else {
    const int64_t n = std::min<int64_t>(4, L * K);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = n == 1 ? 0 : i * (L * K - 1) / (n - 1);
      heads.emplace_back(s / K, s % K);
    }
  }

  ResidentWeightProvider weights(ckpt);
  // logβ of every token with the full cache, then each policy's kept sets after every token.
  Decoder full(weights, &gates, PolicyOptions{});
  for (int64_t t = 0; t < T; ++t) full.feed(std::span(ids).subspan(static_cast<size_t>(t), 1));
  std::vector<ImagePanel> panels;
  std::vector<std::vector<std::vector<double>>> decisions(policies.size());  // [policy][head] T×T
  for (size_t p = 0; p < policies.size(); ++p) {
    Decoder dec(weights, &gates, policies[p]);
    decisions[p].assign(heads.size(), std::vector<double>(static_cast<size_t>(T * T), NAN));
    for (int64_t t = 0; t < T; ++t) {
      dec.feed(std::span(ids).subspan(static_cast<size_t>(t), 1));
      for (size_t h = 0; h < heads.size(); ++h) {
        auto& m = decisions[p][h];
        for (int64_t i = 0; i <= t; ++i) m[static_cast<size_t>(t * T + i)] = 0.0;
        for (int32_t i : dec.cache().kept_positions(heads[h].first, heads[h].second)) m[static_cast<size_t>(t * T + i)] = 1.0;
      }
    }
  }
  for (size_t h = 0; h < heads.size(); ++h) {
    const auto [l, k] = heads[h];
    ImagePanel r;
    r.title = fmt::format("layer {} KV head {}: retention #gb#di#u#ut-i#d", l, k);
    r.xlabel = "key position i", r.ylabel = "query step t", r.rows = T, r.cols = T;
    r.values.assign(static_cast<size_t>(T * T), NAN);
    const std::vector<float>& lb = full.log_beta_history()[static_cast<size_t>(l)];
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i <= t; ++i)
        r.values[static_cast<size_t>(t * T + i)] = std::exp(static_cast<double>(t - i) * lb[static_cast<size_t>(i * K + k)]);
    panels.push_back(r);
    for (size_t p = 0; p < policies.size(); ++p) {
      ImagePanel e;
      e.title = fmt::format("{} (budget {}): kept", policy_name(policies[p].kind), budget);
      e.xlabel = "key position i", e.ylabel = "query step t", e.rows = T, e.cols = T;
      e.values = decisions[p][h];
      panels.push_back(e);
    }
  }
  const int cols = static_cast<int>(1 + policies.size());
  plot_images(out, fmt::format("Retention #gb#di#u#ut-i#d and eviction decisions (1 = kept after step t) — {} tokens, {}", T, model), panels,
              cols, 330 * cols + 60, 330 * static_cast<int>(heads.size()) + 40, "value");
  std::cerr << fmt::format("retain-plot: wrote {} ({} tokens, {} heads, policies {})\n", out, T, heads.size(),
                           policies_text);
  return 0;
}

int losses(int argc, char** argv) {
  cli::po::options_description opts("Options");
  std::string metrics, out;
  opts.add_options()
      ("metrics", cli::po::value(&metrics)->required(), "a run's metrics.jsonl (retain-train)")
      ("out", cli::po::value(&out)->required(), "output PNG");
  cli::po::variables_map vm;
  if (!cli::parse(argc, argv, kUsage, opts, vm)) return 0;
  cli::check_output("--out", out, {metrics});
  plot_training_curves(metrics, out);
  std::cerr << fmt::format("retain-plot: wrote {}\n", out);
  return 0;
}

int eval(int argc, char** argv) {
  cli::po::options_description opts("Options");
  std::string metrics, out;
  opts.add_options()
      ("metrics", cli::po::value(&metrics)->required(), "retain-eval's metrics.json")
      ("out", cli::po::value(&out)->required(), "output PNG");
  cli::po::variables_map vm;
  if (!cli::parse(argc, argv, kUsage, opts, vm)) return 0;
  cli::check_output("--out", out, {metrics});
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(read_file(metrics));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not JSON ({})", metrics, e.what());
  }
  plot_eval_metrics(m, out, metrics);
  std::cerr << fmt::format("retain-plot: wrote {}\n", out);
  return 0;
}

int run(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::cout << kUsage << "\n";
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  if (cmd == "retention") return retention(argc - 1, argv + 1);
  if (cmd == "losses") return losses(argc - 1, argv + 1);
  if (cmd == "eval") return eval(argc - 1, argv + 1);
  throw cli::UsageError(fmt::format("unknown command '{}' (retention, losses, eval)", cmd));
}

}  // namespace

int main(int argc, char** argv) {
  return cli::run_tool("retain-plot", [&] { return run(argc, argv); });
}
