// retain-bench: microbenchmarks of retain's kernels (docs/benchmarks.md, "Attention kernels").
//   retain-bench attention: retention-gated attention forward, backward, forward+backward and
//   the capacity loss forward+backward, through the public ops (kernels/retention.h), with the
//   dtypes the trainer uses: on CUDA bf16 q/k/v/o (fp32 logβ, lse), on CPU float32.
//   retain-bench gemm: ops::linear and linear_backward_input on Qwen3-4B's projection shapes,
//   F32 and BF16 weights (cuBLASLt on CUDA, OpenBLAS on CPU).
//   retain-bench train: retain's whole training step (trainer/step.h + AdamW) on a model
//   directory, per phase, with tokens/s, TFLOP/s, MFU, peak memory and the first step's loss.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "kernels/base/atomic_file.h"
#include "kernels/base/cli.h"
#include "kernels/cuda/memory.h"
#include "kernels/deferred_checks.h"
#include "kernels/ops.h"
#include "kernels/retention.h"
#include "kernels/tensor.h"
#include "kernels/device.h"
#include "model/device_weights.h"
#include "model/gates/gates.h"
#include "model/weights.h"
#include "kernels/dist/comm.h"
#include "trainer/flat_params.h"
#include "trainer/flops.h"
#include "trainer/optim.h"
#include "trainer/step.h"

#ifdef RETAIN_BENCH_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/check.h"
#endif

using namespace retain;

namespace {

constexpr const char* kUsage =
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
    "RETAIN_ATTENTION_FORWARD=wgmma and RETAIN_ATTENTION_BACKWARD=wgmma time the CUDA forward and\n"
    "backward on Hopper's wgmma (sm_90 only, not yet run on a GPU) instead of the default\n"
    "mma.sync kernels (=mma); the JSON records which.\n\n"
    "FLOPs (the FlashAttention benchmarks' convention): a causal forward counts T²/2 query-key\n"
    "pairs per head — the diagonal counted half; the exact T(T+1)/2 is T/2 pairs more, 0.006%\n"
    "at T = 8192 — with D documents T²/(2D); each pair costs two d-length dot products (q·k and\n"
    "p·v) of 2·d FLOPs: fwd = 4·(T²/2D)·H·d, bwd = 2.5·fwd (five matmuls), fwd+bwd = 3.5·fwd.\n"
    "The capacity rows report time only, and its share of gated fwd+bwd per layer.";

// splitmix64: a fast, seedable generator (the inputs only need to be generic, not statistical).
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }
  float normal() {  // Box–Muller, one of the pair
    return static_cast<float>(std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform()));
  }
};

uint16_t bf16_bits(float f) {  // round to nearest even (inputs are finite)
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// A tensor of N(mean, std) values in `dtype` (F32 or BF16) on `device`; filled on the host in
// parallel chunks with independent seeds.
Tensor random_tensor(const Shape& shape, DType dtype, Device device, uint64_t seed, float mean = 0, float std = 1) {
  Tensor host = Tensor::empty(shape, dtype);
  const int64_t n = host.numel(), chunk = 1 << 20;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < (n + chunk - 1) / chunk; ++c) {
    Rng rng{seed * 0x100000001b3ull + static_cast<uint64_t>(c)};
    for (int64_t x = c * chunk; x < std::min(n, (c + 1) * chunk); ++x) {
      const float v = mean + std * rng.normal();
      if (dtype == DType::BF16)
        static_cast<uint16_t*>(host.raw())[x] = bf16_bits(v);
      else
        host.data<float>()[x] = v;
    }
  }
  return host.on(device);
}

// logβ [L, T, K] of gates at their initial bias: logsigmoid(x) = −log1p(e^−x), x = 18 + 0.5·N(0, 1).
Tensor initial_log_beta(int64_t L, int64_t T, int64_t K) {
  Tensor lb = random_tensor({L, T, K}, DType::F32, Device::CPU, 5, 18.0f, 0.5f);
  for (int64_t x = 0; x < lb.numel(); ++x) {
    float& y = lb.data<float>()[x];
    y = static_cast<float>(-std::log1p(std::exp(-static_cast<double>(y))));
  }
  return lb;
}

// logβ [L, T, K] = −1/lifetime of the --logbeta trained-like profile (kUsage): per (layer, KV
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

