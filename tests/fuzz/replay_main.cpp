// main() for the fuzz targets in a build without libFuzzer (any compiler): runs
// LLVMFuzzerTestOneInput once on every file named on the command line or found in a named
// directory, as `fuzzer -runs=0 DIR...` does, so that CI replays the seed corpora and every
// committed regression input even where clang is absent. Flags (-foo=...) are ignored.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) __attribute__((weak));

namespace fs = std::filesystem;

static void run_one(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
  if (!in.good() && !in.eof()) {
    std::fprintf(stderr, "replay: %s: cannot read\n", p.c_str());
    std::exit(1);
  }
  std::fprintf(stderr, "replay: %s (%zu bytes)\n", p.c_str(), bytes.size());
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
  size_t runs = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind('-', 0) == 0) continue;
    if (fs::is_directory(arg)) {
      std::vector<fs::path> files;
      for (const auto& e : fs::recursive_directory_iterator(arg))
        if (e.is_regular_file()) files.push_back(e.path());
      std::sort(files.begin(), files.end());
      for (const auto& f : files) run_one(f), ++runs;
    } else if (fs::exists(arg)) {
      run_one(arg), ++runs;
    } else {
      std::fprintf(stderr, "replay: %s: no such file or directory\n", arg.c_str());
      return 1;
    }
  }
  std::fprintf(stderr, "replay: %zu inputs, no failure\n", runs);
  return 0;
}
