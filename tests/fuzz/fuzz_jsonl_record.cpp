// JSON-lines records (data/document.h): `text`, `messages` (the Qwen3 chat template, assistant
// targets) and `input_ids` + `target_mask`, one record per input line as retain-pack reads
// them, with the committed tiny model's tokenizer (it has <|im_start|>/<|im_end|>). Every
// document that comes out must be well formed: one mask entry per id, ids in the vocabulary.
#include <string_view>

#include "data/document.h"
#include "tests/fuzz/fuzz_common.h"

using namespace retain::data;

static void check(const ParsedRecord& r, const DocumentOptions& opt) {
  if (r.status == ParsedRecord::Status::error && r.error.empty()) retain::fuzz::bug("record", "error without a message");
  if (r.status != ParsedRecord::Status::document) return;
  if (r.doc.ids.size() != r.doc.target_mask.size()) retain::fuzz::bug("record", "mask and ids differ in length");
  if (r.doc.ids.empty() || r.doc.ids.back() != opt.eos_id) retain::fuzz::bug("record", "document without its EOS");
  for (int32_t id : r.doc.ids)
    if (id < 0 || id >= opt.vocab_size) retain::fuzz::bug("record", "id outside the vocabulary");
  for (uint8_t m : r.doc.target_mask)
    if (m > 1) retain::fuzz::bug("record", "mask value other than 0/1");
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Tokenizer tok = Tokenizer::load(std::string(RETAIN_FIXTURES_DIR) + "/trainer/model/tokenizer.json");
  static const ChatTokens chat = ChatTokens::of(tok);
  DocumentOptions all, assistant;
  all.eos_id = assistant.eos_id = *tok.token_to_id("<|endoftext|>");
  all.vocab_size = assistant.vocab_size = tok.vocab_size();
  assistant.targets = Targets::assistant;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  retain::fuzz::expect_clean([&] {
    for (size_t at = 0; at <= input.size();) {
      size_t end = input.find('\n', at);
      if (end == std::string_view::npos) end = input.size();
      const std::string_view line = input.substr(at, end - at);
      check(parse_json_record(line, tok, chat, all), all);
      check(parse_json_record(line, tok, chat, assistant), assistant);
      at = end + 1;
    }
    check(parse_text_record(input, tok, all), all);
  });
  return 0;
}
