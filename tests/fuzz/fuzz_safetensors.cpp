// safetensors files (model/safetensors.h): the header (length, JSON, dtypes, shapes,
// offsets tiling the data section) and, once accepted, every tensor view in bounds.
#include "data/formats/safetensors.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = retain::fuzz::write_input("input.safetensors", data, size);
  retain::fuzz::expect_clean([&] {
    const retain::formats::SafetensorsFile f = retain::formats::SafetensorsFile::open(path);
    uint64_t sum = f.metadata().size();
    for (const std::string& name : f.names()) {
      const retain::Tensor t = f.tensor(name);
      sum += retain::fuzz::checksum(t.raw(), t.nbytes());
    }
    if (sum == 42) std::fputc(' ', stderr);  // keep the reads
  });
  return 0;
}
