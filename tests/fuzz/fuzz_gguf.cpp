// GGUF v3 files (checkpoints/export/gguf.h): header, typed metadata (arrays too), tensor infos,
// offsets and alignment against the file. An accepted file is written again and must read back
// to the same metadata and tensors (the writer/reader round trip).
#include <cstring>

#include "data/formats/gguf.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = retain::fuzz::write_input("input.gguf", data, size);
  retain::fuzz::expect_clean([&] {
    const retain::formats::gguf::File f = retain::formats::gguf::read_file(path);
    for (const auto& [name, t] : f.tensors)
      if (t.ndim() == 0 || t.numel() > (1 << 22)) return;
    const std::string again = (retain::fuzz::scratch_dir() / "again.gguf").string();
    retain::formats::gguf::write_file(again, f.metadata, f.tensors, f.alignment);
    const retain::formats::gguf::File g = retain::formats::gguf::read_file(again);
    if (g.metadata.size() != f.metadata.size() || g.tensors.size() != f.tensors.size())
      retain::fuzz::bug("rewritten gguf", "counts differ");
    for (size_t i = 0; i < f.metadata.size(); ++i)
      if (g.metadata[i].first != f.metadata[i].first || g.metadata[i].second.to_string() != f.metadata[i].second.to_string())
        retain::fuzz::bug("rewritten gguf", f.metadata[i].first);
    for (size_t i = 0; i < f.tensors.size(); ++i)
      if (g.tensors[i].first != f.tensors[i].first || g.tensors[i].second.shape() != f.tensors[i].second.shape() ||
          std::memcmp(g.tensors[i].second.raw(), f.tensors[i].second.raw(), f.tensors[i].second.nbytes()) != 0)
        retain::fuzz::bug("rewritten gguf", f.tensors[i].first);
  });
  return 0;
}