// Milliseconds of one call of fn: CUDA events on the GPU, steady_clock on the CPU.
class Timer {
 public:
  explicit Timer(Device device) : device_(device) {
#ifdef RETAIN_BENCH_CUDA
    if (device_ == Device::CUDA) {
      CUDA_CHECK(cudaEventCreate(&start_));
      CUDA_CHECK(cudaEventCreate(&stop_));
    }
#endif
  }
  ~Timer() {
#ifdef RETAIN_BENCH_CUDA
    if (device_ == Device::CUDA) {
      cudaEventDestroy(start_);
      cudaEventDestroy(stop_);
    }
#endif
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  double ms(const std::function<void()>& fn) {
#ifdef RETAIN_BENCH_CUDA
    if (device_ == Device::CUDA) {
      CUDA_CHECK(cudaEventRecord(start_));
      fn();
      CUDA_CHECK(cudaEventRecord(stop_));
      CUDA_CHECK(cudaEventSynchronize(stop_));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
      return ms;
    }
#endif
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }

 private:
  Device device_;
#ifdef RETAIN_BENCH_CUDA
  cudaEvent_t start_{}, stop_{};
#endif
};

double median_ms(Timer& timer, int warmup, int iters, const std::function<void()>& fn) {
  for (int w = 0; w < warmup; ++w) timer.ms(fn);
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) times.push_back(timer.ms(fn));
  std::sort(times.begin(), times.end());
  const size_t m = times.size() / 2;
  return times.size() % 2 ? times[m] : 0.5 * (times[m - 1] + times[m]);
}

std::vector<int64_t> parse_lengths(const std::string& text) {
  std::vector<int64_t> out;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t end = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, end - at);
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || item.empty() || v <= 0)
      throw cli::UsageError(fmt::format("--seq: '{}' is not a positive sequence length", item));
    out.push_back(v);
    at = end + 1;
  }
  return out;
}

struct Row {
  int64_t seq;
  std::string op;
  double ms;
  double tflops;  // < 0: not a FLOP-counted row
  double share;   // capacity: fraction of gated fwd+bwd per layer; < 0 otherwise
};

// An output's folder must exist and be writable: checked before minutes of timing, not after.
void check_output_folder(const std::string& flag, const std::string& path) {
  const std::filesystem::path parent = std::filesystem::absolute(path).parent_path();
  if (!std::filesystem::is_directory(parent)) fail("{} {}: the folder {} does not exist", flag, path, parent.string());
  if (::access(parent.c_str(), W_OK) != 0) fail("{} {}: the folder {} is not writable", flag, path, parent.string());
}

