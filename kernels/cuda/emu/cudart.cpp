// The emulator's CUDA runtime: the part of the cudart C API that retain calls, for one emulated
// device whose memory is host memory. Work is done when it is issued (streams and events only
// order what is already in order); errors are the runtime's own codes, and the checks a real
// device would make are made: copies and memsets must stay inside a device allocation on the
// device side (and off it on the host side), frees must name a live allocation, launches need
// a valid configuration and the opt-in for more than 48 KB of dynamic shared memory.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <string>

#include "kernels/cuda/emu/runtime_state.h"

namespace retain::cuda_emu::runtime {

namespace {

constexpr size_t kDeviceBytes = size_t{80} << 30;   // what the emulated device reports
constexpr int kSharedOptin = 232448;                 // an H100's opt-in shared memory per block
constexpr size_t kDefaultDynamicShared = 48 * 1024;  // without the opt-in

struct State {
  std::mutex mutex;
  std::map<uintptr_t, size_t> allocations;  // base → bytes
  size_t used = 0, high = 0;
  std::map<const void*, int> max_dynamic_shared;  // cudaFuncSetAttribute's opt-ins
  std::set<void*> streams, events;
};
State& state() {
  static auto* s = new State;  // never destroyed: frees at exit may come after static teardown
  return *s;
}

thread_local cudaError_t t_last_error = cudaSuccess;

cudaError_t fail(cudaError_t e) {
  t_last_error = e;
  return e;
}

// The allocation holding [p, p + bytes), or none.
bool in_device_allocation(const void* p, size_t bytes) {
  State& s = state();
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = s.allocations.upper_bound(a);
  if (it == s.allocations.begin()) return false;
  --it;
  return a >= it->first && a + bytes <= it->first + it->second && a + bytes >= a;
}
bool touches_device_memory(const void* p, size_t bytes) {
  State& s = state();
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = s.allocations.upper_bound(a + bytes - 1);
  if (it == s.allocations.begin()) return false;
  --it;
  return it->first + it->second > a;
}

// RETAIN_CUDA_EMU_TRACE_ALLOC=1: one stderr line per device allocation and free, with the
// bytes in use after it, to find what a memory high-water mark is made of.
void trace_allocation(const char* what, size_t bytes, size_t used) {
  static const bool on = [] {
    const char* v = std::getenv("RETAIN_CUDA_EMU_TRACE_ALLOC");
    return v && *v && std::string(v) != "0";
  }();
  if (on) std::fprintf(stderr, "cuda-emu: %s %zu bytes, %zu in use\n", what, bytes, used);
}

cudaError_t allocate(void** p, size_t bytes) {
  if (!p) return fail(cudaErrorInvalidValue);
  *p = nullptr;
  if (bytes == 0) return cudaSuccess;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.used + bytes > kDeviceBytes) return fail(cudaErrorMemoryAllocation);
  // Exactly `bytes` (256-aligned, as cudaMalloc's): in an AddressSanitizer build of the emulator
  // a kernel reading or writing past an allocation's end is reported there.
  void* m = nullptr;
  if (posix_memalign(&m, 256, bytes) != 0) return fail(cudaErrorMemoryAllocation);
  std::memset(m, 0xa5, bytes);  // device memory starts as garbage, never as zeros
  s.allocations[reinterpret_cast<uintptr_t>(m)] = bytes;
  s.used += bytes;
  s.high = std::max(s.high, s.used);
  trace_allocation("alloc", bytes, s.used);
  *p = m;
  return cudaSuccess;
}

cudaError_t release(void* p) {
  if (!p) return cudaSuccess;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.allocations.find(reinterpret_cast<uintptr_t>(p));
  if (it == s.allocations.end()) return fail(cudaErrorInvalidValue);
  s.used -= it->second;
  trace_allocation("free", it->second, s.used);
  s.allocations.erase(it);
  std::free(p);
  return cudaSuccess;
}

cudaError_t copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (bytes == 0) return cudaSuccess;
  if (!dst || !src) return fail(cudaErrorInvalidValue);
  {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    const bool dst_dev = in_device_allocation(dst, bytes), src_dev = in_device_allocation(src, bytes);
    bool ok = true;
    switch (kind) {
      case cudaMemcpyHostToDevice:
        ok = dst_dev && !touches_device_memory(src, bytes);
        break;
      case cudaMemcpyDeviceToHost:
        ok = src_dev && !touches_device_memory(dst, bytes);
        break;
      case cudaMemcpyDeviceToDevice:
        ok = dst_dev && src_dev;
        break;
      case cudaMemcpyHostToHost:
        ok = !touches_device_memory(dst, bytes) && !touches_device_memory(src, bytes);
        break;
      case cudaMemcpyDefault:  // any pair, but a device side must lie inside its allocation
        ok = (dst_dev || !touches_device_memory(dst, bytes)) && (src_dev || !touches_device_memory(src, bytes));
        break;
      default:
        ok = false;
    }
    if (!ok) return fail(cudaErrorInvalidValue);
  }
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}

