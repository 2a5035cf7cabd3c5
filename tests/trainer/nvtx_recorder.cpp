// An NVTX injection library for tests: a process started with NVTX_INJECTION64_PATH naming this
// library and RETAIN_NVTX_LOG naming a file writes one line per range event there, so a test can
// read back the ranges a run opened (the way nsys sees them, without nsys or a GPU):
//
//   <thread> push <name>      nvtxRangePushA (NvtxRange)
//   <thread> pop              nvtxRangePop
//   <thread> start <id> <name>  nvtxRangeStartA (NvtxSpan)
//   <thread> end <id>         nvtxRangeEnd
//
// NVTX 3 (header-only) loads the library at the process's first NVTX call and calls
// InitializeInjectionNvtx2, which replaces the core module's entries with the functions below
// (nvtx3/nvtxDetail/nvtxInit.h and nvtxTypes.h: the documented injection interface). Each
// process appends to "<RETAIN_NVTX_LOG>.<pid>", so that ranks under mpirun do not interleave.
#include <nvtx3/nvToolsExt.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

namespace {

std::mutex g_mutex;
std::FILE* g_log = nullptr;
std::atomic<uint64_t> g_next_id{1};

unsigned long thread_number() {
  return static_cast<unsigned long>(std::hash<std::thread::id>{}(std::this_thread::get_id()) % 1000000007u);
}

template <class... Args>
void record(const char* format, Args... args) {
  const std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_log) return;
  std::fprintf(g_log, "%lu ", thread_number());
  std::fprintf(g_log, format, args...);
  std::fputc('\n', g_log);
  std::fflush(g_log);  // a rank that is killed keeps what it recorded
}

int NVTX_API push_range(const char* name) {
  record("push %s", name ? name : "");
  return 0;
}
int NVTX_API pop_range() {
  record("pop");
  return 0;
}
nvtxRangeId_t NVTX_API start_range(const char* name) {
  const uint64_t id = g_next_id++;
  record("start %llu %s", static_cast<unsigned long long>(id), name ? name : "");
  return id;
}
void NVTX_API end_range(nvtxRangeId_t id) { record("end %llu", static_cast<unsigned long long>(id)); }

template <class F>
void set_entry(NvtxFunctionTable table, unsigned size, NvtxCallbackIdCore id, F* fn) {
  if (static_cast<unsigned>(id) <= size && table[id]) *table[id] = reinterpret_cast<NvtxFunctionPointer>(fn);
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_table) {
  const char* path = std::getenv("RETAIN_NVTX_LOG");
  if (!path || !get_table) return 0;
  const auto* callbacks = static_cast<const NvtxExportTableCallbacks*>(get_table(NVTX_ETID_CALLBACKS));
  NvtxFunctionTable table = nullptr;
  unsigned size = 0;
  if (!callbacks || !callbacks->GetModuleFunctionTable ||
      !callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &table, &size) || !table)
    return 0;
  const std::string file = std::string(path) + "." + std::to_string(getpid());
  g_log = std::fopen(file.c_str(), "a");
  if (!g_log) return 0;
  set_entry(table, size, NVTX_CBID_CORE_RangePushA, &push_range);
  set_entry(table, size, NVTX_CBID_CORE_RangePop, &pop_range);
  set_entry(table, size, NVTX_CBID_CORE_RangeStartA, &start_range);
  set_entry(table, size, NVTX_CBID_CORE_RangeEnd, &end_range);
  return 1;
}