int attention(int argc, char** argv) {
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
  if (!cli::parse(argc, argv, kUsage, opts, vm)) return 0;

  // Defaults that fit the device: the Qwen3-4B lengths on a GPU, a length the CPU reference
  // times in seconds on the CPU.
  if (device_name_arg.empty()) device_name_arg = cuda_built() && cuda_device_count() > 0 ? "cuda" : "cpu";
  const bool on_gpu = device_name_arg == "cuda";
  if (seq_text.empty()) seq_text = on_gpu ? "8192,32768,131072" : "1024";
  if (!vm.count("iters")) iters = on_gpu ? 10 : 3;
  if (!vm.count("warmup")) warmup = on_gpu ? 2 : 1;
  const std::vector<int64_t> lengths = parse_lengths(seq_text);
  if (!json_path.empty()) check_output_folder("--json", json_path);
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
    for (const auto& [key, variable] : {std::pair<const char*, const char*>{"attention_forward", "RETAIN_ATTENTION_FORWARD"},
                                        {"attention_backward", "RETAIN_ATTENTION_BACKWARD"}}) {
      const char* kernel = std::getenv(variable);
      j[key] = !on_gpu ? "cpu" : kernel ? kernel : "mma";
    }
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

constexpr const char* kGemmUsage =
    "Usage: retain-bench gemm [--device cuda|cpu] [--tokens N] [--lm-head] [--iters N] [--warmup N]\n\n"
    "Times ops::linear (y = x·wᵀ) and ops::linear_backward_input (dx = dy·w) on the projections of\n"
    "Qwen3-4B (hidden 2560, 32 query / 8 KV heads of 128, MLP 9728; --lm-head adds the 151936-row\n"
    "LM head) at --tokens rows, with F32 and with BF16 weights (F32 activations; on CUDA the BF16\n"
    "rows include rounding the activation to bf16). CUDA: cuBLASLt, timed with CUDA events; CPU:\n"
    "OpenBLAS, steady_clock. TFLOP/s = 2·N·in·out / time, the median of --iters timed runs after\n"
    "--warmup runs.";

int gemm(int argc, char** argv) {
  cli::po::options_description opts("Options of retain-bench gemm");
  std::string device_name_arg;
  int64_t tokens = 0;
  int iters = 0, warmup = 0;
  opts.add_options()
      ("device", cli::po::value(&device_name_arg), "cuda or cpu (default: cuda when a GPU is visible, else cpu)")
      ("tokens", cli::po::value(&tokens), "rows N of the activations (default: 8192 on cuda, 64 on cpu)")
      ("lm-head", cli::po::bool_switch(), "also time the LM head [151936, 2560]")
      ("iters", cli::po::value(&iters), "timed runs per row, median reported (default: 10 on cuda, 3 on cpu)")
      ("warmup", cli::po::value(&warmup), "untimed runs before them (default: 2 on cuda, 1 on cpu)");
  cli::po::variables_map vm;
  if (!cli::parse(argc, argv, kGemmUsage, opts, vm)) return 0;
  if (device_name_arg.empty()) device_name_arg = cuda_built() && cuda_device_count() > 0 ? "cuda" : "cpu";
  if (device_name_arg != "cuda" && device_name_arg != "cpu")
    throw cli::UsageError(fmt::format("--device must be cuda or cpu, got '{}'", device_name_arg));
  const bool on_gpu = device_name_arg == "cuda";
  if (!vm.count("tokens")) tokens = on_gpu ? 8192 : 64;
  if (!vm.count("iters")) iters = on_gpu ? 10 : 3;
  if (!vm.count("warmup")) warmup = on_gpu ? 2 : 1;
  if (tokens <= 0) throw cli::UsageError("--tokens must be positive");
  if (iters <= 0 || warmup < 0) throw cli::UsageError("--iters must be positive and --warmup not negative");
  const Device device = on_gpu ? Device::CUDA : Device::CPU;
  if (on_gpu && !cuda_built()) fail("--device cuda: this build of retain has no CUDA support; use --device cpu");
  if (on_gpu && cuda_device_count() == 0) fail("--device cuda: no CUDA device is visible; use --device cpu");

  struct Proj {
    const char* name;
    int64_t in, out;
  };
  std::vector<Proj> projs = {{"q_proj", 2560, 4096},    {"k_proj", 2560, 1024},  {"v_proj", 2560, 1024},
                             {"o_proj", 4096, 2560},    {"gate_proj", 2560, 9728}, {"up_proj", 2560, 9728},
                             {"down_proj", 9728, 2560}};
  if (vm["lm-head"].as<bool>()) projs.push_back({"lm_head", 2560, 151936});
  Timer timer(device);
  std::cout << fmt::format("retain-bench gemm on {}: Qwen3-4B projections, N = {} tokens, median of {}\n",
                           device_name_arg, tokens, iters);
  std::cout << fmt::format("{:<10} {:>6} {:>7}  {:<4} {:<22} {:>10} {:>9}\n", "proj", "in", "out", "w", "op", "ms",
                           "TFLOP/s");
  uint64_t seed = 1;
  for (const Proj& p : projs) {
    const Tensor x = random_tensor({tokens, p.in}, DType::F32, device, seed++);
    const Tensor dy = random_tensor({tokens, p.out}, DType::F32, device, seed++);
    Tensor y = Tensor::empty({tokens, p.out}, DType::F32, device);
    Tensor dx = Tensor::empty({tokens, p.in}, DType::F32, device);
    const double flops = 2.0 * static_cast<double>(tokens) * static_cast<double>(p.in) * static_cast<double>(p.out);
    for (DType wt : {DType::F32, DType::BF16}) {
      const Tensor w = random_tensor({p.out, p.in}, wt, device, seed++, 0.0f, 0.02f);
      const std::pair<const char*, std::function<void()>> calls[] = {
          {"linear", [&] { ops::linear(x, w, y); }},
          {"linear_backward_input", [&] { ops::linear_backward_input(dy, w, dx); }}};
      for (const auto& [op, fn] : calls) {
        std::cerr << fmt::format("retain-bench: {} {} {}: {} warm-up + {} timed runs\n", p.name, dtype_name(wt), op,
                                 warmup, iters)
                  << std::flush;
        const double ms = median_ms(timer, warmup, iters, fn);
        std::cout << fmt::format("{:<10} {:>6} {:>7}  {:<4} {:<22} {:>10.3f} {:>9.4g}\n", p.name, p.in, p.out,
                                 dtype_name(wt), op, ms, flops / (ms * 1e-3) / 1e12)
                  << std::flush;
      }
    }
  }
  return 0;
}

constexpr const char* kTrainUsage =
    "Usage: retain-bench train --model DIR [--device cpu|cuda] [--seq 8192,32768] [--gate trimkv,dbtrimkv]\n"
    "                          [--docs 1] [--iters 3] [--warmup 1] [--gate-hidden 512] [--memory 128]\n"
    "                          [--seed 1] [--gate-init random|zero-output:B] [--dump-batch FILE]\n"
    "                          [--json FILE]\n\n"
    "Times retain's training step (trainer::compute_gradients, then AdamW on the flat gate\n"
    "parameters) on the model in DIR, for every (--seq, --gate): fresh gates (--gate-init), one\n"
    "micro-batch of T random token ids (seeded by --seed and T, the same for every gate) split\n"
    "into --docs equal documents, every token a target; one rank. Weights:\n"
    "the mapped checkpoint on the CPU, the whole model resident on the GPU (bf16 matmuls) on\n"
    "CUDA. Each step starts from zeroed gradients; the gates keep training across iterations.\n"
    "Reported: the median over --iters timed steps after --warmup steps of the step time and of\n"
    "each phase (teacher, student, capacity, loss, backward: trainer::PhaseTimes, which\n"
    "synchronizes the device at every phase edge; optimizer: flatten the gradients, AdamW,\n"
    "unflatten the values), tokens/s = T / step time, TFLOP/s and MFU (against the GPU's dense\n"
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

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t end = std::min(text.find(',', at), text.size());
    out.push_back(text.substr(at, end - at));
    at = end + 1;
  }
  return out;
}