cudaError_t set(void* dst, int value, size_t bytes) {
  if (bytes == 0) return cudaSuccess;
  {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!in_device_allocation(dst, bytes)) return fail(cudaErrorInvalidValue);
  }
  std::memset(dst, value, bytes);
  return cudaSuccess;
}

bool known_stream(cudaStream_t s) {
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return true;
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().streams.count(s) != 0;
}

struct Event {
  std::chrono::steady_clock::time_point at{};
  bool recorded = false;
  bool timing = true;
};

Event* as_event(cudaEvent_t e) {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().events.count(e) ? reinterpret_cast<Event*>(e) : nullptr;
}

cudaMemPool_t the_pool() { return reinterpret_cast<cudaMemPool_t>(&state()); }

}  // namespace

void set_launch_error(cudaError_t e) { t_last_error = e; }

bool dynamic_shared_allowed(const void* kernel, size_t bytes) {
  if (bytes <= kDefaultDynamicShared) return true;
  std::lock_guard<std::mutex> lock(state().mutex);
  auto it = state().max_dynamic_shared.find(kernel);
  return it != state().max_dynamic_shared.end() && bytes <= static_cast<size_t>(it->second);
}

}  // namespace retain::cuda_emu::runtime

using namespace retain::cuda_emu::runtime;

extern "C" {

// ---- errors -------------------------------------------------------------------------------
cudaError_t cudaGetLastError() {
  const cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return t_last_error; }
const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    default: return "cudaErrorUnknown";
  }
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorNotSupported: return "operation not supported";
    default: return "unknown error";
  }
}

// ---- the device -----------------------------------------------------------------------------
cudaError_t cudaGetDeviceCount(int* count) {
  if (!count) return fail(cudaErrorInvalidValue);
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  if (!device) return fail(cudaErrorInvalidValue);
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : fail(cudaErrorInvalidDevice); }
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (!prop) return fail(cudaErrorInvalidValue);
  if (device != 0) return fail(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "%s", "retain CUDA emulator (CPU)");
  prop->totalGlobalMem = kDeviceBytes;
  prop->sharedMemPerBlock = 48 * 1024;
  prop->sharedMemPerBlockOptin = kSharedOptin;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 1;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (!value) return fail(cudaErrorInvalidValue);
  if (device != 0) return fail(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = kSharedOptin; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = 48 * 1024; return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *value = 1; return cudaSuccess;
    case cudaDevAttrWarpSize: *value = 32; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; return cudaSuccess;
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; return cudaSuccess;
    default: return fail(cudaErrorInvalidValue);
  }
}
cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (!func) return fail(cudaErrorInvalidDeviceFunction);
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;  // hints only
  if (value < 0 || value > kSharedOptin) return fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(state().mutex);
  state().max_dynamic_shared[func] = value;
  return cudaSuccess;
}

