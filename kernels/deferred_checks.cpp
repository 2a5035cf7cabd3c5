#include "kernels/deferred_checks.h"

#include <mutex>
#include <vector>

#include "kernels/base/error.h"
#ifdef RETAIN_CUDA_KERNELS
#include "kernels/cuda/retention_cuda.h"
#endif

namespace retain::ops {

namespace {

struct Queue {
  std::mutex mutex;
  DeferredCheckDevice* device = nullptr;  // nullptr: the CUDA device
  std::vector<ValueMessage> messages;     // one per queued check, slot = position
};

Queue& queue() {
  static Queue q;
  return q;
}

DeferredCheckDevice& device_of(Queue& q) {
  if (q.device) return *q.device;
#ifdef RETAIN_CUDA_KERNELS
  return cuda::deferred_check_device();
#else
  fail("deferred value checks need a CUDA device, and this build of retain has no CUDA kernels");
#endif
}

// Reads the queued verdicts and empties the queue; the first failure's message, or "".
std::string drain(Queue& q) {
  if (q.messages.empty()) return {};
  std::vector<ValueMessage> messages;
  messages.swap(q.messages);  // empty even if reading throws (a device error)
  std::vector<DeferredSlot> slots(messages.size());
  device_of(q).read(slots.data(), static_cast<int>(slots.size()));
  for (size_t i = 0; i < slots.size(); ++i)
    if (slots[i].first != kNoFailure) return messages[i](static_cast<int64_t>(slots[i].first), slots[i].bits);
  return {};
}

}  // namespace

void defer_value_check(const void* data, int64_t n, ValueRule rule, ValueMessage message) {
  if (n <= 0) return;
  Queue& q = queue();
  std::lock_guard<std::mutex> lock(q.mutex);
  if (static_cast<int>(q.messages.size()) == kDeferredSlots) {  // full: read early
    const std::string failure = drain(q);
    if (!failure.empty()) fail("{}", failure);
  }
  device_of(q).enqueue(static_cast<int>(q.messages.size()), data, n, rule);
  q.messages.push_back(std::move(message));
}

void raise_deferred_checks() {
  Queue& q = queue();
  std::lock_guard<std::mutex> lock(q.mutex);
  const std::string failure = drain(q);
  if (!failure.empty()) fail("{}", failure);
}

int64_t deferred_checks_pending() {
  Queue& q = queue();
  std::lock_guard<std::mutex> lock(q.mutex);
  return static_cast<int64_t>(q.messages.size());
}

DeferredCheckDevice* set_deferred_check_device(DeferredCheckDevice* device) {
  Queue& q = queue();
  std::lock_guard<std::mutex> lock(q.mutex);
  DeferredCheckDevice* old = q.device;
  q.device = device;
  q.messages.clear();  // verdicts of the other device are not ours to read
  return old;
}

}  // namespace retain::ops
