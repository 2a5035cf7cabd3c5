// Corpus files as retain-pack reads them (data/input_file.h): gzip detected by magic bytes,
// multi-member streams, zero padding, trailing garbage, truncation, a byte order mark, JSON
// lines split at newlines. Seeds: tests/fuzz/seeds/gzip_input (see its README).
#include "data/input_file.h"
#include "tests/fuzz/fuzz_common.h"

using namespace retain::data;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = retain::fuzz::write_input("corpus.jsonl", data, size);
  retain::fuzz::expect_clean([&] {
    for (const TxtMode mode : {TxtMode::line, TxtMode::file}) {
      InputFile in(path, mode == TxtMode::line ? InputFormat::jsonl : InputFormat::txt, mode);
      InputRecord r;
      int64_t last = 0;
      while (in.next(r)) {
        if (r.line <= last) retain::fuzz::bug("input", "line numbers do not increase");
        last = r.line;
      }
      if (in.bytes_consumed() > in.size_bytes()) retain::fuzz::bug("input", "consumed more bytes than the file has");
    }
  });
  return 0;
}
