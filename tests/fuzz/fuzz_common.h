// Shared by the fuzz targets (tests/fuzz/fuzz_*.cpp). The contract every parser must keep on
// any input: return normally or throw retain::Error whose message is one non-empty line and
// not an internal check. Anything else (another exception type escaping, a crash, a sanitizer
// report, a hang) is a bug the fuzzer reports. Targets that open files write the input to a
// per-process scratch file first, since the parsers under test take paths.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>
#include <string_view>
#include <typeinfo>

#include "kernels/base/error.h"

namespace retain::fuzz {

// Aborts (a finding for libFuzzer) with the offending message.
[[noreturn]] inline void bug(std::string_view kind, std::string_view what) {
  std::fprintf(stderr, "fuzz: %.*s: %.*s\n", static_cast<int>(kind.size()), kind.data(),
               static_cast<int>(what.size()), what.data());
  std::abort();
}

// Runs `body` under the contract above.
template <typename F>
void expect_clean(F&& body) {
  try {
    body();
  } catch (const Error& e) {
    const std::string_view what = e.what();
    if (what.empty()) bug("empty error message", what);
    if (what.find('\n') != std::string_view::npos) bug("error message spans several lines", what);
    if (what.rfind("internal check failed", 0) == 0) bug("internal check reached by input", what);
  } catch (const std::exception& e) {
    bug(std::string("escaped exception ") + typeid(e).name(), e.what());
  }
}

// A scratch directory of this process (in /dev/shm when there is one: no disk I/O per run),
// removed at exit.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    namespace fs = std::filesystem;
    const fs::path base = fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    // The pid zero-padded: the path's length, which error messages quote, is the same in every
    // process, so a run with a fixed seed and run count (FUZZ_CI) takes the same paths anywhere.
    char name[32];
    std::snprintf(name, sizeof name, "retain_fuzz_%010ld", static_cast<long>(::getpid()));
    fs::path d = base / name;
    fs::create_directories(d);
    static const fs::path cleanup = d;
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(cleanup, ec);
    });
    return d;
  }();
  return dir;
}

// Writes the input to scratch_dir()/name and returns its path.
inline std::string write_input(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = (scratch_dir() / name).string();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || (size && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) {
    std::perror(path.c_str());
    std::abort();  // the harness itself failed: not a finding, but never silently pass
  }
  return path;
}

// Touches every byte of a buffer the parser handed out, so that a view past the end of a
// mapping is a sanitizer report (or a SIGBUS) here rather than later.
inline uint64_t checksum(const void* p, size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

}  // namespace retain::fuzz
