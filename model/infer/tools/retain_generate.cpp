// retain-generate: text generation with a bounded KV cache (DESIGN §7, §8).
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <iostream>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "data/tokenizer/tokenizer.h"
#include "kernels/base/atomic_file.h"
#include "model/gates/gate_containers.h"
#include "model/kvpop/scorer_containers.h"
#include "kernels/base/cli.h"
#include "model/infer/generate.h"
#include "model/infer/tools/tool_args.h"

using namespace retain;
using namespace retain::infer;
namespace fs = std::filesystem;

namespace {

constexpr const char* kUsage =
    "Usage: retain-generate --model DIR [--gates FILE] --policy full|window|h2o|trimkv|dbtrimkv|kvpop\n"
    "                       --budget B --prompt TEXT|--prompt-file F|--prompt-ids \"1 2 3\"\n"
    "                       [--max-new N] [--greedy | --temperature T --seed S] [--json FILE]\n"
    "                       [--prefill-chunk C] [--buffer N] [--lookahead A] [--ignore-eos]\n"
    "                       [--device cpu|cuda]\n\n"
    "Generates text with the Qwen3 checkpoint in DIR while its KV cache holds at most B entries\n"
    "per layer and KV head (DESIGN §8): the policy decides which entries stay. trimkv and\n"
    "dbtrimkv rank tokens by the retention gates in --gates (any container retain-export writes:\n"
    "safetensors, GGUF, a TRIM-KV directory, a .pth); β only chooses evictions, attention over the kept entries is plain softmax.\n"
    "kvpop keeps the sinks, the window and the top B − sinks − window others by KVPOP score, with\n"
    "--gates a kvpop scorer file (retain-train --gate kvpop, or its safetensors/GGUF export).\n"
    "Text prompts are tokenized with DIR/tokenizer.json; the output is decoded with it. Prints the\n"
    "text, tokens/s of prefill and decoding, and the cache size. --json FILE writes prompt_ids,\n"
    "generated_ids, cache_sizes (entries per layer, summed over KV heads) and kept_positions (per\n"
    "layer and KV head, sorted), as the cache is after the forward that produced the last token.";

double peak_rss_mib() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux: KiB
}

// The text of `ids`; an id the tokenizer does not know (a random tiny model's vocabulary is
// larger than its byte-level tokenizer) is shown as [id].
std::string render_text(const data::Tokenizer& tok, const std::vector<int32_t>& ids) {
  std::string out;
  std::vector<int32_t> run;
  auto flush = [&] {
    if (!run.empty()) out += data::Tokenizer::sanitize_utf8(tok.decode(run));
    run.clear();
  };
  for (int32_t id : ids) {
    if (id < tok.vocab_size()) {
      run.push_back(id);
      continue;
    }
    flush();
    out += fmt::format("[{}]", id);
  }
  flush();
  return out;
}

