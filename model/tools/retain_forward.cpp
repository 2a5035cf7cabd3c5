// retain-forward: logits of a Qwen3 checkpoint for one token sequence (DESIGN §7).
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>

#include <fmt/format.h>

#include "model/gates/gate_containers.h"
#include "kernels/base/cli.h"
#include "kernels/deferred_checks.h"
#include "kernels/ops.h"
#include "kernels/device.h"
#include "model/device_weights.h"
#include "model/gates/gates.h"
#include "model/qwen3.h"
#include "data/formats/safetensors.h"
#include "model/weights.h"

using namespace retain;

namespace {

constexpr const char* kUsage =
    "Usage: retain-forward --model DIR --ids \"5 10 7 ...\" --out FILE.safetensors\n"
    "                      [--gates GATES [--gate-kind trimkv|dbtrimkv]]\n"
    "                      [--doc-ids \"0 0 1 ...\"] [--device cpu|cuda]\n\n"
    "Runs the Qwen3 checkpoint in DIR (Hugging Face layout) on the token ids and writes\n"
    "tensor `logits` (F32, [T, V]) to FILE. With --doc-ids, attention stays inside each\n"
    "document and RoPE positions restart per document (documents are contiguous runs of\n"
    "equal ids; a negative id marks padding, whose attention output is zero).\n"
    "With --gates, runs the student: every layer's attention is retention-gated by the\n"
    "TRIM-KV / DBTrimKV gates in GATES: a retain gate file (.safetensors), a GGUF adapter,\n"
    "a torch.save state dict (.pth, e.g. the TRIM-KV authors' trimkv_weights.pth) or a\n"
    "TRIM-KV directory (config.json + trimkv_weights.pth). The kind is read from the tensor\n"
    "names; --gate-kind, if given, must agree.\n"
    "--device cuda runs the model on the GPU (bf16 weights, cuBLASLt; the gated attention in\n"
    "bf16); the default is $RETAIN_DEVICE, else cuda when a GPU is visible, else cpu. The logits\n"
    "are formed and written 1024 rows at a time, so a long sequence never holds [T, V].";

int run(int argc, char** argv) {
  cli::po::options_description opts("Options");
  std::string model, ids_text, out, doc_text, device, gates_path, gate_kind_text;
  opts.add_options()
      ("model", cli::po::value(&model)->required(), "Hugging Face model directory (config.json + safetensors)")
      ("ids", cli::po::value(&ids_text)->required(), "token ids, separated by spaces or commas")
      ("out", cli::po::value(&out)->required(), "output .safetensors file (written atomically)")
      ("doc-ids", cli::po::value(&doc_text), "document id per token (default: one document)")
      ("gates", cli::po::value(&gates_path), "retention gates (.safetensors, .gguf, .pth or a TRIM-KV directory): run the gated student")
      ("gate-kind", cli::po::value(&gate_kind_text), "trimkv or dbtrimkv (checked against --gates)")
      ("device", cli::po::value(&device), "cpu or cuda (default: $RETAIN_DEVICE, else cuda when a GPU is visible)");
  cli::po::variables_map vm;
  if (!cli::parse(argc, argv, kUsage, opts, vm)) return 0;

  if (!device.empty() && device != "cpu" && device != "cuda")
    throw cli::UsageError(fmt::format("--device must be cpu or cuda, got '{}'", device));
  const Device dev = resolve_device(device);  // cuda without a GPU: one line, exit 1
  std::optional<gates::GateKind> gate_kind;
  if (vm.count("gate-kind")) {
    if (!vm.count("gates")) throw cli::UsageError("--gate-kind needs --gates");
    try {
      gate_kind = gates::parse_gate_kind(gate_kind_text, "--gate-kind");
    } catch (const Error& e) {
      throw cli::UsageError(e.what());
    }
  }

  const std::vector<int64_t> ids = cli::parse_int_list(ids_text, "--ids");
  if (ids.empty()) throw cli::UsageError("--ids: no token ids given");
  std::vector<int64_t> docs(ids.size(), 0);
  if (vm.count("doc-ids")) {
    docs = cli::parse_int_list(doc_text, "--doc-ids");
    if (docs.size() != ids.size())
      throw cli::UsageError(fmt::format("--doc-ids: {} ids given for {} tokens", docs.size(), ids.size()));
    std::map<int64_t, size_t> run_end;  // doc id -> index after its run
    for (size_t t = 0; t < docs.size(); ++t) {
      if (docs[t] < 0) continue;
      auto it = run_end.find(docs[t]);
      if (it != run_end.end() && it->second != t)
        fail("--doc-ids: document {} at position {} is not contiguous (it also appears before position {})", docs[t],
             t, it->second);
      run_end[docs[t]] = t + 1;
      if (docs[t] > INT32_MAX) fail("--doc-ids: {} is too large", docs[t]);
    }
  }

  // Before the model runs: the output's folder exists, and the output replaces no input.
  cli::check_output("--out", out, {model, vm.count("gates") ? gates_path : std::string()});
  auto ckpt = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(model));
  const int64_t V = ckpt->config().vocab_size;
  for (size_t t = 0; t < ids.size(); ++t)
    if (ids[t] < 0 || ids[t] >= V)
      fail("--ids: token id {} at position {} is outside the vocabulary [0, {}) of {}", ids[t], t, V, model);

