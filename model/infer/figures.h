// The figures of retain-eval and retain-plot, built on plot.h: quality vs budget per policy
// (from metrics.json results), training curves (from a run's metrics.jsonl).
#pragma once
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace retain::infer {

// metrics.json (retain-eval's) → PNG: one panel per metric (recall: accuracy, NLL; data: KL,
// top-1 agreement, NLL) with budget on a log axis, a line per policy, and the full cache as a
// dashed level. Fails (one line) on a file without results.
void plot_eval_metrics(const nlohmann::json& metrics, const std::string& png, const std::string& source);

// RUN/metrics.jsonl (retain-train's, trainer/metrics.h) → PNG: total loss and KL, NTP,
// capacity loss, learning rate vs step. Errors name the file and line.
void plot_training_curves(const std::string& metrics_jsonl, const std::string& png);

}  // namespace retain::infer
