#include "kernels/bench/bench_common.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <limits>

#include <fmt/format.h>

#include "kernels/base/cli.h"
#include "kernels/base/error.h"

#ifdef RETAIN_BENCH_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/check.h"
#endif

namespace retain::bench {

namespace {

uint16_t bf16_bits(float f) {  // round to nearest even (inputs are finite)
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace

Tensor random_tensor(const Shape& shape, DType dtype, Device device, uint64_t seed, float mean, float std) {
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

struct Timer::Events {
#ifdef RETAIN_BENCH_CUDA
  cudaEvent_t start{}, stop{};
#endif
};

Timer::Timer(Device device) : device_(device), events_(std::make_unique<Events>()) {
#ifdef RETAIN_BENCH_CUDA
  if (device_ == Device::CUDA) {
    CUDA_CHECK(cudaEventCreate(&events_->start));
    CUDA_CHECK(cudaEventCreate(&events_->stop));
  }
#endif
}

Timer::~Timer() {
#ifdef RETAIN_BENCH_CUDA
  if (device_ == Device::CUDA) {
    cudaEventDestroy(events_->start);
    cudaEventDestroy(events_->stop);
  }
#endif
}

double Timer::ms(const std::function<void()>& fn) {
#ifdef RETAIN_BENCH_CUDA
  if (device_ == Device::CUDA) {
    CUDA_CHECK(cudaEventRecord(events_->start));
    fn();
    CUDA_CHECK(cudaEventRecord(events_->stop));
    CUDA_CHECK(cudaEventSynchronize(events_->stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, events_->start, events_->stop));
    return ms;
  }
#endif
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double median_ms(Timer& timer, int warmup, int iters, const std::function<void()>& fn) {
  for (int w = 0; w < warmup; ++w) timer.ms(fn);
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) times.push_back(timer.ms(fn));
  std::sort(times.begin(), times.end());
  const size_t m = times.size() / 2;
  return times.size() % 2 ? times[m] : 0.5 * (times[m - 1] + times[m]);
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
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

}  // namespace retain::bench
