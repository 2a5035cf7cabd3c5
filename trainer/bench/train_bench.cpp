// retain-bench train (train_bench.h).
#include "trainer/bench/train_bench.h"

#include <algorithm>
#include <chrono>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "kernels/base/atomic_file.h"
#include "kernels/base/cli.h"
#include "kernels/bench/bench_common.h"
#include "kernels/cuda/memory.h"
#include "kernels/device.h"
#include "kernels/dist/comm.h"
#include "kernels/tensor.h"
#include "model/gates/gates.h"
#include "model/weights.h"
#include "trainer/flops.h"
#include "trainer/optim.h"
#include "trainer/step.h"
#include "trainer/update.h"
#include "trainer/weight_setup.h"

namespace retain::bench {

const char* const kTrainUsage =
    "Usage: retain-bench train --model DIR [--device cpu|cuda] [--seq 8192,32768] [--gate trimkv,dbtrimkv]\n"
    "                          [--docs 1] [--iters 3] [--warmup 1] [--gate-hidden 512] [--memory 128]\n"
    "                          [--seed 1] [--gate-init random|zero-output:B] [--dump-batch FILE]\n"
    "                          [--json FILE]\n\n"
    "Times retain's training step (trainer::compute_gradients, then retain-train's optimizer\n"
    "update, trainer/update.h) on the model in DIR, for every (--seq, --gate): fresh gates (--gate-init), one\n"
    "micro-batch of T random token ids (seeded by --seed and T, the same for every gate) split\n"
    "into --docs equal documents, every token a target; one rank. Weights:\n"
    "the mapped checkpoint on the CPU, the whole model resident on the GPU (bf16 matmuls) on\n"
    "CUDA. Each step starts from zeroed gradients; the gates keep training across iterations.\n"
    "Reported: the median over --iters timed steps after --warmup steps of the step time and of\n"
    "each phase (teacher, student, capacity, loss, backward: trainer::PhaseTimes, which\n"
    "synchronizes the device at every phase edge; optimizer: the gradients reduced over the\n"
    "one-rank world, AdamW, the values written back), tokens/s = T / step time, TFLOP/s and MFU (against the GPU's dense\n"
    "bf16 peak, trainer/flops.h; n/a on the CPU or an unknown GPU), peak memory (CUDA: the\n"
    "memory pool's high-water mark over the timed steps; CPU: the process's peak resident set\n"
    "so far, ru_maxrss) and the loss of the first step (KL/2 + NTP/2 + capacity at memory M).\n\n"
    "FLOPs (trainer/flops.h): a multiply-add is 2 FLOPs; matmuls only (norms, RoPE, softmax and\n"
    "elementwise work are not counted); attention counts the pairs it computes exactly: the sum\n"
    "over documents of n(n+1)/2 per head. A step is teacher forward + student forward (+ gate) +\n"
    "recompute + backward (activation-only: projections and MLP once more, attention 2.5x its\n"
    "forward, the gate twice) + loss (2*D*V per loss position for the teacher logits, the\n"
    "student logits and the hidden-state gradient).\n\n"
    "--gate-init random (default): bias 18, weights N(0, 0.02) (RetentionGates::init), so logβ ≈\n"
    "−1.5e-8 and the gates barely touch the loss. zero-output:B: the same, then the gate's output\n"
    "projection (trimkv: every layer's linear2.weight; dbtrimkv: the shared linear3.weight) set to\n"
    "zero and the bias b to B, so logβ = logsigmoid(B) for every token, head and layer whatever\n"
    "the other weights are (B = 2: logβ ≈ −0.127, a visible decay): a loss that any trainer with\n"
    "the same init reproduces without sharing random weights (trainer/bench/bench_reference.py\n"
    "--gate-init). The JSON's gate_init and the header say which.\n\n"
    "--json FILE: on CUDA every row also carries reserved_peak_gb (the most the pool held from the\n"
    "driver over the timed steps) and device_used_gb (the card's total minus free memory after them:\n"
    "the CUDA context and libraries' memory outside the pool included); both null on the CPU.\n"
    "Every row also carries its FLOPs by pass (flops: teacher, student, recompute,\n"
    "backward, loss, count_pass, total), the count its TFLOP/s divides.\n"
    "--dump-batch FILE writes the batches (per T: ids and document ids) as JSON, for the\n"
    "reference script trainer/bench/bench_reference.py to time the same tokens.";

namespace {

struct TrainRow {
  int64_t seq = 0;
  std::string gate;
  double step_ms = 0, teacher = 0, student = 0, capacity = 0, loss_ms = 0, backward = 0, optimizer = 0;
  double tokens_per_s = 0, tflops = 0;
  trainer::StepFlops flops;  // the step's FLOPs by pass (trainer/flops.h), what tflops divides
  std::optional<double> mfu;
  double peak_gb = 0;
  std::optional<double> reserved_peak_gb, device_used_gb;  // CUDA only: the pool's and the card's
  double first_loss = 0, kl = 0, ntp = 0, cap = 0;
};

// The benchmark's batch of T tokens: uniform random ids in [0, vocab) seeded by (seed, T),
// `docs` equal documents, every token a target.
trainer::MicroBatch bench_batch(int64_t T, int64_t docs, int64_t vocab, uint64_t seed) {
  trainer::MicroBatch mb;
  mb.ids = Tensor::empty({T}, DType::I32);
  mb.doc = Tensor::empty({T}, DType::I32);
  mb.target_mask = Tensor::empty({T}, DType::U8);
  Rng rng{seed * 0x100000001b3ull + static_cast<uint64_t>(T)};
  for (int64_t t = 0; t < T; ++t) {
    mb.ids.data<int32_t>()[t] = static_cast<int32_t>(rng.next() % static_cast<uint64_t>(vocab));
    mb.doc.data<int32_t>()[t] = static_cast<int32_t>(t / (T / docs));
    mb.target_mask.data<uint8_t>()[t] = 1;
  }
  return mb;
}

// --gate-init: "random" (RetentionGates::init at bias 18) or "zero-output:B" (the output
// projection zeroed, the bias b = B: logβ = logsigmoid(B) everywhere).
struct GateInit {
  bool zero_output = false;
  double bias = 18.0;
  std::string name() const { return zero_output ? fmt::format("zero-output:{}", bias) : "random"; }
};

GateInit parse_gate_init(const std::string& text) {
  if (text == "random") return {};
  const std::string prefix = "zero-output:";
  if (text.rfind(prefix, 0) == 0) {
    const std::string value = text.substr(prefix.size());
    char* end = nullptr;
    const double b = value.empty() || std::isspace(static_cast<unsigned char>(value[0]))
                         ? std::nan("")
                         : std::strtod(value.c_str(), &end);
    if (end == value.c_str() + value.size() && std::isfinite(b)) return {true, b};
  }
  throw cli::UsageError(fmt::format(
      "--gate-init: '{}' is not random or zero-output:B (B a finite number, e.g. zero-output:2)", text));
}

// Fresh gates as --gate-init says: init(bias), then for zero-output every output-projection
// weight (trimkv: each layer's linear2.weight [K, G]; dbtrimkv: the one shared linear3.weight
// [K, G]; DESIGN §4 names) set to zero.
gates::RetentionGates fresh_gates(const gates::GateDims& dims, const GateInit& init, uint64_t seed) {
  gates::RetentionGates g = gates::RetentionGates::init(dims, init.bias, seed);
  if (!init.zero_output) return g;
  const std::string suffix =
      dims.kind == gates::GateKind::trimkv ? ".retention_gate.linear2.weight" : ".retention_gate.linear3.weight";
  int64_t zeroed = 0;
  for (Parameter& p : g.parameters()) {
    if (!p.name().ends_with(suffix)) continue;
    RETAIN_CHECK(p.value.ndim() == 2 && p.value.dim(0) == dims.kv_heads, "gate output weight {} has shape {}", p.name(),
                 shape_str(p.value.shape()));
    std::fill_n(p.value.data<float>(), p.value.numel(), 0.0f);
    ++zeroed;
  }
  const int64_t want = dims.kind == gates::GateKind::trimkv ? dims.layers : 1;
  RETAIN_CHECK(zeroed == want, "--gate-init {}: zeroed {} output weights of {} gates, expected {}", init.name(),
               zeroed, gates::gate_kind_name(dims.kind), want);
  return g;
}

}  // namespace

int train_bench(int argc, char** argv) {
  cli::po::options_description opts("Options of retain-bench train");
  std::string model_dir, device_arg, seq_text, gate_text, json_path, dump_path, gate_init_text;
  int64_t docs = 0, gate_hidden = 0;
  double memory = 0;
  uint64_t seed = 0;
  int iters = 0, warmup = 0;
  opts.add_options()
      ("model", cli::po::value(&model_dir), "the model directory (config.json, *.safetensors)")
      ("device", cli::po::value(&device_arg), "cuda or cpu (default: $RETAIN_DEVICE, else cuda when a GPU is visible, else cpu)")
      ("seq", cli::po::value(&seq_text), "sequence lengths T, comma-separated (default: 8192,32768 on cuda, 256 on cpu)")
      ("gate", cli::po::value(&gate_text)->default_value("trimkv,dbtrimkv"), "gate kinds, comma-separated")
      ("docs", cli::po::value(&docs)->default_value(1), "equal-length documents per sequence")
      ("gate-hidden", cli::po::value(&gate_hidden)->default_value(512), "the gates' hidden width G")
      ("memory", cli::po::value(&memory)->default_value(128), "memory M of the capacity loss (retain-train's default)")
      ("seed", cli::po::value(&seed)->default_value(1), "seed of the token ids and the gates")
      ("gate-init", cli::po::value(&gate_init_text)->default_value("random"),
       "random (bias 18, weights N(0, 0.02)) or zero-output:B (output weights 0, bias B; see above)")
      ("iters", cli::po::value(&iters)->default_value(3), "timed steps per row, median reported")
      ("warmup", cli::po::value(&warmup)->default_value(1), "untimed steps before them")
      ("dump-batch", cli::po::value(&dump_path), "write the batches (ids, document ids per T) as JSON to FILE")
      ("json", cli::po::value(&json_path), "also write the results as JSON to FILE (atomically)");
  cli::po::variables_map vm;
  if (!cli::parse(argc, argv, kTrainUsage, opts, vm)) return 0;

  if (model_dir.empty()) throw cli::UsageError("--model DIR is required");
  if (!device_arg.empty() && device_arg != "cuda" && device_arg != "cpu")
    throw cli::UsageError(fmt::format("--device must be cuda or cpu, got '{}'", device_arg));
  if (docs <= 0) throw cli::UsageError("--docs must be positive");
  if (gate_hidden <= 0) throw cli::UsageError("--gate-hidden must be positive");
  if (!(memory > 0)) throw cli::UsageError("--memory must be positive");
  if (iters <= 0 || warmup < 0) throw cli::UsageError("--iters must be positive and --warmup not negative");
  const GateInit gate_init = parse_gate_init(gate_init_text);
  std::vector<gates::GateKind> kinds;
  for (const std::string& g : split_list(gate_text)) {
    if (g != "trimkv" && g != "dbtrimkv")
      throw cli::UsageError(fmt::format("--gate: '{}' is not a gate kind (trimkv, dbtrimkv)", g));
    kinds.push_back(gates::parse_gate_kind(g, "--gate"));
  }
  const Device device = resolve_device(device_arg);
  const bool on_gpu = device == Device::CUDA;
  if (seq_text.empty()) seq_text = on_gpu ? "8192,32768" : "256";
  const std::vector<int64_t> lengths = parse_lengths(seq_text);
  for (int64_t T : lengths)
    if (T % docs != 0) throw cli::UsageError(fmt::format("--seq {} is not a multiple of --docs {}", T, docs));
  if (!json_path.empty()) cli::check_output("--json", json_path, {model_dir});  // before minutes of timing
  if (!dump_path.empty()) cli::check_output("--dump-batch", dump_path, {model_dir});

  const auto model = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(model_dir));
  const Qwen3Config& mc = model->config();
  for (int64_t T : lengths)
    if (T > mc.max_position_embeddings)
      fail("--seq {} exceeds the model's max_position_embeddings {} ({}/config.json)", T, mc.max_position_embeddings,
           model_dir);

