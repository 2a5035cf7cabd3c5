// What retain-bench's benchmarks share (kernels/bench: attention, gemm; trainer/bench: train):
// seeded inputs, device-aware timing, the --seq list, output checks, medians.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/tensor.h"

namespace retain::bench {

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

// A tensor of N(mean, std) values in `dtype` (F32 or BF16) on `device`; filled on the host in
// parallel chunks with independent seeds.
Tensor random_tensor(const Shape& shape, DType dtype, Device device, uint64_t seed, float mean = 0, float std = 1);

// Milliseconds of one call of fn: CUDA events on the GPU, steady_clock on the CPU.
class Timer {
 public:
  explicit Timer(Device device);
  ~Timer();
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  double ms(const std::function<void()>& fn);

 private:
  struct Events;  // the CUDA events, where the build has CUDA
  Device device_;
  std::unique_ptr<Events> events_;
};

// The median of `iters` timed calls after `warmup` untimed ones.
double median_ms(Timer& timer, int warmup, int iters, const std::function<void()>& fn);
double median_of(std::vector<double> v);

// --seq: comma-separated positive lengths (a UsageError names a bad entry); split_list: the
// comma-separated items of a list, empty ones kept.
std::vector<int64_t> parse_lengths(const std::string& text);
std::vector<std::string> split_list(const std::string& text);

double peak_rss_gb();   // this process's peak resident memory (Linux reports kilobytes)
std::string utc_now();  // "YYYY-MM-DDTHH:MM:SSZ"

}  // namespace retain::bench
