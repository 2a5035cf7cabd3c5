// One training document: token ids and which of them may be predicted. Input records (JSON
// lines with `text`, `messages` or `input_ids`; plain text) become documents here, each
// ending with the separator (EOS) token that belongs to it. docs/data-format.md pins the rules.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "data/tokenizer/tokenizer.h"

namespace retain::data {

struct Document {
  std::vector<int32_t> ids;
  std::vector<uint8_t> target_mask;  // one per id, 1 = may be predicted
};

// Which tokens of a `messages` document are targets: every token, or only the assistant
// content with its closing <|im_end|>.
enum class Targets { all, assistant };

struct DocumentOptions {
  Targets targets = Targets::all;
  int32_t eos_id = 0;       // appended to every document
  int64_t vocab_size = 0;   // `input_ids` must lie in [0, vocab_size)
};

// What one input record turned into.
struct ParsedRecord {
  enum class Status { document, blank, empty, invalid_utf8, error };
  Status status = Status::blank;
  Document doc;
  std::string error;  // Status::error: the problem, without the file:line prefix
};

// The token ids of the Qwen3 chat template's special tokens, looked up once.
struct ChatTokens {
  int32_t im_start = -1, im_end = -1;
  std::vector<int32_t> newline;  // the ids of "\n" (it follows every <|im_end|>)
  bool available() const { return im_start >= 0 && im_end >= 0; }
  static ChatTokens of(const Tokenizer& tok);
};

// A JSON line: exactly one of "text" (string), "messages" ([{role, content}], rendered as
// `<|im_start|>{role}\n{content}<|im_end|>\n` per message) or "input_ids" (integers, with an
// optional "target_mask" of 0/1 of the same length). Whitespace-only lines are Status::blank.
ParsedRecord parse_json_record(std::string_view line, const Tokenizer& tok, const ChatTokens& chat,
                               const DocumentOptions& opt);

// Plain text (a line or a whole .txt file): every token is a target.
ParsedRecord parse_text_record(std::string_view text, const Tokenizer& tok, const DocumentOptions& opt);

bool is_valid_utf8(std::string_view s);

}  // namespace retain::data
