// Metrics and progress (trainer/metrics): the human line and durations on fixed examples, the
// JSON line's fields, metrics.jsonl truncation on resume (and a torn last line), and what the
// progress display prints on a terminal and in a log.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include "kernels/base/atomic_file.h"
#include "kernels/base/error.h"
#include "trainer/metrics.h"

namespace retain::trainer {
namespace {

namespace fs = std::filesystem;

StepMetrics example(int64_t step = 12, int64_t layers = 2) {
  StepMetrics m;
  m.step = step;
  m.total_steps = 1000;
  m.loss = 1.23456;
  m.kl = 0.12345;
  m.ntp = 2.34567;
  m.cap = 0.0;
  m.lr = 1e-4;
  m.grad_norm = 0.123456;
  m.tokens_per_s = 3512.4;
  m.step_seconds = 1.234;
  m.eta_seconds = 1212;
  m.tokens = 4096;
  for (int64_t l = 0; l < layers; ++l) {
    m.mean_beta.push_back(0.998 + 0.001 * double(l));
    m.effective_cache.push_back(100.0 + 10.0 * double(l));
  }
  return m;
}

TEST(Metrics, FormatDuration) {
  EXPECT_EQ(format_duration(0), "0s");
  EXPECT_EQ(format_duration(45), "45s");
  EXPECT_EQ(format_duration(59.4), "59s");
  EXPECT_EQ(format_duration(59.6), "1:00");
  EXPECT_EQ(format_duration(723), "12:03");
  EXPECT_EQ(format_duration(3599), "59:59");
  EXPECT_EQ(format_duration(3723), "1:02:03");
  EXPECT_EQ(format_duration(100000), "27:46:40");
  EXPECT_EQ(format_duration(-1), "--");
  EXPECT_EQ(format_duration(NAN), "--");
  EXPECT_EQ(format_duration(INFINITY), "--");
}

TEST(Metrics, StepLineListsFewLayers) {
  EXPECT_EQ(format_step_line(example()),
            "step 12/1000 loss 1.2346 kl 0.1235 ntp 2.3457 cap 0.0000 lr 1.00e-04 |g| 0.1235 3512 tok/s 1.23 s/step "
            "ETA 20:12 β̄ 0.9980 0.9990 cache 100.0 110.0");
}

// TFLOP/s with MFU (or n/a where the GPU's peak is unknown) and memory, only when known.
TEST(Metrics, StepLineShowsThroughputAndMemoryWhenKnown) {
  StepMetrics m = example();
  m.tflops = 412.46, m.mfu = 0.41687, m.peak_memory_gb = 47.26;
  EXPECT_NE(format_step_line(m).find("ETA 20:12 412.5 TFLOP/s MFU 41.7% mem 47.3 GB β̄"), std::string::npos)
      << format_step_line(m);
  m.mfu = NAN, m.peak_memory_gb = NAN;
  EXPECT_NE(format_step_line(m).find("ETA 20:12 412.5 TFLOP/s MFU n/a β̄"), std::string::npos) << format_step_line(m);
  m.comm_ms = 30.46, m.comm_exposed_ms = 1.24;  // NCCL's device time in collectives, and the part compute waited for
  EXPECT_NE(format_step_line(m).find("MFU n/a comm 30.5 ms (1.2 exposed) β̄"), std::string::npos) << format_step_line(m);
}

TEST(Metrics, StepLineSummarizesManyLayers) {
  const StepMetrics m = example(12, 36);  // β̄ 0.998 .. 1.033, mean 1.0155; cache 100 .. 450, mean 275
  const std::string line = format_step_line(m);
  EXPECT_NE(line.find(" β̄ min 0.9980 mean 1.0155 max 1.0330 cache min 100.0 mean 275.0 max 450.0"), std::string::npos)
      << line;
  StepMetrics none = example(12, 0);
  EXPECT_EQ(format_step_line(none).find("cache"), std::string::npos);
}

TEST(Metrics, JsonLineHasEveryFieldAndTheTime) {
  StepMetrics m = example(7, 3);
  m.grad_norm = NAN;  // JSON has no NaN: null
  const auto before = std::chrono::system_clock::now();
  const nlohmann::json j = to_json(m);
  EXPECT_EQ(j["step"], 7);
  EXPECT_EQ(j["total_steps"], 1000);
  EXPECT_EQ(j["loss"], m.loss);
  EXPECT_EQ(j["kl"], m.kl);
  EXPECT_EQ(j["ntp"], m.ntp);
  EXPECT_EQ(j["cap"], m.cap);
  EXPECT_EQ(j["lr"], m.lr);
  EXPECT_TRUE(j["grad_norm"].is_null());
  EXPECT_EQ(j["tokens"], 4096);
  EXPECT_EQ(j["tokens_per_s"], m.tokens_per_s);
  EXPECT_EQ(j["step_seconds"], m.step_seconds);
  EXPECT_EQ(j["eta_seconds"], m.eta_seconds);
  EXPECT_EQ(j["mean_beta"], nlohmann::json(m.mean_beta));
  EXPECT_EQ(j["effective_cache"], nlohmann::json(m.effective_cache));
  // Throughput and memory: null where not known (the example sets none of them).
  EXPECT_TRUE(j["tflops"].is_null());
  EXPECT_TRUE(j["mfu"].is_null());
  EXPECT_TRUE(j["peak_memory_gb"].is_null());
  EXPECT_TRUE(j["comm_ms"].is_null());
  EXPECT_TRUE(j["comm_exposed_ms"].is_null());
  EXPECT_TRUE(j["tensor_peak_gb"].is_null());
  EXPECT_TRUE(j["ring_mb"].is_null());
  EXPECT_EQ(j.size(), 22u);  // the 21 fields above + time
  m.tflops = 412.5, m.mfu = 0.417, m.peak_memory_gb = 47.25, m.comm_ms = 30.5, m.comm_exposed_ms = 1.25;
  m.tensor_peak_gb = 0.304, m.ring_mb = 544.6;
  const nlohmann::json k = to_json(m);
  EXPECT_EQ(k["tflops"], 412.5);
  EXPECT_EQ(k["mfu"], 0.417);
  EXPECT_EQ(k["peak_memory_gb"], 47.25);
  EXPECT_EQ(k["comm_ms"], 30.5);
  EXPECT_EQ(k["comm_exposed_ms"], 1.25);
  EXPECT_EQ(k["tensor_peak_gb"], 0.304);
  EXPECT_EQ(k["ring_mb"], 544.6);
  EXPECT_NE(format_step_line(m).find(" ring 544.6 MB"), std::string::npos) << format_step_line(m);

  // "time": UTC ISO-8601 with milliseconds, within a few seconds of now.
  const std::string t = j["time"];
  ASSERT_TRUE(std::regex_match(t, std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z)"))) << t;
  std::tm tm{};
  ASSERT_NE(::strptime(t.c_str(), "%Y-%m-%dT%H:%M:%S", &tm), nullptr);
  const auto stamped = std::chrono::system_clock::from_time_t(::timegm(&tm));
  EXPECT_LT(std::chrono::abs(stamped - before), std::chrono::seconds(5));
  // A line parses back to the same document.
  EXPECT_EQ(nlohmann::json::parse(j.dump()), j);
}

class MetricsLogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("retain_metrics." + std::to_string(::getpid()));
    fs::create_directories(dir_);
    path_ = (dir_ / "metrics.jsonl").string();
    fs::remove(path_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::vector<int64_t> steps() const {
    std::vector<int64_t> out;
    std::ifstream in(path_);
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line)["step"]);
    return out;
  }
  fs::path dir_;
  std::string path_;
};

TEST_F(MetricsLogTest, AppendsFlushedLines) {
  MetricsLog log(path_, 0);
  for (int64_t s = 1; s <= 3; ++s) {
    log.write(example(s));
    EXPECT_EQ(steps().size(), size_t(s));  // readable before the log is closed
  }
  EXPECT_EQ(steps(), (std::vector<int64_t>{1, 2, 3}));
}

TEST_F(MetricsLogTest, ResumeDropsLinesAfterTheResumeStep) {
  {
    MetricsLog log(path_, 0);
    for (int64_t s = 1; s <= 5; ++s) log.write(example(s));
  }
  {
    MetricsLog log(path_, 3);
    EXPECT_EQ(steps(), (std::vector<int64_t>{1, 2, 3}));
    log.write(example(4));
  }
  EXPECT_EQ(steps(), (std::vector<int64_t>{1, 2, 3, 4}));
  {
    MetricsLog log(path_, 0);  // a fresh start keeps nothing
  }
  EXPECT_TRUE(steps().empty());
  EXPECT_EQ(fs::file_size(path_), 0u);
}

TEST_F(MetricsLogTest, TornLastLineIsDropped) {
  {
    MetricsLog log(path_, 0);
    log.write(example(1));
    log.write(example(2));
  }
  std::ofstream(path_, std::ios::app) << R"({"step": 3, "loss": 1.)";  // killed mid-write
  MetricsLog log(path_, 2);
  log.write(example(3));
  EXPECT_EQ(steps(), (std::vector<int64_t>{1, 2, 3}));
}

TEST_F(MetricsLogTest, DamagedLinesAreErrorsNamingTheLine) {
  write_file_atomic(path_, "{\"step\": 1}\nnot json\n");
  try {
    MetricsLog log(path_, 5);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(path_ + ":2: not a JSON line", 0), 0u) << e.what();
  }
  write_file_atomic(path_, "{\"step\": 1}\n{\"loss\": 2}\n");
  try {
    MetricsLog log(path_, 5);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), path_ + ":2: not a metrics line (no integer \"step\")");
  }
  EXPECT_EQ(read_file(path_), "{\"step\": 1}\n{\"loss\": 2}\n");  // untouched
  const std::string missing_dir = (dir_ / "no" / "metrics.jsonl").string();
  try {
    MetricsLog log(missing_dir, 0);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(missing_dir + ": cannot open for appending", 0), 0u) << e.what();
  }
}

