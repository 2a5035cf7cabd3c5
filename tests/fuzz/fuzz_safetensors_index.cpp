// model.safetensors.index.json (retain::formats::SafetensorsSet::open_dir): the fuzzed index sits in a
// directory beside the committed four-shard checkpoint's shards, so an index that names them
// correctly reaches the cross-checks between index and shards.
#include <filesystem>

#include "data/formats/safetensors.h"
#include "tests/fuzz/fuzz_common.h"

namespace fs = std::filesystem;

static const fs::path kShards = std::string(RETAIN_FIXTURES_DIR) + "/hf/untied_gqa4_yarn_sharded";

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const fs::path dir = [] {
    const fs::path d = retain::fuzz::scratch_dir() / "index";
    fs::create_directories(d);
    for (const auto& e : fs::directory_iterator(kShards))
      if (e.path().filename().string().rfind("model-", 0) == 0)
        fs::create_symlink(e.path(), d / e.path().filename());
    return d;
  }();
  retain::fuzz::write_input("index/model.safetensors.index.json", data, size);
  retain::fuzz::expect_clean([&] {
    const retain::formats::SafetensorsSet set = retain::formats::SafetensorsSet::open_dir(dir.string());
    uint64_t sum = set.metadata().size();
    for (const std::string& name : set.names()) sum += set.entry(name).end - set.entry(name).begin;
    if (sum == 42) std::fputc(' ', stderr);
  });
  return 0;
}