  std::optional<gates::RetentionGates> gates;
  if (vm.count("gates")) gates = gates::load_gates(gates_path, ckpt->config(), gate_kind).gates;

  Tensor ids_t = Tensor::empty({static_cast<int64_t>(ids.size())}, DType::I32);
  Tensor doc_t = Tensor::empty({static_cast<int64_t>(ids.size())}, DType::I32);
  for (size_t t = 0; t < ids.size(); ++t) {
    ids_t.data<int32_t>()[t] = static_cast<int32_t>(ids[t]);
    doc_t.data<int32_t>()[t] = static_cast<int32_t>(std::max<int64_t>(docs[t], -1));
  }

  const auto start = std::chrono::steady_clock::now();
  auto seconds_since_start = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  // A real checkpoint on CPU can take minutes: on a terminal, show layers done and an ETA.
  LayerProgress progress;
  if (::isatty(STDERR_FILENO))
    progress = [&](int64_t done, int64_t total) {
      const double s = seconds_since_start();
      std::cerr << fmt::format("\rretain-forward: layer {}/{}  {:.1f} s  ETA {:.1f} s   ", done, total, s,
                               s / static_cast<double>(done) * static_cast<double>(total - done))
                << (done == total ? "\n" : "") << std::flush;
    };
  std::unique_ptr<WeightProvider> weights;
  if (dev == Device::CUDA) {
    bind_local_gpu();
    weights = std::make_unique<DeviceWeightProvider>(ckpt);
    if (gates) gates->sync_to_device();
  } else {
    weights = std::make_unique<LocalWeightProvider>(ckpt);
  }
  const Tensor hidden =
      qwen3_hidden(*weights, ids_t.to(dev), doc_t.to(dev), progress, gates ? &*gates : nullptr);
  ops::raise_deferred_checks();  // the device value checks of the forward (gates' logβ)

  std::map<std::string, std::string> meta = {
      {"producer", "retain-forward"}, {"model", model}, {"tokens", std::to_string(ids.size())}};
  if (gates) {
    meta["gates"] = gates_path;
    meta["gate_kind"] = gates::gate_kind_name(gates->kind());
  }
  // Logits 1024 rows at a time (qwen3_forward's GEMM, split by rows), with the greedy next
  // token per position: a quick human check that the output is sensible.
  constexpr int64_t kChunkRows = 1024;
  const int64_t T = static_cast<int64_t>(ids.size());
  std::vector<int64_t> argmax(ids.size());
  Tensor device_rows;
  formats::write_safetensors_rows(out, "logits", DType::F32, {T, V}, kChunkRows, [&](int64_t begin, int64_t end, Tensor& rows) {
    if (dev == Device::CPU) {
      ops::linear(hidden.rows(begin, end), weights->lm_head(), rows);
    } else {
      if (device_rows.numel() == 0) device_rows = Tensor::empty({std::min(T, kChunkRows), V}, DType::F32, dev);
      Tensor d = device_rows.rows(0, end - begin);
      ops::linear(hidden.rows(begin, end), weights->lm_head(), d);
      rows.copy_from(d);
    }
    for (int64_t t = begin; t < end; ++t) {
      const float* row = rows.data<float>() + (t - begin) * V;
      argmax[static_cast<size_t>(t)] = std::max_element(row, row + V) - row;
    }
  }, meta);
  const double ms = seconds_since_start() * 1000.0;
  const std::string student =
      gates ? fmt::format(", {} gates G={} from {}", gates::gate_kind_name(gates->kind()), gates->dims().gate_hidden,
                          gates_path)
            : "";
  std::cout << fmt::format("retain-forward: {} tokens through {} ({} layers{}) in {:.1f} ms on {}\n", ids.size(),
                           model, ckpt->config().num_hidden_layers, student, ms, device_name(dev))
            << fmt::format("wrote logits {} F32 to {}\n", shape_str({T, V}), out)
            << fmt::format("argmax next token per position: {}\n", fmt::join(argmax, " "));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return cli::run_tool("retain-forward", [&] { return run(argc, argv); });
}
