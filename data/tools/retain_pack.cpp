// retain-pack: tokenize corpora and pack them into the HDF5 training dataset (DESIGN §6, §7;
// docs/data-format.md).
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <filesystem>
#include <iostream>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "data/formats/hf_config.h"
#include "data/packer.h"
#include "kernels/base/cli.h"
#include "kernels/base/error.h"

using namespace retain;
using namespace retain::data;

namespace {

constexpr const char* kUsage =
    "Usage: retain-pack --tokenizer DIR_OR_FILE --out FILE.h5 --seq-len S [options] [--input] FILE...\n\n"
    "Tokenizes the inputs and packs them into sequences of S tokens in an HDF5 file\n"
    "(docs/data-format.md). Inputs: JSON lines (.jsonl/.json/.ndjson) with \"text\", \"messages\"\n"
    "([{role, content}], Qwen3 chat template) or \"input_ids\" (+ optional \"target_mask\"); plain\n"
    "text (.txt: --txt-mode file = one document per file, line = one per line). Any input may be\n"
    "gzip-compressed (recognised by its magic bytes). Every document ends with the separator:\n"
    "--eos-token, else <|endoftext|>, else --model's eos_token_id. The output is written to a\n"
    "temporary name and renamed when complete.";

std::atomic<bool> g_interrupted{false};
extern "C" void on_signal(int) { g_interrupted.store(true); }

std::string human_bytes(double b) {
  const char* unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  return fmt::format("{:.1f} {}", b, unit[u]);
}

int run(int argc, char** argv) {
  cli::po::options_description opts("Options");
  std::string tokenizer, out, packing, targets, txt_mode, format, order, eos_token, model;
  std::vector<std::string> inputs;
  int64_t seq_len = 0;
  uint64_t seed = 0;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int level = 4;
  opts.add_options()
      ("tokenizer", cli::po::value(&tokenizer)->required(), "tokenizer.json, or a directory holding it")
      ("input", cli::po::value(&inputs)->composing(), "input file (repeatable; also positional)")
      ("out", cli::po::value(&out)->required(), "output .h5 file")
      ("seq-len", cli::po::value(&seq_len)->required(), "tokens per sequence (>= 2)")
      ("packing", cli::po::value(&packing)->default_value("concat"), "concat (stream and cut) or bfd (best-fit-decreasing)")
      ("order", cli::po::value(&order)->default_value("shuffle"), "document order before packing: shuffle (by --seed) or input")
      ("seed", cli::po::value(&seed)->default_value(0), "seed of the document shuffle (bfd: of its tie-breaking)")
      ("targets", cli::po::value(&targets)->default_value("all"), "messages: all tokens are targets, or only the assistant's")
      ("txt-mode", cli::po::value(&txt_mode)->default_value("file"), ".txt inputs: file (one document) or line (one per line)")
      ("format", cli::po::value(&format)->default_value("auto"), "auto (by file name), jsonl or txt")
      ("eos-token", cli::po::value(&eos_token), "separator token (default <|endoftext|>)")
      ("model", cli::po::value(&model), "model directory: its eos_token_id when the tokenizer has no <|endoftext|>")
      ("threads", cli::po::value(&threads)->default_value(threads), "tokenizer threads (the output does not depend on it)")
      ("compression", cli::po::value(&level)->default_value(4), "deflate level 1..9, 0 = uncompressed")
      ("skip-bad", "skip (and count) malformed lines instead of failing")
      ("quiet,q", "no progress output");
  cli::po::positional_options_description pos;
  pos.add("input", -1);
  opts.add_options()("help,h", "print this help and exit");
  cli::po::variables_map vm;
  cli::po::store(cli::po::command_line_parser(argc, argv).options(opts).positional(pos).run(), vm);
  if (vm.count("help")) {
    std::cout << kUsage << "\n\n" << opts << "\n";
    return 0;
  }
  cli::po::notify(vm);
  cli::check_finite_numbers(vm);

  PackOptions o;
  if (seq_len < 2) throw cli::UsageError(fmt::format("--seq-len must be at least 2, got {}", seq_len));
  if (seq_len > INT32_MAX) throw cli::UsageError(fmt::format("--seq-len {} is too large", seq_len));
  if (inputs.empty()) throw cli::UsageError("no input files given");
  // More threads than any machine runs tokenizers on is a typo, not a request (each reserves a
  // stack; 40,000 exhaust the process's mappings).
  constexpr int kMaxThreads = 1024;
  if (threads < 1 || threads > kMaxThreads)
    throw cli::UsageError(fmt::format("--threads must be between 1 and {}, got {}", kMaxThreads, threads));
  if (level < 0 || level > 9) throw cli::UsageError(fmt::format("--compression must be 0..9, got {}", level));
  if (packing == "concat") o.packing = Packing::concat;
  else if (packing == "bfd") o.packing = Packing::bfd;
  else throw cli::UsageError(fmt::format("--packing must be concat or bfd, got '{}'", packing));
  if (order == "shuffle") o.order = DocOrder::shuffle;
  else if (order == "input") o.order = DocOrder::input;
  else throw cli::UsageError(fmt::format("--order must be shuffle or input, got '{}'", order));
  if (targets == "all") o.targets = Targets::all;
  else if (targets == "assistant") o.targets = Targets::assistant;
  else throw cli::UsageError(fmt::format("--targets must be all or assistant, got '{}'", targets));
  if (txt_mode == "file") o.txt_mode = TxtMode::file;
  else if (txt_mode == "line") o.txt_mode = TxtMode::line;
  else throw cli::UsageError(fmt::format("--txt-mode must be file or line, got '{}'", txt_mode));
  if (format == "auto") o.format = InputFormat::automatic;
  else if (format == "jsonl") o.format = InputFormat::jsonl;
  else if (format == "txt") o.format = InputFormat::txt;
  else throw cli::UsageError(fmt::format("--format must be auto, jsonl or txt, got '{}'", format));
  for (const auto& in : inputs) o.inputs.emplace_back(in);
  o.out = out;
  o.seq_len = seq_len;
  o.seed = seed;
  o.threads = threads;
  o.compression_level = level;
  o.skip_bad = vm.count("skip-bad") > 0;
  o.interrupted = &g_interrupted;

  std::vector<std::string> read = {tokenizer, model};
  read.insert(read.end(), inputs.begin(), inputs.end());
  cli::check_output("--out", out, read);
  const Tokenizer tok = Tokenizer::load(tokenizer);
  std::optional<ModelEos> model_eos;
  if (!model.empty()) {
    const std::string config = (std::filesystem::path(model) / "config.json").string();
    model_eos = ModelEos{formats::read_config_token_id(config, "eos_token_id"), config};
  }
  o.eos_id = resolve_separator(tok, eos_token, model_eos);

  const bool quiet = vm.count("quiet") > 0;
  const bool tty = ::isatty(STDERR_FILENO);
  double last = -1e9;
  if (!quiet)
    o.progress = [&](const PackProgress& p) {
      const bool final = p.done == p.total;
      if (!final && p.seconds - last < (tty ? 0.2 : 10.0)) return;
      last = p.seconds;
      const double tps = p.seconds > 0 ? static_cast<double>(p.tokens) / p.seconds : 0.0;
      std::string line;
      if (std::string_view(p.phase) == "tokenize") {
        const double frac = p.total ? static_cast<double>(p.done) / static_cast<double>(p.total) : 1.0;
        const double eta = frac > 0 ? p.seconds * (1 - frac) / frac : 0.0;
        line = fmt::format("retain-pack: tokenize {}/{} ({:.0f}%)  {} docs  {} tokens  {:.0f} tok/s  ETA {:.0f} s",
                           human_bytes(static_cast<double>(p.done)), human_bytes(static_cast<double>(p.total)),
                           100 * frac, p.documents, p.tokens, tps, eta);
      } else {
        line = fmt::format("retain-pack: pack {}/{} sequences", p.done, p.total);
      }
      if (tty) std::cerr << "\r\033[K" << line << std::flush;
      else std::cerr << line << "\n";
    };
  int warned = 0;
  o.warn = [&](const std::string& w) {
    if (tty && !quiet) std::cerr << "\r\033[K";
    std::cerr << "retain-pack: warning: " << w << "\n";
    ++warned;
  };

  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  const PackSummary s = pack(tok, o);
  if (tty && !quiet) std::cerr << "\n";
  const int64_t slots = s.sequences * seq_len;
  std::cout << fmt::format(
      "retain-pack: wrote {}: {} {} x {} tokens ({} packing)\n"
      "  documents {}  tokens {}  padding {} ({:.2f}%)  split documents {}\n"
      "  skipped: blank lines {}  empty documents {}  bad records {}  invalid UTF-8 {}\n"
      "  {:.1f} s ({:.0f} tokens/s tokenizing, {} threads)\n",
      out, s.sequences, s.sequences == 1 ? "sequence" : "sequences", seq_len, packing, s.documents, s.tokens, s.padding_tokens,
      slots ? 100.0 * static_cast<double>(s.padding_tokens) / static_cast<double>(slots) : 0.0, s.split_documents,
      s.blank_lines, s.empty_documents, s.bad_records, s.invalid_utf8, s.total_seconds,
      s.tokenize_seconds > 0 ? static_cast<double>(s.tokens) / s.tokenize_seconds : 0.0, threads);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return cli::run_tool("retain-pack", [&] { return run(argc, argv); });
}
