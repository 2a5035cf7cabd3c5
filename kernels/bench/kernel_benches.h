// retain-bench's kernel benchmarks (docs/benchmarks.md): `attention` (retention-gated attention
// and the capacity loss through kernels/retention.h) and `gemm` (ops::linear and its backward on
// Qwen3-4B's projections); trainer/tools/retain_bench.cpp dispatches to them and to
// trainer/bench's `train`. Each takes the subcommand's argc/argv (argv[0] its name) and returns
// the exit status; bad options throw cli::UsageError.
#pragma once

namespace retain::bench {

extern const char* const kAttentionUsage;
extern const char* const kGemmUsage;
int attention_bench(int argc, char** argv);
int gemm_bench(int argc, char** argv);

}  // namespace retain::bench