  // The trainer's own weights for a one-rank world: the whole model on this device.
  const std::unique_ptr<dist::Comm> comm = dist::make_local_comm();
  const std::unique_ptr<WeightProvider> weights =
      trainer::make_step_weights(model, device, *comm, /*force_gather=*/false).weights;
  const std::string device_line = on_gpu ? cuda::device_name() : "cpu";
  std::optional<double> peak_tflops;
  if (on_gpu) peak_tflops = trainer::bf16_peak_tflops(device_line);
  trainer::LossConfig loss_cfg;
  loss_cfg.memory = memory;

  std::vector<trainer::MicroBatch> batches;
  for (int64_t T : lengths) batches.push_back(bench_batch(T, docs, mc.vocab_size, seed));
  if (!dump_path.empty()) {
    nlohmann::json j{{"tool", "retain-bench train"}, {"model", model_dir}, {"vocab_size", mc.vocab_size},
                     {"seed", seed}, {"docs", docs}, {"batches", nlohmann::json::array()}};
    for (const trainer::MicroBatch& mb : batches) {
      const int64_t T = mb.ids.numel();
      std::vector<int32_t> ids(mb.ids.data<int32_t>(), mb.ids.data<int32_t>() + T),
          doc(mb.doc.data<int32_t>(), mb.doc.data<int32_t>() + T);
      j["batches"].push_back({{"seq", T}, {"ids", ids}, {"doc", doc}});
    }
    write_file_atomic(dump_path, j.dump() + "\n");
    std::cerr << "retain-bench: wrote the batches to " << dump_path << "\n";
  }