double peak_rss_gb() {
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) != 0) return std::numeric_limits<double>::quiet_NaN();
  return static_cast<double>(usage.ru_maxrss) * 1024.0 / 1e9;  // Linux reports kilobytes
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return date;
}

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

int train(int argc, char** argv) {
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
  if (!json_path.empty()) check_output_folder("--json", json_path);
  if (!dump_path.empty()) check_output_folder("--dump-batch", dump_path);

  const auto model = std::make_shared<const Qwen3Checkpoint>(Qwen3Checkpoint::open(model_dir));
  const Qwen3Config& mc = model->config();
  for (int64_t T : lengths)
    if (T > mc.max_position_embeddings)
      fail("--seq {} exceeds the model's max_position_embeddings {} ({}/config.json)", T, mc.max_position_embeddings,
           model_dir);

  std::unique_ptr<WeightProvider> weights;
  std::string device_line = "cpu";
  std::optional<double> peak_tflops;
  if (on_gpu) {
    bind_local_gpu();
    weights = std::make_unique<DeviceWeightProvider>(model);
    device_line = cuda::device_name();
    peak_tflops = trainer::bf16_peak_tflops(device_line);
  } else {
    weights = std::make_unique<LocalWeightProvider>(model);
  }
  const std::unique_ptr<dist::Comm> comm = dist::make_local_comm();
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
      const int64_t n = trainer::flat_size(gates);
      std::vector<float> values(static_cast<size_t>(n)), grads(static_cast<size_t>(n));
      trainer::flatten_values(gates, values.data());
      trainer::AdamW adam(n, trainer::AdamWConfig{});
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
        trainer::flatten_grads(gates, grads.data());
        adam.step(values.data(), grads.data(), trainer::AdamWConfig{}.lr);
        trainer::unflatten_values(gates, values.data());
        const auto t2 = std::chrono::steady_clock::now();
        if (it == 0) {
          row.first_loss = losses.total(loss_cfg);
          row.kl = losses.kl();
          row.ntp = losses.ntp();
          row.cap = losses.cap();
        }
        if (it < warmup) continue;
        step_ms.push_back(std::chrono::duration<double, std::milli>(t2 - t0).count());
        const double opt = std::chrono::duration<double, std::milli>(t2 - t1).count();
        const double phase[6] = {times.teacher * 1e3, times.student * 1e3, times.capacity * 1e3,
                                 times.loss * 1e3,    times.backward * 1e3, opt};
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

int run(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  if (command == "attention") return attention(argc - 1, argv + 1);  // argv[1] plays the program name
  if (command == "gemm") return gemm(argc - 1, argv + 1);
  if (command == "train") return train(argc - 1, argv + 1);
  if (command == "--help" || command == "-h") {
    std::cout << kUsage << "\n\n" << kGemmUsage << "\n\n" << kTrainUsage
              << "\n\nSee `retain-bench attention --help`, `retain-bench gemm --help` and `retain-bench train --help`"
                 " for the options.\n";
    return 0;
  }
  throw cli::UsageError(command.empty() ? "missing benchmark name (attention, gemm, train)"
                                        : fmt::format("unknown benchmark '{}' (known: attention, gemm, train)", command));
}

}  // namespace

int main(int argc, char** argv) {
  return cli::run_tool("retain-bench", [&] { return run(argc, argv); });
}
