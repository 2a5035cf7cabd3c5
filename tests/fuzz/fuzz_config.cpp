// config.json (Qwen3Config::load): both key styles, RoPE/YaRN parameters, every rejection.
#include <nlohmann/json.hpp>

#include "model/config.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = retain::fuzz::write_input("config.json", data, size);
  retain::fuzz::expect_clean([&] {
    const retain::Qwen3Config c = retain::Qwen3Config::load(path);
    (void)c.to_json().dump();  // what a checkpoint would record about it
  });
  return 0;
}