  std::cout << fmt::format(
      "retain-bench train on {}: {} (L {} D {} H {} K {} d {} V {}), G {} docs {} M {}, median of {} after {} warm-up\n"
      "gates: --gate-init {} ({})\n",
      device_line, model_dir, mc.num_hidden_layers, mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads,
      mc.head_dim, mc.vocab_size, gate_hidden, docs, memory, iters, warmup, gate_init.name(),
      gate_init.zero_output
          ? fmt::format("output weights 0, bias {}: logβ = {:.6g} for every token", gate_init.bias,
                        static_cast<double>(gates::log_sigmoid(static_cast<float>(gate_init.bias))))
          : std::string("bias 18, weights N(0, 0.02)"));
  const std::string header =
      fmt::format("{:>7} {:<8} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>8} {:>6} {:>8} {:>10}\n", "seq",
                  "gate", "step ms", "teacher", "student", "capacity", "loss", "backward", "optim", "tokens/s",
                  "TFLOP/s", "MFU", "peak GB", "loss@1");
  std::cout << header << std::flush;

  std::vector<TrainRow> rows;
  for (size_t b = 0; b < lengths.size(); ++b) {
    const int64_t T = lengths[b];
    const std::vector<trainer::MicroBatch> mbs = {batches[b]};
    for (gates::GateKind kind : kinds) {
      const gates::GateDims dims{kind, mc.num_hidden_layers, mc.hidden_size, gate_hidden, mc.num_key_value_heads};
      gates::RetentionGates gates = fresh_gates(dims, gate_init, seed);
      // retain-train's update (trainer/update.h) at AdamW's default rate, without clipping.
      trainer::ShardedUpdate update(gates, *comm, trainer::AdamWConfig{});
      const trainer::StepFlops step_flops = trainer::step_flops(mc, dims, trainer::micro_batch_shapes(mbs));
      const double flops = step_flops.total();

      TrainRow row;
      row.flops = step_flops;
      row.seq = T;
      row.gate = std::string(gates::gate_kind_name(kind));
      std::vector<double> step_ms, ph[6];
      for (int it = 0; it < warmup + iters; ++it) {
        if (it == warmup && on_gpu) cuda::reset_device_memory_peak();
        std::cerr << fmt::format("retain-bench: T={} {}: {} {}/{}\n", T, row.gate, it < warmup ? "warm-up" : "step",
                                 it < warmup ? it + 1 : it - warmup + 1, it < warmup ? warmup : iters)
                  << std::flush;
        trainer::PhaseTimes times;
        const auto t0 = std::chrono::steady_clock::now();
        gates.zero_grad();
        const trainer::StepLosses losses = trainer::compute_gradients(*weights, gates, mbs, loss_cfg, *comm, nullptr, &times);
        const auto t1 = std::chrono::steady_clock::now();
        update.reduce_gradients();
        update.apply(trainer::AdamWConfig{}.lr, /*clip=*/0);
        const auto t2 = std::chrono::steady_clock::now();
        if (it == 0) {
          row.first_loss = losses.total(loss_cfg);
          row.kl = losses.kl();
          row.ntp = losses.ntp();
          row.cap = losses.cap();
        }
        const double opt = std::chrono::duration<double, std::milli>(t2 - t1).count();
        const double phase[6] = {times.teacher * 1e3, times.student * 1e3, times.capacity * 1e3,
                                 times.loss * 1e3,    times.backward * 1e3, opt};
        // Each step's time and phases as it ends, on stderr: a run cut short (a device call's
        // deadline, Ctrl-C) still tells where a long step's time went.
        std::cerr << fmt::format("retain-bench: T={} {}: {} {} took {:.2f} s (teacher {:.2f}, student {:.2f}, "
                                 "capacity {:.2f}, loss {:.2f}, backward {:.2f}, optimizer {:.2f})\n",
                                 T, row.gate, it < warmup ? "warm-up" : "step", it < warmup ? it + 1 : it - warmup + 1,
                                 std::chrono::duration<double>(t2 - t0).count(), phase[0] / 1e3, phase[1] / 1e3,
                                 phase[2] / 1e3, phase[3] / 1e3, phase[4] / 1e3, phase[5] / 1e3)
                  << std::flush;
        if (it < warmup) continue;
        step_ms.push_back(std::chrono::duration<double, std::milli>(t2 - t0).count());
        for (int p = 0; p < 6; ++p) ph[p].push_back(phase[p]);
      }
      row.step_ms = median_of(step_ms);
      row.teacher = median_of(ph[0]);
      row.student = median_of(ph[1]);
      row.capacity = median_of(ph[2]);
      row.loss_ms = median_of(ph[3]);
      row.backward = median_of(ph[4]);
      row.optimizer = median_of(ph[5]);
      row.tokens_per_s = static_cast<double>(T) / (row.step_ms * 1e-3);
      row.tflops = flops / (row.step_ms * 1e-3) / 1e12;
      if (peak_tflops) row.mfu = row.tflops / *peak_tflops;
      if (on_gpu) {
        const cuda::DeviceMemoryStats mem = cuda::device_memory_stats();
        row.peak_gb = static_cast<double>(mem.peak) / 1e9;
        row.reserved_peak_gb = static_cast<double>(mem.reserved_peak) / 1e9;
        row.device_used_gb = static_cast<double>(mem.device_used) / 1e9;
      } else {
        row.peak_gb = peak_rss_gb();
      }
      std::cout << fmt::format(
                       "{:>7} {:<8} {:>10.2f} {:>9.2f} {:>9.2f} {:>9.2f} {:>9.2f} {:>9.2f} {:>9.2f} {:>10.1f} {:>8.4g} "
                       "{:>6} {:>8.3f} {:>10.5f}\n",
                       row.seq, row.gate, row.step_ms, row.teacher, row.student, row.capacity, row.loss_ms,
                       row.backward, row.optimizer, row.tokens_per_s, row.tflops,
                       row.mfu ? fmt::format("{:.1f}%", 100.0 * *row.mfu) : std::string("n/a"), row.peak_gb,
                       row.first_loss)
                << std::flush;
      rows.push_back(std::move(row));
    }
  }

