// What users see while training: one JSON line per step in RUN/metrics.jsonl, and on rank 0
// either a progress bar redrawn in place (a terminal) or one plain log line per logged step
// (a log file, a batch job).
#pragma once
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace retain::trainer {

struct StepMetrics {
  int64_t step = 0, total_steps = 0;  // step = optimizer steps completed (so the first step is 1)
  double loss = 0, kl = 0, ntp = 0, cap = 0, lr = 0, grad_norm = 0;
  double tokens_per_s = 0, step_seconds = 0, eta_seconds = 0;
  int64_t tokens = 0;                   // tokens in this global batch (non-padding)
  // This rank's achieved TFLOP/s (trainer/flops.h's count over the step's wall time), its MFU
  // against the GPU's bf16 peak (NaN where the peak is unknown: the CPU, a GPU not in the
  // table), and the peak memory in GB (the CUDA pool's high-water mark during the step; on
  // the CPU the process's peak resident set). NaN = not known (null in JSON, omitted or n/a).
  double tflops = std::numeric_limits<double>::quiet_NaN();
  double mfu = std::numeric_limits<double>::quiet_NaN();
  double peak_memory_gb = std::numeric_limits<double>::quiet_NaN();
  // On the CPU, the high-water mark of rank 0's live tensors during the step (host_tensor_memory():
  // the model's own buffers, without the libraries and the process's other memory that the
  // resident set includes), in GB; NaN on CUDA (peak_memory_gb is the pool's there).
  double tensor_peak_gb = std::numeric_limits<double>::quiet_NaN();
  // Rank 0's time in collectives during the step (Comm::take_device_times: NCCL's device time, MPI's
  // host time; none for one rank): all of it, and the part compute waited for (communication that
  // overlap did not hide).
  double comm_ms = std::numeric_limits<double>::quiet_NaN();
  double comm_exposed_ms = std::numeric_limits<double>::quiet_NaN();
  // --context-parallel: the bytes rank 0 sent around its group's ring during the step, in MB
  // (10⁶ B); NaN without context parallelism.
  double ring_mb = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> mean_beta;        // per layer: mean exp(logβ) over tokens and KV heads
  std::vector<double> effective_cache;  // per layer: mean over tokens of S(t)
  // --gate kvpop (DESIGN §5): loss is L_kvpop, and kl/ntp/cap are not computed.
  bool kvpop = false;
  int64_t decisions = 0;  // boundary decisions of the global batch
  double agreement = 0;   // fraction of them the scorer got right (sign(ŝ_new − ŝ_b) = y)
  double gamma = 0;       // mean decay γ over layers and KV heads
};

// One metrics.jsonl line: every field under its name (per-layer lists in full; a non-finite
// value is null) plus "time", the UTC wall clock as ISO-8601 with milliseconds
// ("2026-11-21T14:52:41.123Z").
nlohmann::json to_json(const StepMetrics& m);

// The human line, e.g.
//   step 12/1000 loss 1.2346 kl 0.1235 ntp 2.3457 cap 0.0000 lr 1.00e-04 |g| 0.1234
//   3512 tok/s 1.23 s/step ETA 20:12 0.4 TFLOP/s MFU n/a mem 1.2 GB β̄ 0.9981 0.9990 cache 103.2 87.5
// (TFLOP/s, MFU and mem where known)
// (one line); for kvpop
//   step 12/1000 loss 0.6931 agree 0.512 γ 0.999500 decisions 4032 lr 1.00e-04 |g| 0.1234 ... Up to 8 layers are listed one by one; more as "min .. mean .. max ..".
std::string format_step_line(const StepMetrics& m);

// "1:02:03" (an hour or more), "12:03" (a minute or more), "45s"; rounded to whole seconds;
// "--" for a negative or non-finite duration (an ETA not known yet).
std::string format_duration(double seconds);

// RUN/metrics.jsonl, appended and flushed line by line. On resume, the lines of steps after
// the resume step (written after the checkpoint the run resumes from) and a torn last line (a
// kill mid-write) are dropped first, by an atomic rewrite; a resume step of 0 starts empty.
// A complete line that is not a metrics object is an error "<path>:<line>: ...".
class MetricsLog {
 public:
  MetricsLog(const std::string& path, int64_t resume_step);
  void write(const StepMetrics& m);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file_{nullptr, &std::fclose};
};

// Rank 0's live view. tty (isatty(stderr)): a one-line bar with the latest metrics, redrawn
// with \r on stderr and cut to the terminal width. Otherwise: format_step_line through
// spdlog::info every `log_every` steps and on the last step.
class ProgressDisplay {
 public:
  ProgressDisplay(int64_t total_steps, bool tty, int64_t log_every = 1);
  ~ProgressDisplay();
  ProgressDisplay(const ProgressDisplay&) = delete;
  ProgressDisplay& operator=(const ProgressDisplay&) = delete;

  void update(const StepMetrics& m);  // called every step
  void finish();                      // ends the bar's line (idempotent; the destructor calls it)

 private:
  int64_t total_steps_, log_every_;
  bool tty_;
  bool bar_drawn_ = false;
};

// The bar line ProgressDisplay draws: "[#####-----]  42.0% " + the step line, cut to `columns`
// characters (counted as code points).
std::string format_progress_bar(const StepMetrics& m, int columns);

}  // namespace retain::trainer
