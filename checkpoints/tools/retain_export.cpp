// retain-export: trained gates out of the trainer, for any inference engine (DESIGN §6, §7).
#include <filesystem>
#include <iostream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "checkpoints/checkpoint.h"
#include "checkpoints/export/gate_export.h"
#include "checkpoints/export/kvpop_export.h"
#include "model/kvpop/scorer_containers.h"
#include "data/tokenizer/sha256.h"
#include "kernels/base/atomic_file.h"
#include "kernels/base/cli.h"

using namespace retain;
namespace fs = std::filesystem;

namespace {

constexpr const char* kUsage =
    "Usage: retain-export --from RUN_DIR|CHECKPOINT_DIR|GATES --format trimkv|safetensors|gguf\n"
    "                     --out PATH [--dtype bf16|f32] [--base-model DIR_OR_HUB_ID] [--model DIR]\n"
    "                     [--force]\n\n"
    "Writes trained retention gates (or kvpop scorers: safetensors and gguf only) for inference\n"
    "engines (docs/formats.md):\n"
    "  trimkv       a directory the TRIM-KV authors' package loads (config.json = the base\n"
    "               model's config + the retention fields, and trimkv_weights.pth, a torch.save\n"
    "               archive): TrimKVQwen3ForCausalLM.from_pretrained(PATH, download_from=\"local\")\n"
    "  safetensors  the gate tensors with __metadata__ format \"retain-gates\"\n"
    "  gguf         a GGUF v3 adapter (general.type \"adapter\", blk.N.retention_gate.* tensors)\n"
    "--from: a retain-train run directory (its final gates.safetensors, else its latest\n"
    "checkpoint), a checkpoint directory (RUN/checkpoints/step-N), or gates in any container\n"
    "(.safetensors, .gguf, .pth, a TRIM-KV directory: converting between formats).\n"
    "--base-model: the base model the gates belong to: a Hugging Face directory (its\n"
    "config.json is read and hashed) or a hub id recorded as the identity. Default: the run's\n"
    "model, else the one the gates name. --model DIR reads the config from DIR while\n"
    "--base-model records another identity (say a hub id for a local copy). Values are\n"
    "written as --dtype (default bf16).";

struct Source {
  std::string gates_path;               // a file or trimkv directory load_gates reads
  std::optional<nlohmann::json> run;    // the run's config (model, memory, seq_len, …)
  std::optional<int64_t> step;          // from a checkpoint's state.json
  std::string described;                // for the summary line
};

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

nlohmann::json read_json(const fs::path& p) {
  try {
    return nlohmann::json::parse(read_file(p.string()));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON ({})", p.string(), e.what());
  }
}

Source resolve_source(const std::string& from) {
  std::error_code ec;
  const fs::path p(from);
  if (!fs::exists(p, ec)) fail("--from {}: no such file or directory", from);
  if (!fs::is_directory(p, ec)) return {from, std::nullopt, std::nullopt, from};
  if (is_file(p / "trimkv_weights.pth")) return {from, std::nullopt, std::nullopt, from + " (TRIM-KV directory)"};
  if (is_file(p / "state.json") && is_file(p / "gates.safetensors")) {  // a checkpoint
    const nlohmann::json state = read_json(p / "state.json");
    Source s{(p / "gates.safetensors").string(), std::nullopt, std::nullopt, from + " (checkpoint)"};
    if (state.contains("config")) s.run = state["config"];
    if (state.contains("step") && state["step"].is_number_integer()) s.step = state["step"].get<int64_t>();
    return s;
  }
  if (is_file(p / "config.json") && (is_file(p / "gates.safetensors") || fs::is_directory(p / "checkpoints", ec))) {
    Source s{"", read_json(p / "config.json"), std::nullopt, ""};
    if (is_file(p / "gates.safetensors")) {
      s.gates_path = (p / "gates.safetensors").string();
      s.described = from + " (run, final gates)";
    } else {
      const auto latest = ckpt::latest_checkpoint(from);
      if (!latest) fail("--from {}: a run directory without final gates or any checkpoint", from);
      s.gates_path = *latest + "/gates.safetensors";
      const nlohmann::json state = read_json(fs::path(*latest) / "state.json");
      if (state.contains("step") && state["step"].is_number_integer()) s.step = state["step"].get<int64_t>();
      s.described = from + " (run, latest checkpoint " + fs::path(*latest).filename().string() + ")";
    }
    return s;
  }
  fail("--from {}: a directory that is neither a retain run, a checkpoint nor a TRIM-KV directory "
       "(expected gates.safetensors, checkpoints/ or trimkv_weights.pth)",
       from);
}

int run(int argc, char** argv) {
  cli::po::options_description opts("Options");
  std::string from, format_text, out, dtype_text, base_model, model_arg;
  opts.add_options()
      ("from", cli::po::value(&from)->required(), "run directory, checkpoint directory or gates (any container)")
      ("format", cli::po::value(&format_text)->required(), "trimkv, safetensors or gguf")
      ("out", cli::po::value(&out)->required(), "output file (safetensors, gguf) or directory (trimkv)")
      ("dtype", cli::po::value(&dtype_text)->default_value("bf16"), "bf16 or f32")
      ("base-model", cli::po::value(&base_model), "base model directory or hub id (default: the run's model)")
      ("model", cli::po::value(&model_arg), "base model directory to read config.json from (default: as --base-model)")
      ("force", "replace --out if it exists");
  cli::po::variables_map vm;
  if (!cli::parse(argc, argv, kUsage, opts, vm)) return 0;
  if (format_text != "trimkv" && format_text != "safetensors" && format_text != "gguf")
    throw cli::UsageError(fmt::format("--format must be trimkv, safetensors or gguf, got '{}'", format_text));
  if (dtype_text != "bf16" && dtype_text != "f32")
    throw cli::UsageError(fmt::format("--dtype must be bf16 or f32, got '{}'", dtype_text));
  const DType dtype = dtype_text == "bf16" ? DType::BF16 : DType::F32;
  const bool force = vm.count("force") > 0;

  // Checked before anything is read or written: where the output goes.
  std::error_code ec;
  const fs::path out_abs = fs::absolute(out).lexically_normal();
  if (!fs::is_directory(out_abs.parent_path(), ec))
    fail("--out {}: the folder {} does not exist", out, out_abs.parent_path().string());
  if (fs::exists(out_abs, ec) && !force) fail("--out {}: already exists (pass --force to replace it)", out);
  if (fs::exists(out_abs, ec) && fs::is_directory(out_abs, ec) != (format_text == "trimkv"))
    fail("--out {}: is a {} but --format {} writes a {}", out, fs::is_directory(out_abs, ec) ? "directory" : "file",
         format_text, format_text == "trimkv" ? "directory" : "file");

  const Source src = resolve_source(from);
  const gates::Format src_format = gates::detect_format(src.gates_path);

  // The base model: its config (to check the gates and to build the trimkv config) and its
  // identity. Identity: --base-model, else the run's model, else what the gates record, else
  // the config's directory. Config: --model, else a --base-model directory, else the run's
  // model, else a recorded directory, else (a TRIM-KV directory) the source's own config.json.
  auto absolute = [](const std::string& d) { return fs::absolute(d).lexically_normal().string(); };
  const std::string recorded = gates::recorded_base_model(src.gates_path);
  std::string run_model;
  if (src.run && src.run->contains("model") && (*src.run)["model"].is_string()) run_model = (*src.run)["model"];
  std::string model_dir = model_arg, identity;
  if (!model_dir.empty() && !fs::is_directory(model_dir, ec)) fail("--model {}: not a directory", model_dir);
  if (!base_model.empty()) identity = fs::is_directory(base_model, ec) ? absolute(base_model) : base_model;
  else if (!run_model.empty()) identity = absolute(run_model);
  else identity = recorded;
  for (const std::string& candidate : {base_model, run_model, recorded})
    if (model_dir.empty() && !candidate.empty() && fs::is_directory(candidate, ec)) model_dir = candidate;
  if (model_dir.empty() && src_format != gates::Format::trimkv)
    fail("{}: cannot tell the base model's config{}: pass --model DIR or --base-model DIR (the Hugging Face model "
         "directory the gates were trained for)",
         from,
         !run_model.empty() ? fmt::format(" (the run's model '{}' is not a directory here)", run_model)
         : !recorded.empty() ? fmt::format(" (the gates name '{}', not a directory here)", recorded)
                             : "");
  Qwen3Config config;
  nlohmann::ordered_json base_config;
  std::string sha;
  if (!model_dir.empty()) {
    const std::string cfg_path = (fs::path(model_dir) / "config.json").string();
    const std::string bytes = read_file(cfg_path);
    config = Qwen3Config::load(cfg_path);
    base_config = nlohmann::ordered_json::parse(bytes);
    sha = data::sha256_hex(bytes);
    if (identity.empty()) identity = absolute(model_dir);
  } else {
    config = gates::trimkv_dir_model_config(src.gates_path);
    base_config = nlohmann::ordered_json::parse(read_file((fs::path(src.gates_path) / "config.json").string()));
  }
  // --force replaces an output, never what this export reads (the gates, the run, the model).
  cli::check_output("--out", out, {from, src.gates_path, model_dir});
  // KVPOP scorers (DESIGN §5) travel as safetensors or GGUF only.
  const bool kvpop = kvpop::holds_kvpop(src.gates_path);
  if (kvpop && format_text == "trimkv")
    fail("--format trimkv: {} holds kvpop scorers, which the TRIM-KV authors' directory cannot carry (use "
         "--format safetensors or gguf)",
         src.gates_path);
  std::optional<gates::LoadedGates> loaded;
  std::optional<kvpop::LoadedScorers> scorers;
  if (kvpop) scorers = kvpop::load_scorers(src.gates_path, config);
  else loaded = gates::load_gates(src.gates_path, config);
  gates::GateInfo info = kvpop ? scorers->info : loaded->info;
  if (!identity.empty()) info.base_model = identity;
  if (!sha.empty()) info.base_config_sha256 = sha;
  if (src.step) info.step = src.step;
  if (src.run) {
    if (src.run->contains("memory") && (*src.run)["memory"].is_number()) info.memory = (*src.run)["memory"].get<double>();
    if (src.run->contains("seq_len") && (*src.run)["seq_len"].is_number_integer() && (*src.run)["seq_len"].get<int64_t>() > 0)
      info.max_seq_len = (*src.run)["seq_len"].get<int64_t>();
  }
  if (!info.max_seq_len) info.max_seq_len = config.max_position_embeddings;
  if (info.base_model.empty()) fail("{}: the gates name no base model: pass --base-model DIR_OR_HUB_ID", from);

  if (kvpop) {
    if (src.run && src.run->contains("window") && src.run->contains("sinks") && src.run->contains("topk"))
      scorers->scorers.set_geometry({(*src.run)["window"].get<int64_t>(), (*src.run)["sinks"].get<int64_t>(),
                                     (*src.run)["topk"].get<int64_t>()});
    if (!scorers->scorers.geometry())
      fail("{}: the scorers record no window/sinks/topk (the kvpop policy needs them)", src.gates_path);
    // The run's decay (config.json of runs since issue 38) — the same the scorers' metadata records.
    if (src.run && src.run->contains("decay_every") && src.run->contains("decay_min") && src.run->contains("decay_max"))
      scorers->scorers.set_decay({(*src.run)["decay_every"].get<int64_t>(), (*src.run)["decay_min"].get<double>(),
                                  (*src.run)["decay_max"].get<double>()});
    if (format_text == "safetensors") exports::write_scorers_safetensors(out, scorers->scorers, info, dtype);
    else exports::write_scorers_gguf(out, scorers->scorers, info, dtype);
    const kvpop::ScorerDims& d = scorers->scorers.dims();
    const kvpop::PolicyGeometry& g = *scorers->scorers.geometry();
    const kvpop::Decay& dc = scorers->scorers.decay();
    const std::string decay = dc == kvpop::Decay{} ? std::string()
                                                   : fmt::format(", decay every {} in [{}, {}]", dc.every,
                                                                 dc.gamma_min, dc.gamma_max);
    std::cout << fmt::format("retain-export: wrote {} ({}, {}): kvpop scorers, {} layers, {} KV heads, head_dim {}, "
                             "window {} sinks {} top-k {}{}, {} parameters; from {}; base model {}\n",
                             out, format_text, dtype_text, d.layers, d.kv_heads, d.head_dim, g.window, g.sinks, g.topk,
                             decay,
                             scorers->scorers.num_parameters(), src.described.empty() ? from : src.described,
                             info.base_model);
    return 0;
  }
  if (format_text == "safetensors") exports::write_safetensors(out, loaded->gates, info, dtype);
  else if (format_text == "gguf") exports::write_gguf(out, loaded->gates, info, dtype);
  else exports::write_trimkv_dir(out, loaded->gates, info, dtype, base_config, force);

  const gates::GateDims& d = loaded->gates.dims();
  std::cout << fmt::format("retain-export: wrote {} ({}, {}): {} gates, {} layers, G {}, {} KV heads, {} parameters; "
                           "from {}; base model {}\n",
                           out, format_text, dtype_text, gates::gate_kind_name(d.kind), d.layers, d.gate_hidden,
                           d.kv_heads, loaded->gates.num_parameters(), src.described.empty() ? from : src.described,
                           info.base_model);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return cli::run_tool("retain-export", [&] { return run(argc, argv); }); }