// A plain log: one info line per `log_every` steps and the last step.
TEST(Progress, PlainLogEveryNSteps) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  sink->set_pattern("%v");
  const auto saved = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("test", sink));
  {
    ProgressDisplay p(5, /*tty=*/false, /*log_every=*/2);
    for (int64_t s = 1; s <= 5; ++s) {
      StepMetrics m = example(s);
      m.total_steps = 5;
      p.update(m);
    }
    p.finish();
  }
  spdlog::set_default_logger(saved);
  std::vector<std::string> lines;
  std::istringstream in(out.str());
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 3u) << out.str();
  EXPECT_EQ(lines[0].rfind("step 2/5 loss 1.2346", 0), 0u);
  EXPECT_EQ(lines[1].rfind("step 4/5 ", 0), 0u);
  EXPECT_EQ(lines[2].rfind("step 5/5 ", 0), 0u);
}

// A terminal: the bar redrawn in place (\r ... erase-to-end), one newline at the end.
TEST(Progress, TerminalBarRedrawsOneLine) {
  testing::internal::CaptureStderr();
  {
    ProgressDisplay p(4, /*tty=*/true);
    for (int64_t s = 1; s <= 2; ++s) {
      StepMetrics m = example(s);
      m.total_steps = 4;
      p.update(m);
    }
  }  // the destructor ends the line
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(std::count(err.begin(), err.end(), '\r'), 2);
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1);
  EXPECT_EQ(err.back(), '\n');
  EXPECT_NE(err.find("\r[#####---------------]  25.0% step 1/4 loss"), std::string::npos) << err;
  EXPECT_NE(err.find("\r[##########----------]  50.0% step 2/4 loss"), std::string::npos) << err;
  EXPECT_NE(err.find("\x1b[K"), std::string::npos);
}

TEST(Progress, BarIsCutToTheTerminalWidth) {
  StepMetrics m = example(1000, 2);
  EXPECT_EQ(format_progress_bar(m, 39), "[####################] 100.0% step 1000");
  // Code points, not bytes: β̄ is 4 bytes, 2 code points.
  const std::string full = format_progress_bar(m, 10000);
  const size_t beta = full.find("β̄");
  ASSERT_NE(beta, std::string::npos);
  EXPECT_EQ(format_progress_bar(m, int(beta) + 1), full.substr(0, beta) + "β");
  m.step = 0;
  m.total_steps = 0;  // unknown total: an empty bar, not a division by zero
  EXPECT_EQ(format_progress_bar(m, 30), "[--------------------]   0.0% ");
}

}  // namespace
}  // namespace retain::trainer
