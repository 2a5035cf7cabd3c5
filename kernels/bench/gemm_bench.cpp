// retain-bench gemm (kernel_benches.h).
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kernels/base/cli.h"
#include "kernels/bench/bench_common.h"
#include "kernels/bench/kernel_benches.h"
#include "kernels/cuda/memory.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace retain::bench {

const char* const kGemmUsage =
    "Usage: retain-bench gemm [--device cuda|cpu] [--tokens N] [--lm-head] [--iters N] [--warmup N]\n\n"
    "Times ops::linear (y = x·wᵀ) and ops::linear_backward_input (dx = dy·w) on the projections of\n"
    "Qwen3-4B (hidden 2560, 32 query / 8 KV heads of 128, MLP 9728; --lm-head adds the 151936-row\n"
    "LM head) at --tokens rows, with F32 and with BF16 weights (F32 activations; on CUDA the BF16\n"
    "rows include rounding the activation to bf16). CUDA: cuBLASLt, timed with CUDA events; CPU:\n"
    "OpenBLAS, steady_clock. TFLOP/s = 2·N·in·out / time, the median of --iters timed runs after\n"
    "--warmup runs.";

int gemm_bench(int argc, char** argv) {
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

}  // namespace retain::bench
