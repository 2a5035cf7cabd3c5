// kernels/deferred_checks.h on the CPU, in every build: the queue, its order, its early read
// when the device slots are full, and the element rule, through an emulated device that scans
// host memory where the CUDA one queues a kernel (kernels/cuda/deferred_checks.cu; its own
// test is GatedAttentionCuda.BadInputsAreOneLineErrors / CapacityCuda.BadInputs*).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/deferred_checks.h"

using namespace retain;
using namespace retain::ops;

namespace {

// Scans at enqueue (what stream order means on the device) into host slots; counts reads.
class HostDevice final : public DeferredCheckDevice {
 public:
  void enqueue(int slot, const void* data, int64_t n, ValueRule rule) override {
    ASSERT_LT(slot, kDeferredSlots);
    if (static_cast<size_t>(slot) >= slots_.size()) slots_.resize(static_cast<size_t>(slot) + 1);
    DeferredSlot& s = slots_[static_cast<size_t>(slot)];
    s = {kNoFailure, 0, 0};
    const auto* x = static_cast<const uint32_t*>(data);
    for (int64_t i = n - 1; i >= 0; --i)  // the smallest failing index wins, whatever the order
      if (value_breaks_rule(rule, x[i])) s = {static_cast<uint64_t>(i), x[i], 0};
  }
  void read(DeferredSlot* out, int count) override {
    ++reads;
    for (int i = 0; i < count; ++i) out[i] = slots_[static_cast<size_t>(i)];
  }
  int reads = 0;

 private:
  std::vector<DeferredSlot> slots_;
};

class DeferredChecks : public ::testing::Test {
 protected:
  void SetUp() override { old_ = set_deferred_check_device(&device_); }
  void TearDown() override { set_deferred_check_device(old_); }
  HostDevice device_;
  DeferredCheckDevice* old_ = nullptr;
};

ValueMessage named(const std::string& name) {
  return [name](int64_t i, uint32_t bits) { return name + "[" + std::to_string(i) + "] bits " + std::to_string(bits); };
}

std::string raised() {
  try {
    raise_deferred_checks();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_F(DeferredChecks, FirstFailureInQueueOrderIsRaisedOnceAndTheQueueEmpties) {
  const std::vector<float> good = {-1.0f, -0.0f, 0.0f, -std::numeric_limits<float>::infinity()};
  const std::vector<float> late = {-1.0f, -2.0f, -3.0f, 0.5f};   // fails at 3
  const std::vector<float> early = {0.25f, -1.0f, 2.0f, -1.0f};  // fails at 0 and 2
  const std::vector<int32_t> positions = {0, 3, -4, 5};
  defer_value_check(good.data(), 4, ValueRule::at_most_zero_f32, named("good"));
  defer_value_check(late.data(), 4, ValueRule::at_most_zero_f32, named("late"));
  defer_value_check(early.data(), 4, ValueRule::at_most_zero_f32, named("early"));
  EXPECT_EQ(deferred_checks_pending(), 3);
  EXPECT_EQ(device_.reads, 0) << "queuing never waits";
  EXPECT_EQ(raised(), "late[3] bits " + std::to_string(std::bit_cast<uint32_t>(0.5f)));
  EXPECT_EQ(device_.reads, 1);
  EXPECT_EQ(deferred_checks_pending(), 0);
  EXPECT_EQ(raised(), "") << "a verdict is read once";
  EXPECT_EQ(device_.reads, 1) << "nothing queued: no wait";
  defer_value_check(positions.data(), 4, ValueRule::nonnegative_i32, named("positions"));
  EXPECT_EQ(raised(), "positions[2] bits " + std::to_string(static_cast<uint32_t>(-4)));
  defer_value_check(good.data(), 4, ValueRule::at_most_zero_f32, named("good"));
  defer_value_check(positions.data(), 2, ValueRule::nonnegative_i32, named("positions"));
  EXPECT_EQ(raised(), "");
  defer_value_check(early.data(), 0, ValueRule::at_most_zero_f32, named("empty"));
  EXPECT_EQ(deferred_checks_pending(), 0) << "an empty tensor queues nothing";
}

TEST_F(DeferredChecks, FullSlotsAreReadEarly) {
  const std::vector<float> good = {-1.0f}, bad = {1.0f};
  for (int i = 0; i < kDeferredSlots; ++i) defer_value_check(good.data(), 1, ValueRule::at_most_zero_f32, named("g"));
  EXPECT_EQ(device_.reads, 0);
  defer_value_check(bad.data(), 1, ValueRule::at_most_zero_f32, named("bad"));  // reads the full queue first
  EXPECT_EQ(device_.reads, 1);
  EXPECT_EQ(deferred_checks_pending(), 1);
  EXPECT_EQ(raised(), "bad[0] bits " + std::to_string(std::bit_cast<uint32_t>(1.0f)));
  // A failure among a full queue is raised by the check that finds the queue full.
  defer_value_check(bad.data(), 1, ValueRule::at_most_zero_f32, named("first"));
  for (int i = 1; i < kDeferredSlots; ++i) defer_value_check(good.data(), 1, ValueRule::at_most_zero_f32, named("g"));
  EXPECT_THROW(defer_value_check(good.data(), 1, ValueRule::at_most_zero_f32, named("g")), Error);
  EXPECT_EQ(deferred_checks_pending(), 0);
}

// The bit-level rule equals the float comparison it stands for (and int32 sign) on every
// special value and a million random patterns.
TEST(DeferredCheckRule, EqualsTheComparisons) {
  auto float_breaks = [](uint32_t bits) { return !(std::bit_cast<float>(bits) <= 0.0f); };
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {0.0f, -0.0f, 1.0f, -1.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(),
                  -std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min(),
                  -std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max()}) {
    const uint32_t bits = std::bit_cast<uint32_t>(x);
    EXPECT_EQ(value_breaks_rule(ValueRule::at_most_zero_f32, bits), float_breaks(bits)) << x;
  }
  std::mt19937 rng(3);
  for (int i = 0; i < 1000000; ++i) {
    const uint32_t bits = rng();
    ASSERT_EQ(value_breaks_rule(ValueRule::at_most_zero_f32, bits), float_breaks(bits)) << bits;
    ASSERT_EQ(value_breaks_rule(ValueRule::nonnegative_i32, bits), static_cast<int32_t>(bits) < 0) << bits;
  }
}
