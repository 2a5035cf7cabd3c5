// retain-make-tiny: a random tiny Qwen3 in the Hugging Face layout (tests, quickstart).
#include <cmath>
#include <iostream>

#include <fmt/format.h>

#include "kernels/base/cli.h"
#include "model/tiny.h"

using namespace retain;

namespace {

constexpr const char* kUsage =
    "Usage: retain-make-tiny --out DIR [--layers N --hidden N --heads N --kv-heads N --head-dim N\n"
    "                        --intermediate N --vocab N --tie|--no-tie --yarn-factor F --seed S\n"
    "                        --max-gib 1]\n"
    "                        [--gates trimkv|dbtrimkv --gate-hidden G --bias-init B]\n\n"
    "Writes a random Qwen3 (config.json, model.safetensors in BF16, a byte-level\n"
    "tokenizer.json with Qwen3's pre-tokenizer regex and <|endoftext|>, <|im_start|>,\n"
    "<|im_end|> as ids 256-258) into DIR. With --gates, also DIR/gates.safetensors:\n"
    "retention gates initialised as for training (weights N(0, 0.02)) with logit bias B\n"
    "(default 2, so logβ ≈ −0.13 and the decay is visible; training starts from 18).\n"
    "DIR is built beside itself and renamed into place; an existing non-empty DIR is refused\n"
    "unless --force, which replaces it whole.";

int run(int argc, char** argv) {
  TinyModelOptions o;
  std::string out, gate_kind, gate_input;
  cli::po::options_description opts("Options");
  opts.add_options()
      ("out", cli::po::value(&out)->required(), "output directory (its parent must exist; created if missing)")
      ("force", "replace --out if it exists and is not empty (it is replaced whole: nothing stale stays)")
      ("layers", cli::po::value(&o.layers)->default_value(o.layers), "decoder layers")
      ("hidden", cli::po::value(&o.hidden)->default_value(o.hidden), "hidden size")
      ("heads", cli::po::value(&o.heads)->default_value(o.heads), "query heads")
      ("kv-heads", cli::po::value(&o.kv_heads)->default_value(o.kv_heads), "key/value heads (divides --heads)")
      ("head-dim", cli::po::value(&o.head_dim)->default_value(o.head_dim), "head dimension (even)")
      ("intermediate", cli::po::value(&o.intermediate)->default_value(o.intermediate), "MLP size")
      ("vocab", cli::po::value(&o.vocab)->default_value(o.vocab), "vocabulary size (>= 259)")
      ("tie", "tie lm_head to the embedding (default)")
      ("no-tie", "separate lm_head.weight")
      ("yarn-factor", cli::po::value(&o.yarn_factor)->default_value(0), "YaRN factor (> 1 enables YaRN)")
      ("seed", cli::po::value(&o.seed)->default_value(0), "random seed")
      ("max-gib", cli::po::value(&o.max_gib)->default_value(1, "1"),
       "refuse a model above this many GiB of BF16 (a size guard against typos; Qwen3-4B shapes need 8)")
      ("gates", cli::po::value(&gate_kind), "also write DIR/gates.safetensors: trimkv or dbtrimkv")
      ("gate-hidden", cli::po::value(&o.gate_hidden)->default_value(o.gate_hidden), "gate width G (0: a linear trimkv gate)")
      ("gate-input", cli::po::value(&gate_input)->default_value("hidden"),
       "what the gates read: hidden (h) or kv ([k ‖ v] after RoPE)")
      ("bias-init", cli::po::value(&o.gate_bias_init)->default_value(o.gate_bias_init), "gate logit bias b");
  cli::po::variables_map vm;
  if (!cli::parse(argc, argv, kUsage, opts, vm)) return 0;
  if (!(o.yarn_factor == 0 || o.yarn_factor > 1))
    throw cli::UsageError(fmt::format(
        "--yarn-factor must be 0 (no YaRN) or > 1 (it stretches the context by that factor), got {}", o.yarn_factor));
  if (!(o.max_gib > 0)) throw cli::UsageError(fmt::format("--max-gib must be > 0, got {}", o.max_gib));
  if (vm.count("tie") && vm.count("no-tie")) throw cli::UsageError("--tie and --no-tie are exclusive");
  o.tie = !vm.count("no-tie");
  if (vm.count("gates")) {
    try {
      o.gate_kind = gates::parse_gate_kind(gate_kind, "--gates");
    } catch (const Error& e) {
      throw cli::UsageError(e.what());
    }
    if (o.gate_hidden < 0 || (o.gate_hidden == 0 && *o.gate_kind != gates::GateKind::trimkv))
      throw cli::UsageError(fmt::format(
          "--gate-hidden must be positive (or 0, a linear trimkv gate), got {} for {} gates", o.gate_hidden, gate_kind));
    try {
      o.gate_input = gates::parse_gate_input(gate_input, "--gate-input");
    } catch (const Error& e) {
      throw cli::UsageError(e.what());
    }
  } else if (!vm["gate-hidden"].defaulted() || !vm["bias-init"].defaulted() || !vm["gate-input"].defaulted()) {
    throw cli::UsageError("--gate-hidden, --gate-input and --bias-init need --gates");
  }

  for (const auto& [name, v] : {std::pair{"--layers", o.layers}, std::pair{"--hidden", o.hidden},
                                std::pair{"--heads", o.heads}, std::pair{"--kv-heads", o.kv_heads},
                                std::pair{"--head-dim", o.head_dim}, std::pair{"--intermediate", o.intermediate}})
    if (v <= 0) throw cli::UsageError(fmt::format("{} must be positive, got {}", name, v));
  if (o.heads % o.kv_heads != 0)
    throw cli::UsageError(fmt::format("--heads {} must be a multiple of --kv-heads {}", o.heads, o.kv_heads));
  if (o.vocab < kTinyTokenizerSize)
    throw cli::UsageError(fmt::format("--vocab {} is too small: the tiny tokenizer has {} tokens", o.vocab, kTinyTokenizerSize));
  if (o.gate_kind && !std::isfinite(o.gate_bias_init))
    throw cli::UsageError(fmt::format("--bias-init: retention gates: bias init {} is not finite", o.gate_bias_init));
  if (o.head_dim % 2 != 0) throw cli::UsageError(fmt::format("--head-dim must be even (RoPE), got {}", o.head_dim));
  o.replace = vm.count("force") > 0;
  make_tiny_model(out, o);
  std::cout << fmt::format(
      "retain-make-tiny: wrote {} (layers {}, hidden {}, heads {}/{} kv, head_dim {}, intermediate {}, vocab {}, "
      "{}{}{})\n",
      out, o.layers, o.hidden, o.heads, o.kv_heads, o.head_dim, o.intermediate, o.vocab, o.tie ? "tied" : "untied",
      o.yarn_factor > 1 ? fmt::format(", YaRN x{}", o.yarn_factor) : "",
      o.gate_kind ? fmt::format(", {} gates G={} bias {}", gates::gate_kind_name(*o.gate_kind), o.gate_hidden,
                                o.gate_bias_init)
                  : "");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return cli::run_tool("retain-make-tiny", [&] { return run(argc, argv); });
}
