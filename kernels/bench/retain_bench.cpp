// retain-bench: microbenchmarks of retain's kernels (docs/benchmarks.md, "Attention kernels").
//   retain-bench attention: retention-gated attention forward, backward, forward+backward and
//   the capacity loss forward+backward, through the public ops (kernels/retention.h), with the
//   dtypes the trainer uses: on CUDA bf16 q/k/v/o (fp32 logβ, lse), on CPU float32.
//   retain-bench gemm: ops::linear and linear_backward_input on Qwen3-4B's projection shapes,
//   F32 and BF16 weights (cuBLASLt on CUDA, OpenBLAS on CPU).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "kernels/base/atomic_file.h"
#include "kernels/base/cli.h"
#include "kernels/ops.h"
#include "kernels/retention.h"
#include "kernels/tensor.h"

#ifdef RETAIN_BENCH_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/check.h"
#endif

using namespace retain;

namespace {

constexpr const char* kUsage =
    "Usage: retain-bench attention [--device cuda|cpu] [--seq 8192,32768,131072] [--heads 32]\n"
    "                              [--kv-heads 8] [--head-dim 128] [--docs 1] [--layers 1]\n"
    "                              [--iters N] [--warmup N] [--json FILE]\n\n"
    "Times retention-gated attention (ops::gated_attention and its backward) forward, backward\n"
    "and forward+backward, and the capacity loss forward+backward (ops::capacity_loss +\n"
    "capacity_loss_backward, local hinge) for --layers layers of logβ [L, T, K], per sequence\n"
    "length. CUDA: bf16 q, k, v, out, dout, dq, dk, dv; fp32 logβ, lse, dlogβ; timed with CUDA\n"
    "events around the calls (the ops' input checks included: the trainer pays them too). CPU:\n"
    "float32, timed with steady_clock. The median of --iters timed runs after --warmup runs.\n\n"
    "Inputs: q, k, v, dout ~ N(0, 1); logβ = logsigmoid(18 + 0.5·N(0, 1)) (gates at their\n"
    "initial bias: every key decays by < 1e-7 per token, so no capacity tile is skippable —\n"
    "the dense worst case); --docs equal-length documents; memory M = 1024 for the hinge.\n\n"
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
  return device == Device::CPU ? host : host.to(device);
}

Tensor on(const Tensor& host, Device device) { return device == Device::CPU ? host : host.to(device); }

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

int attention(int argc, char** argv) {
  cli::po::options_description opts("Options of retain-bench attention");
  std::string device_name_arg, seq_text, json_path;
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
  // The output is checked before minutes of timing, not after.
  if (!json_path.empty()) {
    const std::filesystem::path parent = std::filesystem::absolute(json_path).parent_path();
    if (!std::filesystem::is_directory(parent))
      fail("--json {}: the folder {} does not exist", json_path, parent.string());
    if (::access(parent.c_str(), W_OK) != 0) fail("--json {}: the folder {} is not writable", json_path, parent.string());
  }
  if (heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0)
    throw cli::UsageError(fmt::format("--heads {} must be a positive multiple of --kv-heads {}", heads, kv_heads));
  if (head_dim <= 0) throw cli::UsageError("--head-dim must be positive");
  if (docs <= 0 || layers <= 0) throw cli::UsageError("--docs and --layers must be positive");
  if (iters <= 0 || warmup < 0) throw cli::UsageError("--iters must be positive and --warmup not negative");
  for (int64_t T : lengths)
    if (T % docs != 0) throw cli::UsageError(fmt::format("--seq {} is not a multiple of --docs {}", T, docs));
  if (device_name_arg != "cuda" && device_name_arg != "cpu")
    throw cli::UsageError(fmt::format("--device must be cuda or cpu, got '{}'", device_name_arg));
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
  std::cout << fmt::format("retain-bench attention on {}: H {} K {} d {} docs {} capacity layers {}, median of {}\n",
                           device_name_arg, H, K, d, docs, layers, iters);
  std::cout << fmt::format("{:>8}  {:<26} {:>11} {:>9}\n", "seq", "op", "ms", "TFLOP/s");

  for (int64_t T : lengths) {
    const Tensor q = random_tensor({T, H, d}, act, device, 1);
    const Tensor k = random_tensor({T, K, d}, act, device, 2);
    const Tensor v = random_tensor({T, K, d}, act, device, 3);
    const Tensor dout = random_tensor({T, H, d}, act, device, 4);
    // logβ = logsigmoid(x) = −log1p(e^−x) for x = 18 + 0.5·N(0, 1).
    Tensor lb_host = random_tensor({layers, T, K}, DType::F32, Device::CPU, 5, 18.0f, 0.5f);
    for (int64_t x = 0; x < lb_host.numel(); ++x) {
      float& y = lb_host.data<float>()[x];
      y = static_cast<float>(-std::log1p(std::exp(-static_cast<double>(y))));
    }
    Tensor doc_host = Tensor::empty({T}, DType::I32);
    for (int64_t t = 0; t < T; ++t) doc_host.data<int32_t>()[t] = static_cast<int32_t>(t / (T / docs));
    const Tensor pos = on(ops::document_positions(doc_host), device);
    const Tensor doc = on(doc_host, device);
    const Tensor lb_all = on(lb_host, device);
    const Tensor lb = on(lb_host.rows(0, 1).reshape({T, K}), device);  // layer 0 for attention

    Tensor out = Tensor::empty({T, H, d}, act, device), lse = Tensor::empty({T, H}, DType::F32, device);
    Tensor dq = Tensor::empty({T, H, d}, act, device), dk = Tensor::empty({T, K, d}, act, device),
           dv = Tensor::empty({T, K, d}, act, device), dlb = Tensor::empty({T, K}, DType::F32, device);
    Tensor dlb_all = Tensor::empty({layers, T, K}, DType::F32, device);

    auto fwd = [&] { ops::gated_attention(q, k, v, lb, doc, scale, out, lse); };
    auto bwd = [&] { ops::gated_attention_backward(q, k, v, lb, doc, scale, out, lse, dout, dq, dk, dv, dlb); };
    const double memory = 1024;
    auto capacity = [&] {
      const ops::CapacityLoss loss = ops::capacity_loss(lb_all, doc, pos, memory, ops::CapacityMode::local);
      const double s = loss.positive > 0 ? 1.0 / static_cast<double>(loss.positive) : 0.0;
      ops::capacity_loss_backward(lb_all, doc, pos, memory, ops::CapacityMode::local, s, dlb_all);
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
    j["heads"] = H;
    j["kv_heads"] = K;
    j["head_dim"] = d;
    j["docs"] = docs;
    j["capacity_layers"] = layers;
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

int run(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  if (command == "attention") return attention(argc - 1, argv + 1);  // argv[1] plays the program name
  if (command == "gemm") return gemm(argc - 1, argv + 1);
  if (command == "--help" || command == "-h") {
    std::cout << kUsage << "\n\n" << kGemmUsage
              << "\n\nSee `retain-bench attention --help` and `retain-bench gemm --help` for the options.\n";
    return 0;
  }
  throw cli::UsageError(command.empty() ? "missing benchmark name (attention, gemm)"
                                        : fmt::format("unknown benchmark '{}' (known: attention, gemm)", command));
}

}  // namespace

int main(int argc, char** argv) {
  return cli::run_tool("retain-bench", [&] { return run(argc, argv); });
}
