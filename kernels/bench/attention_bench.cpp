// retain-bench attention (kernel_benches.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "kernels/base/atomic_file.h"
#include "kernels/base/cli.h"
#include "kernels/bench/bench_common.h"
#include "kernels/bench/kernel_benches.h"
#include "kernels/cuda/memory.h"
#include "kernels/deferred_checks.h"
#include "kernels/ops.h"
#include "kernels/retention.h"
#include "kernels/tensor.h"

namespace retain::bench {

const char* const kAttentionUsage =
    "Usage: retain-bench attention [--device cuda|cpu] [--seq 8192,32768,131072] [--heads 32]\n"
    "                              [--kv-heads 8] [--head-dim 128] [--docs 1] [--layers 1]\n"
    "                              [--logbeta initial|trained-like] [--capacity-skip E]\n"
    "                              [--iters N] [--warmup N] [--json FILE]\n\n"
    "Times retention-gated attention (ops::gated_attention and its backward) forward, backward\n"
    "and forward+backward, and the capacity loss forward+backward (ops::capacity_loss +\n"
    "capacity_loss_backward, local hinge) for --layers layers of logβ [L, T, K], per sequence\n"
    "length. CUDA: bf16 q, k, v, out, dout, dq, dk, dv; fp32 logβ, lse, dlogβ; timed with CUDA\n"
    "events around the calls (the ops' input checks included: the trainer pays them too). CPU:\n"
    "float32, timed with steady_clock. The median of --iters timed runs after --warmup runs.\n\n"
    "Inputs: q, k, v, dout ~ N(0, 1); --docs equal-length documents; memory M = 1024 for the\n"
    "hinge; logβ by --logbeta:\n"
    "  initial       logsigmoid(18 + 0.5·N(0, 1)): gates at their initial bias, every key decays\n"
    "                by < 1e-7 per token, so no capacity tile is skippable (the dense worst case);\n"
    "  trained-like  a synthetic stand-in for trained gates after the TRIM-KV paper's figures\n"
    "                (sliding windows of varying width in many heads, a few tokens kept long in\n"
    "                others), drawn per (layer, KV head): half are window heads, every key with\n"
    "                lifetime h·e^(0.3·N(0,1)) for one h = 2^U(4,10) (16 to 1024 tokens); half are\n"
    "                selective heads, each key short-lived (2^U(3,6) tokens) except one in 32\n"
    "                kept long (2^U(13,20) tokens). logβ = −1/lifetime. Capacity tiles whose\n"
    "                every term is below e^-60 are skipped (exact to float rounding): the CUDA\n"
    "                kernels decide per head and 128-key tile, so window heads skip most tiles at\n"
    "                long T while a selective head's few long keys keep their own; the CPU\n"
    "                reference decides per 64-key block over all heads and skips little of it.\n"
    "                Attention costs the same either way.\n"
    "--capacity-skip E (default 60, exact) skips capacity tiles below e^-E instead: a smaller E\n"
    "is retain-train's opt-in approximation (kernels/retention.h states its error bound).\n"
    "RETAIN_ATTENTION_FORWARD and RETAIN_ATTENTION_BACKWARD pick the CUDA kernels of each pass:\n"
    "wgmma (Hopper's warpgroup products, sm_90 only), mma (mma.sync) or auto (unset: wgmma on an\n"
    "sm_90 GPU, else mma); the JSON records which ran.\n\n"
    "FLOPs (the FlashAttention benchmarks' convention): a causal forward counts T²/2 query-key\n"
    "pairs per head — the diagonal counted half; the exact T(T+1)/2 is T/2 pairs more, 0.006%\n"
    "at T = 8192 — with D documents T²/(2D); each pair costs two d-length dot products (q·k and\n"
    "p·v) of 2·d FLOPs: fwd = 4·(T²/2D)·H·d, bwd = 2.5·fwd (five matmuls), fwd+bwd = 3.5·fwd.\n"
    "The capacity rows report time only, and its share of gated fwd+bwd per layer.";

namespace {

// logβ [L, T, K] of gates at their initial bias: logsigmoid(x) = −log1p(e^−x), x = 18 + 0.5·N(0, 1).
Tensor initial_log_beta(int64_t L, int64_t T, int64_t K) {
  Tensor lb = random_tensor({L, T, K}, DType::F32, Device::CPU, 5, 18.0f, 0.5f);
  for (int64_t x = 0; x < lb.numel(); ++x) {
    float& y = lb.data<float>()[x];
    y = static_cast<float>(-std::log1p(std::exp(-static_cast<double>(y))));
  }
  return lb;
}

// logβ [L, T, K] = −1/lifetime of the --logbeta trained-like profile (kAttentionUsage): per (layer, KV
// head) a window head (one width, jittered per key) or a selective head (short-lived keys, one in
// 32 long-lived).
Tensor trained_like_log_beta(int64_t L, int64_t T, int64_t K) {
  Tensor lb = Tensor::empty({L, T, K}, DType::F32);
  float* out = lb.data<float>();
  for (int64_t l = 0; l < L; ++l)
    for (int64_t h = 0; h < K; ++h) {
      Rng rng{0x5eed0000ull + static_cast<uint64_t>(l * K + h)};
      const bool window = rng.uniform() < 0.5;
      const double width = std::exp2(4.0 + 6.0 * rng.uniform());
      for (int64_t t = 0; t < T; ++t) {
        double lifetime = 0;
        if (window)
          lifetime = width * std::exp(0.3 * rng.normal());
        else if (rng.uniform() < 1.0 / 32.0)
          lifetime = std::exp2(13.0 + 7.0 * rng.uniform());
        else
          lifetime = std::exp2(3.0 + 3.0 * rng.uniform());
        out[(l * T + t) * K + h] = static_cast<float>(-1.0 / lifetime);
      }
    }
  return lb;
}

struct Row {
  int64_t seq;
  std::string op;
  double ms;
  double tflops;  // < 0: not a FLOP-counted row
  double share;   // capacity: fraction of gated fwd+bwd per layer; < 0 otherwise
};

}  // namespace

int attention_bench(int argc, char** argv) {
  cli::po::options_description opts("Options of retain-bench attention");
  std::string device_name_arg, seq_text, json_path, logbeta;
  double capacity_skip = ops::kExactSkipExponent;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, docs = 0, layers = 0;
  int iters = 0, warmup = 0;
  opts.add_options()
      ("device", cli::po::value(&device_name_arg), "cuda or cpu (default: cuda when a GPU is visible, else cpu)")
      ("seq", cli::po::value(&seq_text), "sequence lengths T, comma-separated (default: 8192,32768,131072 on cuda, 1024 on cpu)")
      ("heads", cli::po::value(&heads)->default_value(32), "query heads H")
      ("kv-heads", cli::po::value(&kv_heads)->default_value(8), "KV heads K (H % K == 0)")
      ("head-dim", cli::po::value(&head_dim)->default_value(128), "head_dim d")
      ("docs", cli::po::value(&docs)->default_value(1), "equal-length documents per sequence")
      ("layers", cli::po::value(&layers)->default_value(1), "layers L of the capacity run")
      ("logbeta", cli::po::value(&logbeta)->default_value("initial"), "initial or trained-like (see above)")
      ("capacity-skip", cli::po::value(&capacity_skip)->default_value(ops::kExactSkipExponent),
       "E: skip capacity tiles whose every term is below e^-E (60: exact)")
      ("iters", cli::po::value(&iters), "timed runs per row, median reported (default: 10 on cuda, 3 on cpu)")
      ("warmup", cli::po::value(&warmup), "untimed runs before them (default: 2 on cuda, 1 on cpu)")
      ("json", cli::po::value(&json_path), "also write the results as JSON to FILE (atomically)");
  cli::po::variables_map vm;
  if (!cli::parse(argc, argv, kAttentionUsage, opts, vm)) return 0;

  // Defaults that fit the device: the Qwen3-4B lengths on a GPU, a length the CPU reference
  // times in seconds on the CPU.
  if (device_name_arg.empty()) device_name_arg = cuda_built() && cuda_device_count() > 0 ? "cuda" : "cpu";
  const bool on_gpu = device_name_arg == "cuda";
  if (seq_text.empty()) seq_text = on_gpu ? "8192,32768,131072" : "1024";
  if (!vm.count("iters")) iters = on_gpu ? 10 : 3;
  if (!vm.count("warmup")) warmup = on_gpu ? 2 : 1;
  const std::vector<int64_t> lengths = parse_lengths(seq_text);
  if (!json_path.empty()) cli::check_output("--json", json_path);  // before minutes of timing, not after
  if (heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0)
    throw cli::UsageError(fmt::format("--heads {} must be a positive multiple of --kv-heads {}", heads, kv_heads));
  if (head_dim <= 0) throw cli::UsageError("--head-dim must be positive");
  if (docs <= 0 || layers <= 0) throw cli::UsageError("--docs and --layers must be positive");
  if (iters <= 0 || warmup < 0) throw cli::UsageError("--iters must be positive and --warmup not negative");
  for (int64_t T : lengths)
    if (T % docs != 0) throw cli::UsageError(fmt::format("--seq {} is not a multiple of --docs {}", T, docs));
  if (device_name_arg != "cuda" && device_name_arg != "cpu")
    throw cli::UsageError(fmt::format("--device must be cuda or cpu, got '{}'", device_name_arg));
  if (!(capacity_skip > 0) || !std::isfinite(capacity_skip))
    throw cli::UsageError(fmt::format("--capacity-skip must be a finite number > 0, got {}", capacity_skip));
  if (logbeta != "initial" && logbeta != "trained-like")
    throw cli::UsageError(fmt::format("--logbeta must be initial or trained-like, got '{}'", logbeta));
  const Device device = device_name_arg == "cuda" ? Device::CUDA : Device::CPU;
  if (device == Device::CUDA && !cuda_built())
    fail("--device cuda: this build of retain has no CUDA support; use --device cpu");
  if (device == Device::CUDA && cuda_device_count() == 0)
    fail("--device cuda: no CUDA device is visible; use --device cpu");

  const DType act = device == Device::CUDA ? DType::BF16 : DType::F32;
  const int64_t H = heads, K = kv_heads, d = head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  Timer timer(device);
  std::vector<Row> rows;
  std::cout << fmt::format(
      "retain-bench attention on {}: H {} K {} d {} docs {} capacity layers {}, logβ {}, skip e^-{}, median of {}\n",
      device_name_arg, H, K, d, docs, layers, logbeta, capacity_skip, iters);
  std::cout << fmt::format("{:>8}  {:<26} {:>11} {:>9}\n", "seq", "op", "ms", "TFLOP/s");

  for (int64_t T : lengths) {
    const Tensor q = random_tensor({T, H, d}, act, device, 1);
    const Tensor k = random_tensor({T, K, d}, act, device, 2);
    const Tensor v = random_tensor({T, K, d}, act, device, 3);
    const Tensor dout = random_tensor({T, H, d}, act, device, 4);
    const Tensor lb_host = logbeta == "initial" ? initial_log_beta(layers, T, K) : trained_like_log_beta(layers, T, K);
    Tensor doc_host = Tensor::empty({T}, DType::I32);
    for (int64_t t = 0; t < T; ++t) doc_host.data<int32_t>()[t] = static_cast<int32_t>(t / (T / docs));
    const Tensor pos = ops::document_positions(doc_host).on(device);
    const Tensor doc = doc_host.on(device);
    const Tensor lb_all = lb_host.on(device);
    const Tensor lb = lb_host.rows(0, 1).reshape({T, K}).on(device);  // layer 0 for attention

    Tensor out = Tensor::empty({T, H, d}, act, device), lse = Tensor::empty({T, H}, DType::F32, device);
    Tensor dq = Tensor::empty({T, H, d}, act, device), dk = Tensor::empty({T, K, d}, act, device),
           dv = Tensor::empty({T, K, d}, act, device), dlb = Tensor::empty({T, K}, DType::F32, device);
    Tensor dlb_all = Tensor::empty({layers, T, K}, DType::F32, device);

    auto fwd = [&] { ops::gated_attention(q, k, v, lb, doc, scale, out, lse); };
    auto bwd = [&] { ops::gated_attention_backward(q, k, v, lb, doc, scale, out, lse, dout, dq, dk, dv, dlb); };
    const double memory = 1024;
    auto capacity = [&] {
      const ops::CapacityLoss loss =
          ops::capacity_loss(lb_all, doc, pos, memory, ops::CapacityMode::local, capacity_skip);
      const double s = loss.positive > 0 ? 1.0 / static_cast<double>(loss.positive) : 0.0;
      ops::capacity_loss_backward(lb_all, doc, pos, memory, ops::CapacityMode::local, s, dlb_all, capacity_skip);
    };

    const double pairs = static_cast<double>(T) * static_cast<double>(T) / (2.0 * static_cast<double>(docs));
    const double fwd_flops = 4.0 * pairs * static_cast<double>(H * d);
    // Progress on stderr (the table is stdout): one line before each measurement.
    auto timed = [&](const char* what, const std::function<void()>& fn) {
      std::cerr << fmt::format("retain-bench: T={} {}: {} warm-up + {} timed runs\n", T, what, warmup, iters)
                << std::flush;
      return median_ms(timer, warmup, iters, fn);
    };
    fwd();  // out and lse for the backward
    const double f_ms = timed("gated fwd", fwd);
    const double b_ms = timed("gated bwd", bwd);
    const double fb_ms = timed("gated fwd+bwd", [&] {
      fwd();
      bwd();
    });
    const double c_ms = timed("capacity fwd+bwd", capacity);
    ops::raise_deferred_checks();  // the device value checks of every timed call
    const double per_layer = c_ms / static_cast<double>(layers);
    auto tf = [](double flops, double ms) { return flops / (ms * 1e-3) / 1e12; };
    rows.push_back({T, "gated fwd", f_ms, tf(fwd_flops, f_ms), -1});
    rows.push_back({T, "gated bwd", b_ms, tf(2.5 * fwd_flops, b_ms), -1});
    rows.push_back({T, "gated fwd+bwd", fb_ms, tf(3.5 * fwd_flops, fb_ms), -1});
    rows.push_back({T, fmt::format("capacity fwd+bwd (L={})", layers), c_ms, -1, -1});
    rows.push_back({T, "capacity fwd+bwd per layer", per_layer, -1, per_layer / fb_ms});
    for (size_t r = rows.size() - 5; r < rows.size(); ++r) {
      const Row& row = rows[r];
      std::string extra = row.share >= 0 ? fmt::format("   {:.2f}% of gated fwd+bwd", 100.0 * row.share) : "";
      std::cout << fmt::format("{:>8}  {:<26} {:>11.3f} {:>9}{}\n", row.seq, row.op, row.ms,
                               row.tflops >= 0 ? fmt::format("{:.4g}", row.tflops) : "-", extra)
                << std::flush;
    }
  }

  if (!json_path.empty()) {
    nlohmann::json j;
    const std::time_t now = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    j["tool"] = "retain-bench attention";
    j["date"] = date;
    j["device"] = device_name_arg;
    j["attention_forward"] = on_gpu ? ops::cuda_attention_kernels(false) : "cpu";
    j["attention_backward"] = on_gpu ? ops::cuda_attention_kernels(true) : "cpu";
    j["heads"] = H;
    j["kv_heads"] = K;
    j["head_dim"] = d;
    j["docs"] = docs;
    j["capacity_layers"] = layers;
    j["logbeta"] = logbeta;
    j["capacity_skip"] = capacity_skip;
    j["iters"] = iters;
    j["warmup"] = warmup;
    j["flops"] = "fwd = 4*(T^2/(2*docs))*H*d, bwd = 2.5*fwd, fwd+bwd = 3.5*fwd";
    j["rows"] = nlohmann::json::array();
    for (const Row& r : rows) {
      nlohmann::json row{{"seq", r.seq}, {"op", r.op}, {"ms", r.ms}};
      if (r.tflops >= 0) row["tflops"] = r.tflops;
      if (r.share >= 0) row["share_of_gated_fwd_bwd"] = r.share;
      j["rows"].push_back(row);
    }
    write_file_atomic(json_path, j.dump(2) + "\n");
    std::cout << "wrote " << json_path << "\n";
  }
  return 0;
}

}  // namespace retain::bench