// ---- memory -------------------------------------------------------------------------------
cudaError_t cudaMalloc(void** p, size_t bytes) { return allocate(p, bytes); }
cudaError_t cudaFree(void* p) { return release(p); }
cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t s) {
  if (!known_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  return allocate(p, bytes);
}
cudaError_t cudaFreeAsync(void* p, cudaStream_t s) {
  if (!known_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  return release(p);
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return copy(dst, src, bytes, kind);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s) {
  if (!known_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  return copy(dst, src, bytes, kind);
}
cudaError_t cudaMemset(void* dst, int value, size_t bytes) { return set(dst, value, bytes); }
cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t s) {
  if (!known_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  return set(dst, value, bytes);
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  if (!free_bytes || !total) return fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(state().mutex);
  *total = kDeviceBytes;
  *free_bytes = kDeviceBytes - state().used;
  return cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  if (!a) return fail(cudaErrorInvalidValue);
  *a = cudaPointerAttributes{};
  std::lock_guard<std::mutex> lock(state().mutex);
  if (p && in_device_allocation(p, 1)) {
    a->type = cudaMemoryTypeDevice;
    a->device = 0;
    a->devicePointer = const_cast<void*>(p);
  } else {
    a->type = cudaMemoryTypeUnregistered;
    a->device = -2;
    a->hostPointer = const_cast<void*>(p);
  }
  return cudaSuccess;
}
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device) {
  if (!pool) return fail(cudaErrorInvalidValue);
  if (device != 0) return fail(cudaErrorInvalidDevice);
  *pool = the_pool();
  return cudaSuccess;
}
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
  if (pool != the_pool() || !value) return fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(state().mutex);
  switch (attr) {
    case cudaMemPoolAttrReleaseThreshold:
      return cudaSuccess;  // nothing is pooled: freed memory goes back at once
    case cudaMemPoolAttrUsedMemHigh:
    case cudaMemPoolAttrReservedMemHigh:
      if (*static_cast<uint64_t*>(value) != 0) return fail(cudaErrorInvalidValue);  // only a reset
      state().high = state().used;
      return cudaSuccess;
    default:
      return fail(cudaErrorInvalidValue);
  }
}
cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
  if (pool != the_pool() || !value) return fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(state().mutex);
  auto* v = static_cast<uint64_t*>(value);
  switch (attr) {
    case cudaMemPoolAttrUsedMemCurrent:
    case cudaMemPoolAttrReservedMemCurrent:
      *v = state().used;
      return cudaSuccess;
    case cudaMemPoolAttrUsedMemHigh:
    case cudaMemPoolAttrReservedMemHigh:
      *v = state().high;
      return cudaSuccess;
    case cudaMemPoolAttrReleaseThreshold:
      *v = UINT64_MAX;
      return cudaSuccess;
    default:
      return fail(cudaErrorInvalidValue);
  }
}

// ---- streams and events -------------------------------------------------------------------
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) {
  if (!s) return fail(cudaErrorInvalidValue);
  *s = reinterpret_cast<cudaStream_t>(new char);
  std::lock_guard<std::mutex> lock(state().mutex);
  state().streams.insert(*s);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  std::lock_guard<std::mutex> lock(state().mutex);
  if (!state().streams.erase(s)) return fail(cudaErrorInvalidResourceHandle);
  delete reinterpret_cast<char*>(s);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  return known_stream(s) ? cudaSuccess : fail(cudaErrorInvalidResourceHandle);
}
cudaError_t cudaStreamQuery(cudaStream_t s) {
  return known_stream(s) ? cudaSuccess : fail(cudaErrorInvalidResourceHandle);
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int) {
  if (!known_stream(s) || !as_event(e)) return fail(cudaErrorInvalidResourceHandle);
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int flags) {
  if (!e) return fail(cudaErrorInvalidValue);
  auto* ev = new Event;
  ev->timing = (flags & cudaEventDisableTiming) == 0;
  *e = reinterpret_cast<cudaEvent_t>(ev);
  std::lock_guard<std::mutex> lock(state().mutex);
  state().events.insert(*e);
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  Event* ev = as_event(e);
  if (!ev) return fail(cudaErrorInvalidResourceHandle);
  std::lock_guard<std::mutex> lock(state().mutex);
  state().events.erase(e);
  delete ev;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  Event* ev = as_event(e);
  if (!ev || !known_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  ev->at = std::chrono::steady_clock::now();
  ev->recorded = true;
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  return as_event(e) ? cudaSuccess : fail(cudaErrorInvalidResourceHandle);
}
cudaError_t cudaEventQuery(cudaEvent_t e) { return as_event(e) ? cudaSuccess : fail(cudaErrorInvalidResourceHandle); }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  Event *a = as_event(start), *b = as_event(end);
  if (!ms || !a || !b) return fail(cudaErrorInvalidResourceHandle);
  if (!a->timing || !b->timing) return fail(cudaErrorInvalidResourceHandle);
  if (!a->recorded || !b->recorded) return fail(cudaErrorInvalidResourceHandle);
  *ms = std::chrono::duration<float, std::milli>(b->at - a->at).count();
  return cudaSuccess;
}

}  // extern "C"