int run(int argc, char** argv) {
  cli::po::options_description opts("Options");
  std::string model, gates_path, policy_text, prompt, prompt_file, prompt_ids, json_path, device;
  int64_t budget = -1, max_new = 32, chunk = 0, buffer = 1, lookahead = 1;
  double temperature = 1.0;
  uint64_t seed = 0;
  opts.add_options()
      ("model", cli::po::value(&model)->required(), "Hugging Face model directory")
      ("gates", cli::po::value(&gates_path), "retention gates (trimkv, dbtrimkv: .safetensors, .gguf, a TRIM-KV directory, .pth) or kvpop scorers (kvpop: .safetensors or .gguf)")
      ("policy", cli::po::value(&policy_text)->required(), "full, window, h2o, trimkv, dbtrimkv, kvpop")
      ("budget", cli::po::value(&budget), "entries per layer and KV head (not needed for full)")
      ("prompt", cli::po::value(&prompt), "prompt text")
      ("prompt-file", cli::po::value(&prompt_file), "file holding the prompt text")
      ("prompt-ids", cli::po::value(&prompt_ids), "prompt token ids, separated by spaces or commas")
      ("max-new", cli::po::value(&max_new)->default_value(32), "tokens to generate")
      ("greedy", "greedy decoding (argmax) instead of sampling")
      ("temperature", cli::po::value(&temperature)->default_value(1.0), "sampling temperature")
      ("seed", cli::po::value(&seed)->default_value(0), "sampling seed")
      ("json", cli::po::value(&json_path), "write ids, cache sizes and kept positions here (atomically)")
      ("prefill-chunk", cli::po::value(&chunk)->default_value(0), "prefill in chunks of C tokens, evicting after each (0: whole prompt)")
      ("buffer", cli::po::value(&buffer)->default_value(1), "evict when a head reaches budget + buffer entries")
      ("lookahead", cli::po::value(&lookahead)->default_value(1),
       "trimkv, dbtrimkv: rank entries by (q + A − i)·logβ_i, q = tokens seen (1: the TRIM-KV authors' code)")
      ("ignore-eos", "do not stop at the model's eos_token_id")
      ("device", cli::po::value(&device)->default_value("cpu"), "cpu or cuda");
  cli::po::variables_map vm;
  if (!cli::parse(argc, argv, kUsage, opts, vm)) return 0;

  if (device != "cpu" && device != "cuda") throw cli::UsageError(fmt::format("--device must be cpu or cuda, got '{}'", device));
  if (device == "cuda") fail("--device cuda: bounded-KV decoding runs on the CPU in this version; use --device cpu");
  const int given = static_cast<int>(vm.count("prompt") + vm.count("prompt-file") + vm.count("prompt-ids"));
  if (given != 1) throw cli::UsageError("give exactly one of --prompt, --prompt-file, --prompt-ids");
  if (max_new < 0) throw cli::UsageError("--max-new must be >= 0");
  if (chunk < 0) throw cli::UsageError("--prefill-chunk must be >= 0");
  if (temperature < 0)  // 0 is greedy; a negative one would invert the distribution
    throw cli::UsageError(fmt::format("--temperature must be >= 0 (0: greedy), got {}", temperature));
  PolicyOptions popt;
  popt.kind = policy_arg(policy_text, "--policy");
  if (popt.kind == PolicyKind::oracle_m)
    throw cli::UsageError("--policy oracle-m ranks tokens by the future attention of the whole sequence, which "
                          "generation does not know: run it with retain-eval (teacher-forced)");
  popt.buffer = buffer;
  if (lookahead < 0) throw cli::UsageError(fmt::format("--lookahead must be >= 0, got {}", lookahead));
  if (!vm["lookahead"].defaulted() && popt.kind != PolicyKind::trimkv && popt.kind != PolicyKind::dbtrimkv)
    throw cli::UsageError("--lookahead is for --policy trimkv or dbtrimkv");
  popt.lookahead = lookahead;
  if (popt.kind != PolicyKind::full && !vm.count("budget"))
    throw cli::UsageError(fmt::format("--policy {} needs --budget", policy_text));
  if (vm.count("budget") && budget < 0) throw cli::UsageError("--budget must be >= 0");
  popt.budget = std::max<int64_t>(budget, 0);
  check_policy_args(popt, vm.count("gates") > 0);  // before any loading
  if (vm.count("json"))
    cli::check_output("--json", json_path, {model, gates_path, vm.count("prompt-file") ? prompt_file : std::string()});

  auto ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(model));
  const Qwen3Config& cfg = ckpt->config();
  std::optional<data::Tokenizer> tok;
  const bool has_tok = fs::exists(fs::path(model) / "tokenizer.json");
  if (has_tok) tok = data::Tokenizer::load(fs::path(model) / "tokenizer.json");
  std::vector<int32_t> ids;
  if (vm.count("prompt-ids")) {
    for (int64_t v : cli::parse_int_list(prompt_ids, "--prompt-ids")) {
      if (v < 0 || v >= cfg.vocab_size)
        fail("--prompt-ids: token id {} is outside the vocabulary [0, {}) of {}", v, cfg.vocab_size, model);
      ids.push_back(static_cast<int32_t>(v));
    }
  } else {
    if (!tok) fail("{}: no tokenizer.json for a text prompt (use --prompt-ids)", model);
    const std::string text = vm.count("prompt") ? prompt : read_file(prompt_file);
    ids = tok->encode(text);
  }
  if (ids.empty()) fail("the prompt is empty");

  std::optional<gates::RetentionGates> gates;
  std::optional<kvpop::Scorers> scorers;  // --gates FILE holds one or the other
  if (vm.count("gates")) {
    if (kvpop::holds_kvpop(gates_path)) scorers = kvpop::load_scorers(gates_path, cfg).scorers;
    else gates = gates::load_gates(gates_path, cfg).gates;  // any container retain-export writes
  }
  ResidentWeightProvider weights(ckpt);
  Decoder dec(weights, gates ? &*gates : nullptr, popt, scorers ? &*scorers : nullptr);

  GenerateOptions gopt;
  gopt.max_new = max_new, gopt.prefill_chunk = chunk, gopt.seed = seed;
  gopt.temperature = vm.count("greedy") ? 0.0 : temperature;
  if (!vm.count("ignore-eos") && cfg.eos_token_id) gopt.stop_id = static_cast<int32_t>(*cfg.eos_token_id);
  // A long prompt on a real model takes a while on the CPU: on a terminal, tokens done and an ETA.
  const auto start = std::chrono::steady_clock::now();
  double last = -1;
  if (::isatty(STDERR_FILENO))
    gopt.progress = [&](int64_t done, int64_t total) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (s - last < 0.2 || s < 1.0) return;
      last = s;
      std::cerr << fmt::format("\rretain-generate: {}/{} tokens  {:.1f} s  ETA {:.1f} s   ", done, total, s,
                               s / static_cast<double>(done) * static_cast<double>(total - done))
                << std::flush;
    };
  const GenerateResult r = generate(dec, ids, gopt);

  if (last >= 0) std::cerr << "\n";
  const KVCache& cache = dec.cache();
  if (tok) std::cout << render_text(*tok, r.generated) << "\n";
  std::cout << fmt::format("generated ids: {}\n", fmt::join(r.generated, " "));
  std::cerr << fmt::format(
      "retain-generate: {} prompt tokens in {:.1f} ms ({:.0f} tokens/s), {} new tokens ({} decode steps, {:.1f} tokens/s); "
      "policy {}{}\n",
      ids.size(), r.prefill_s * 1e3, static_cast<double>(ids.size()) / std::max(r.prefill_s, 1e-9), r.generated.size(),
      r.decode_tokens, static_cast<double>(r.decode_tokens) / std::max(r.decode_s, 1e-9), policy_name(popt.kind),
      popt.kind == PolicyKind::full ? std::string() : fmt::format(" budget {}", popt.budget));
  std::vector<int64_t> per_layer;
  for (int64_t l = 0; l < cache.layers(); ++l) {
    int64_t n = 0;
    for (int64_t h = 0; h < cache.kv_heads(); ++h) n += cache.size(l, h);
    per_layer.push_back(n);
  }
  std::cerr << fmt::format(
      "cache: {} entries ({} per layer: {}; at most {} per KV head), {:.2f} MiB of K/V in F32; eviction {:.1f}% of the "
      "decode time ({:.1f} us per step); peak RSS {:.1f} MiB\n",
      cache.total(), cache.layers(), fmt::join(per_layer, " "), cache.max_size(),
      static_cast<double>(cache.kv_bytes()) / (1 << 20), 100.0 * r.decode_evict_s / std::max(r.decode_s, 1e-12),
      1e6 * r.decode_evict_s / static_cast<double>(std::max<int64_t>(r.decode_tokens, 1)), peak_rss_mib());

  if (vm.count("json")) {
    nlohmann::json j;
    j["prompt_ids"] = ids;
    j["generated_ids"] = r.generated;
    j["cache_sizes"] = per_layer;
    nlohmann::json kept = nlohmann::json::array();
    for (int64_t l = 0; l < cache.layers(); ++l) {
      nlohmann::json heads = nlohmann::json::array();
      for (int64_t h = 0; h < cache.kv_heads(); ++h) heads.push_back(cache.kept_positions(l, h));
      kept.push_back(heads);
    }
    j["kept_positions"] = kept;
    j["policy"] = policy_name(popt.kind);
    j["budget"] = popt.budget;
    write_file_atomic(json_path, j.dump() + "\n");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return cli::run_tool("retain-generate", [&] { return run(argc, argv); });
}
