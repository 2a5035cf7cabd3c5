// Step metrics: the JSON line, the human line, the metrics log and the progress display.
#include "trainer/metrics.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <numeric>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "kernels/base/atomic_file.h"
#include "kernels/base/error.h"

namespace retain::trainer {

namespace {

using nlohmann::json;

// JSON has no NaN or infinity: those become null rather than an invalid line.
json number(double x) { return std::isfinite(x) ? json(x) : json(nullptr); }

json numbers(const std::vector<double>& xs) {
  json a = json::array();
  for (double x : xs) a.push_back(number(x));
  return a;
}

std::string utc_now_iso8601() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t secs = std::chrono::system_clock::to_time_t(now);
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  ::gmtime_r(&secs, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
  return fmt::format("{}.{:03d}Z", buf, static_cast<int>(ms));
}

// " 0.9981 0.9990" for few layers, " min 0.9812 mean 0.9950 max 0.9999" for many.
std::string per_layer(const std::vector<double>& xs, const char* spec) {
  constexpr size_t kListed = 8;
  const auto f = [&](double x) { return fmt::format(fmt::runtime(spec), x); };
  std::string s;
  if (xs.size() <= kListed) {
    for (double x : xs) {
      s += ' ';
      s += f(x);
    }
    return s;
  }
  const auto [lo, hi] = std::minmax_element(xs.begin(), xs.end());
  const double mean = std::accumulate(xs.begin(), xs.end(), 0.0) / static_cast<double>(xs.size());
  return fmt::format(" min {} mean {} max {}", f(*lo), f(mean), f(*hi));
}

// Cuts `s` to at most `columns` code points (UTF-8 continuation bytes take no column).
std::string cut_to_columns(const std::string& s, int columns) {
  int used = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const bool starts_char = (static_cast<unsigned char>(s[i]) & 0xC0) != 0x80;
    if (starts_char && ++used > columns) return s.substr(0, i);
  }
  return s;
}

int terminal_columns() {
  winsize ws{};
  if (::ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  return 120;
}

// The "step" of one complete metrics.jsonl line.
int64_t line_step(const std::string& path, size_t line_no, const std::string& line) {
  json j;
  try {
    j = json::parse(line);
  } catch (const json::exception& e) {
    fail("{}:{}: not a JSON line: {}", path, line_no, e.what());
  }
  if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer())
    fail("{}:{}: not a metrics line (no integer \"step\")", path, line_no);
  return j["step"].get<int64_t>();
}

}  // namespace

json to_json(const StepMetrics& m) {
  // nlohmann::json keeps keys sorted, so the line reads the same however it is built.
  json j{{"step", m.step},
         {"total_steps", m.total_steps},
         {"loss", number(m.loss)},
         {"lr", number(m.lr)},
         {"grad_norm", number(m.grad_norm)},
         {"tokens", m.tokens},
         {"tokens_per_s", number(m.tokens_per_s)},
         {"step_seconds", number(m.step_seconds)},
         {"eta_seconds", number(m.eta_seconds)},
         {"tflops", number(m.tflops)},
         {"mfu", number(m.mfu)},
         {"peak_memory_gb", number(m.peak_memory_gb)},
         {"tensor_peak_gb", number(m.tensor_peak_gb)},
         {"comm_ms", number(m.comm_ms)},
         {"comm_exposed_ms", number(m.comm_exposed_ms)},
         {"ring_mb", number(m.ring_mb)},
         {"time", utc_now_iso8601()}};
  if (m.kvpop) {
    j["agreement"] = number(m.agreement), j["gamma"] = number(m.gamma), j["decisions"] = m.decisions;
  } else {
    j["kl"] = number(m.kl), j["ntp"] = number(m.ntp), j["cap"] = number(m.cap);
    j["mean_beta"] = numbers(m.mean_beta), j["effective_cache"] = numbers(m.effective_cache);
  }
  return j;
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--";
  const int64_t s = std::llround(seconds);
  if (s >= 3600) return fmt::format("{}:{:02d}:{:02d}", s / 3600, s / 60 % 60, s % 60);
  if (s >= 60) return fmt::format("{}:{:02d}", s / 60, s % 60);
  return fmt::format("{}s", s);
}

