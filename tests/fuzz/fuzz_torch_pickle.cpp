// The restricted pickle machine of torch.save state dicts (checkpoints/export/torch_pickle.h):
// any byte string either parses into tensor records or is one retain::Error line; nothing is
// executed. An accepted state dict is written back and must parse to the same records.
#include "data/formats/torch_pickle.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  retain::fuzz::expect_clean([&] {
    const auto records = retain::formats::torchfile::parse_state_dict(bytes, "fuzz.pkl");
    std::vector<retain::formats::torchfile::TensorSpec> specs;
    for (const auto& r : records) {
      if (r.shape.size() > 8) return;
      for (int64_t d : r.shape)
        if (d < 0 || d > 64) return;  // keep the writer's buffers small
      specs.push_back({r.name, r.dtype, r.shape});
    }
    const auto again = retain::formats::torchfile::parse_state_dict(retain::formats::torchfile::write_state_dict(specs), "rewritten");
    if (again.size() != specs.size()) retain::fuzz::bug("rewritten pickle", "lost records");
    for (size_t i = 0; i < specs.size(); ++i)
      if (again[i].name != specs[i].name || again[i].dtype != specs[i].dtype || again[i].shape != specs[i].shape)
        retain::fuzz::bug("rewritten pickle", specs[i].name);
  });
  return 0;
}
