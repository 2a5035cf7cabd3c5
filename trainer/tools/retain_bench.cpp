// retain-bench: retain's benchmarks (docs/benchmarks.md). `attention` and `gemm` time kernels
// (kernels/bench/), `train` the whole training step (trainer/bench/); this main dispatches.
#include <iostream>
#include <string>

#include <fmt/format.h>

#include "kernels/base/cli.h"
#include "kernels/bench/kernel_benches.h"
#include "trainer/bench/train_bench.h"

namespace {

using namespace retain;

int run(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  if (command == "attention") return bench::attention_bench(argc - 1, argv + 1);  // argv[1] plays the program name
  if (command == "gemm") return bench::gemm_bench(argc - 1, argv + 1);
  if (command == "train") return bench::train_bench(argc - 1, argv + 1);
  if (command == "--help" || command == "-h") {
    std::cout << bench::kAttentionUsage << "\n\n" << bench::kGemmUsage << "\n\n" << bench::kTrainUsage
              << "\n\nSee `retain-bench attention --help`, `retain-bench gemm --help` and `retain-bench train --help`"
                 " for the options.\n";
    return 0;
  }
  throw cli::UsageError(command.empty() ? "missing benchmark name (attention, gemm, train)"
                                        : fmt::format("unknown benchmark '{}' (known: attention, gemm, train)", command));
}

}  // namespace

int main(int argc, char** argv) {
  return retain::cli::run_tool("retain-bench", [&] { return run(argc, argv); });
}