std::string format_step_line(const StepMetrics& m) {
  if (m.kvpop)
    return fmt::format(
        "step {}/{} loss {:.4f} agree {:.3f} γ {:.6f} decisions {} lr {:.2e} |g| {:.4g} {:.0f} tok/s {:.2f} s/step ETA {}",
        m.step, m.total_steps, m.loss, m.agreement, m.gamma, m.decisions, m.lr, m.grad_norm, m.tokens_per_s,
        m.step_seconds, format_duration(m.eta_seconds));
  std::string s = fmt::format(
      "step {}/{} loss {:.4f} kl {:.4f} ntp {:.4f} cap {:.4f} lr {:.2e} |g| {:.4g} {:.0f} tok/s {:.2f} s/step ETA {}",
      m.step, m.total_steps, m.loss, m.kl, m.ntp, m.cap, m.lr, m.grad_norm, m.tokens_per_s, m.step_seconds,
      format_duration(m.eta_seconds));
  if (std::isfinite(m.tflops))
    s += std::isfinite(m.mfu) ? fmt::format(" {:.1f} TFLOP/s MFU {:.1f}%", m.tflops, 100 * m.mfu)
                              : fmt::format(" {:.1f} TFLOP/s MFU n/a", m.tflops);
  if (std::isfinite(m.peak_memory_gb)) s += fmt::format(" mem {:.1f} GB", m.peak_memory_gb);
  if (std::isfinite(m.comm_ms))
    s += fmt::format(" comm {:.1f} ms ({:.1f} exposed)", m.comm_ms, m.comm_exposed_ms);
  if (std::isfinite(m.ring_mb)) s += fmt::format(" ring {:.1f} MB", m.ring_mb);
  if (!m.mean_beta.empty()) s += fmt::format(" β̄{}", per_layer(m.mean_beta, "{:.4f}"));
  if (!m.effective_cache.empty()) s += fmt::format(" cache{}", per_layer(m.effective_cache, "{:.1f}"));
  return s;
}

std::string format_progress_bar(const StepMetrics& m, int columns) {
  constexpr int kWidth = 20;
  const double frac = m.total_steps > 0 ? std::clamp(double(m.step) / double(m.total_steps), 0.0, 1.0) : 0.0;
  const int filled = static_cast<int>(frac * kWidth);
  return cut_to_columns(fmt::format("[{}{}] {:5.1f}% {}", std::string(size_t(filled), '#'),
                                    std::string(size_t(kWidth - filled), '-'), 100.0 * frac, format_step_line(m)),
                        columns);
}

MetricsLog::MetricsLog(const std::string& path, int64_t resume_step) : path_(path) {
  namespace fs = std::filesystem;
  if (fs::exists(path_)) {
    const std::string text = read_file(path_);
    std::string kept;
    size_t line_no = 0, start = 0;
    bool dropped = false;
    while (start < text.size()) {
      const size_t nl = text.find('\n', start);
      ++line_no;
      if (nl == std::string::npos) {  // torn by a kill mid-write
        dropped = true;
        break;
      }
      const std::string line = text.substr(start, nl - start);
      if (line_step(path_, line_no, line) <= resume_step)
        kept.append(text, start, nl + 1 - start);
      else
        dropped = true;
      start = nl + 1;
    }
    if (dropped) write_file_atomic(path_, kept);
  }
  file_.reset(std::fopen(path_.c_str(), "ab"));
  if (!file_) fail("{}: cannot open for appending: {}", path_, std::strerror(errno));
}

void MetricsLog::write(const StepMetrics& m) {
  const std::string line = to_json(m).dump() + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_.get()) != line.size() || std::fflush(file_.get()) != 0)
    fail("{}: write failed: {}", path_, std::strerror(errno));
}

ProgressDisplay::ProgressDisplay(int64_t total_steps, bool tty, int64_t log_every)
    : total_steps_(total_steps), log_every_(std::max<int64_t>(log_every, 1)), tty_(tty) {}

ProgressDisplay::~ProgressDisplay() { finish(); }

void ProgressDisplay::update(const StepMetrics& m) {
  if (tty_) {
    // \r, the line, then erase what a longer previous line left to the right.
    std::cerr << '\r' << format_progress_bar(m, terminal_columns() - 1) << "\x1b[K" << std::flush;
    bar_drawn_ = true;
  } else if (m.step % log_every_ == 0 || m.step == total_steps_) {
    spdlog::info("{}", format_step_line(m));
  }
}

void ProgressDisplay::finish() {
  if (bar_drawn_) std::cerr << '\n' << std::flush;
  bar_drawn_ = false;
}

}  // namespace retain::trainer