  if (!json_path.empty()) {
    nlohmann::json j;
    j["tool"] = "retain-bench train";
    j["date"] = utc_now();
    j["device"] = device_line;
    j["model"] = model_dir;
    j["docs"] = docs;
    j["gate_hidden"] = gate_hidden;
    j["memory"] = memory;
    j["seed"] = seed;
    j["gate_init"] = gate_init.name();
    j["iters"] = iters;
    j["warmup"] = warmup;
    j["peak_tflops"] = peak_tflops ? nlohmann::json(*peak_tflops) : nlohmann::json(nullptr);
    j["flops"] = "trainer/flops.h: multiply-add = 2 FLOPs, matmuls only, attention pairs n(n+1)/2 per document";
    j["rows"] = nlohmann::json::array();
    for (const TrainRow& r : rows) {
      j["rows"].push_back({{"seq", r.seq},
                           {"gate", r.gate},
                           {"step_ms", r.step_ms},
                           {"phase_ms",
                            {{"teacher", r.teacher},
                             {"student", r.student},
                             {"capacity", r.capacity},
                             {"loss", r.loss_ms},
                             {"backward", r.backward},
                             {"optimizer", r.optimizer}}},
                           {"tokens_per_s", r.tokens_per_s},
                           {"tflops", r.tflops},
                           {"flops",
                            {{"teacher", r.flops.teacher},
                             {"student", r.flops.student},
                             {"recompute", r.flops.recompute},
                             {"backward", r.flops.backward},
                             {"loss", r.flops.loss},
                             {"count_pass", r.flops.count_pass},
                             {"total", r.flops.total()}}},
                           {"mfu", r.mfu ? nlohmann::json(*r.mfu) : nlohmann::json(nullptr)},
                           {"peak_gb", r.peak_gb},
                           {"reserved_peak_gb", r.reserved_peak_gb ? nlohmann::json(*r.reserved_peak_gb)
                                                                   : nlohmann::json(nullptr)},
                           {"device_used_gb", r.device_used_gb ? nlohmann::json(*r.device_used_gb)
                                                               : nlohmann::json(nullptr)},
                           {"first_loss", r.first_loss},
                           {"first_kl", r.kl},
                           {"first_ntp", r.ntp},
                           {"first_cap", r.cap}});
    }
    write_file_atomic(json_path, j.dump(2) + "\n");
    std::cout << "wrote " << json_path << "\n";
  }
  return 0;
}

}  // namespace retain::bench
