// torch.save archives (checkpoints/export/torch_file.h): the zip container through libzip,
// the records it names, every strided view checked against its storage. Accepted archives
// are written again and must read back to the same tensors.
#include <cstring>

#include "data/formats/torch_file.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = retain::fuzz::write_input("input.pth", data, size);
  retain::fuzz::expect_clean([&] {
    const auto tensors = retain::formats::torchfile::read_torch_file(path);
    size_t total = 0;
    for (const auto& [name, t] : tensors) total += t.nbytes();
    if (total > (64u << 20)) return;
    const std::string again = (retain::fuzz::scratch_dir() / "again.pth").string();
    retain::formats::torchfile::write_torch_file(again, tensors);
    const auto back = retain::formats::torchfile::read_torch_file(again);
    if (back.size() != tensors.size()) retain::fuzz::bug("rewritten archive", "lost tensors");
    for (size_t i = 0; i < back.size(); ++i)
      if (back[i].first != tensors[i].first || back[i].second.nbytes() != tensors[i].second.nbytes() ||
          std::memcmp(back[i].second.raw(), tensors[i].second.raw(), back[i].second.nbytes()) != 0)
        retain::fuzz::bug("rewritten archive", back[i].first);
  });
  return 0;
}
