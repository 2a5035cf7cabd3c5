// tokenizer.json (Tokenizer::load): normalizer, pre-tokenizer regexes, vocabulary, merges,
// added tokens; a tokenizer that loads must then encode and decode without failing.
#include "data/tokenizer/tokenizer.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = retain::fuzz::write_input("tokenizer.json", data, size);
  retain::fuzz::expect_clean([&] {
    const retain::data::Tokenizer tok = retain::data::Tokenizer::load(path);
    const std::vector<int32_t> ids = tok.encode("Hello, world! <|endoftext|> 123 \xc3\xa9\xff  \n\t x");
    for (int32_t id : ids)
      if (id < 0 || id >= tok.vocab_size()) retain::fuzz::bug("encode", "id outside the vocabulary");
    (void)tok.decode(ids);
  });
  return 0;
}
