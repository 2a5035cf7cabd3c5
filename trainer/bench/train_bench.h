// retain-bench train (docs/benchmarks.md, "GPU training step at Qwen3 shapes"): the whole
// training step on a model directory, driven through the trainer's own code — trainer/step.h's
// compute_gradients, trainer/update.h's optimizer update, trainer/weight_setup.h's weights — per
// phase, with tokens/s, TFLOP/s, MFU, peak memory and the first step's losses.
// trainer/tools/retain_bench.cpp dispatches `retain-bench train` here.
#pragma once

namespace retain::bench {

extern const char* const kTrainUsage;
int train_bench(int argc, char** argv);

}  // namespace retain::bench
