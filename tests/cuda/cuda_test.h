// What the CUDA kernel tests share: skipping visibly without a CUDA build or device, and a
// fresh random seed per run (printed by the tests; RETAIN_TEST_SEED=n replays one).
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <random>

#include "kernels/tensor.h"

#define SKIP_WITHOUT_GPU()                                                  \
  do {                                                                      \
    if (!::retain::cuda_built()) GTEST_SKIP() << "built without CUDA";      \
    if (::retain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

namespace retain::cuda_test {

inline uint32_t fresh_seed() {
  if (const char* s = std::getenv("RETAIN_TEST_SEED")) return static_cast<uint32_t>(std::strtoul(s, nullptr, 10));
  return std::random_device{}();
}

// A test fixture with a generator seeded by fresh_seed() (seed_ for the failure trace).
class SeededTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = fresh_seed();
    rng_.seed(seed_);
  }
  uint32_t seed_ = 0;
  std::mt19937 rng_;
};

}  // namespace retain::cuda_test

// In a SeededTest: the seed in every failure message of the scope (RETAIN_TEST_SEED replays it).
#define TRACE_SEED() SCOPED_TRACE(::testing::Message() << "seed " << seed_)
