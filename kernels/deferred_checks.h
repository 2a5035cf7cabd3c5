// Value checks of device tensors without a host synchronization inside an op. An op enqueues
// a scan that records, on the device, the first element breaking a rule and that element's
// value; the verdict is read at the next raise_deferred_checks() — once per training step,
// where the step reads its losses back anyway — which throws the retain::Error the op would
// have thrown at once (the first failing check in the order they were enqueued). The scans
// only read, and the ops that defer their checks stay memory-safe on bad values (the values
// are never used as indices), so running to the end of the step before failing is harmless.
// CPU tensors are still checked at once by their ops.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "kernels/cuda/host_device.h"  // RETAIN_HD: the CUDA scan calls value_breaks_rule too

namespace retain::ops {

enum class ValueRule : uint32_t {
  at_most_zero_f32 = 0,  // float32 x ≤ 0 (−inf allowed; NaN and x > 0 fail)
  nonnegative_i32 = 1,   // int32 x ≥ 0
};

// The error message of a failing element, from its flat index and its 32 bits.
using ValueMessage = std::function<std::string(int64_t flat_index, uint32_t bits)>;

// One check's verdict: the smallest failing flat index (UINT64_MAX: none) and its bits.
struct DeferredSlot {
  uint64_t first;
  uint32_t bits;
  uint32_t pad;
};
inline constexpr uint64_t kNoFailure = UINT64_MAX;

// Where the scans run: the CUDA device (kernels/cuda/deferred_checks.cu), or an emulation.
class DeferredCheckDevice {
 public:
  virtual ~DeferredCheckDevice() = default;
  // Queues the scan of n elements at `data` into slot `slot` (whatever it held before is reset).
  virtual void enqueue(int slot, const void* data, int64_t n, ValueRule rule) = 0;
  // Waits for the queued scans and copies slots [0, count) out.
  virtual void read(DeferredSlot* out, int count) = 0;
};

// Slots on the device: a step enqueuing more checks than this reads them early (one wait).
inline constexpr int kDeferredSlots = 1024;

// Queues a check of n elements of device memory at `data`; `message` is kept until the verdict.
void defer_value_check(const void* data, int64_t n, ValueRule rule, ValueMessage message);
// Reads every queued verdict (one device wait when any is queued) and throws the first failure's
// message as a retain::Error; the queue is empty afterwards either way.
void raise_deferred_checks();
// Checks queued and not read yet.
int64_t deferred_checks_pending();
// Tests: route the scans to another device (nullptr: the CUDA device again). Returns the old one.
DeferredCheckDevice* set_deferred_check_device(DeferredCheckDevice* device);

// Whether one element breaks the rule (shared with the CUDA scan's kernel).
RETAIN_HD bool value_breaks_rule(ValueRule rule, uint32_t bits) {
  if (rule == ValueRule::nonnegative_i32) return static_cast<int32_t>(bits) < 0;
  // float32 ≤ 0 on the bits: +0 (0x00000000) and every negative pattern but a NaN pass.
  const bool negative = (bits >> 31) != 0;
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return nan || (!negative && bits != 0);
}

}  // namespace retain::ops
