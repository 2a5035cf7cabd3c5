#include "data/document.h"

#include <nlohmann/json.hpp>

#include <fmt/format.h>

namespace retain::data {

namespace {

using json = nlohmann::json;

ParsedRecord error(std::string message) {
  ParsedRecord r;
  r.status = ParsedRecord::Status::error;
  r.error = std::move(message);
  return r;
}

void append(Document& d, const std::vector<int32_t>& ids, uint8_t target) {
  d.ids.insert(d.ids.end(), ids.begin(), ids.end());
  d.target_mask.insert(d.target_mask.end(), ids.size(), target);
}

void append(Document& d, int32_t id, uint8_t target) {
  d.ids.push_back(id);
  d.target_mask.push_back(target);
}

// Index of the first token of `ids` (the encoding of header + content) that carries a byte of
// the content, i.e. the first token whose decoded prefix runs past the header's bytes. Encoding
// the segment whole (not header and content apart) keeps the ids exactly those of the rendered
// template; a token straddling the boundary counts as content.
size_t content_start(const Tokenizer& tok, const std::vector<int32_t>& ids, size_t header_bytes) {
  for (size_t k = 0; k < ids.size(); ++k)
    if (tok.decode(std::span<const int32_t>(ids.data(), k + 1)).size() > header_bytes) return k;
  return ids.size();
}

ParsedRecord from_messages(const json& messages, const Tokenizer& tok, const ChatTokens& chat,
                           const DocumentOptions& opt) {
  if (!messages.is_array()) return error("\"messages\" is not an array");
  if (!chat.available())
    return error(fmt::format("\"messages\" needs the Qwen3 chat template tokens <|im_start|> and <|im_end|>, "
                             "which {} lacks",
                             tok.file().string()));
  ParsedRecord r;
  r.status = ParsedRecord::Status::document;
  Document& d = r.doc;
  for (size_t m = 0; m < messages.size(); ++m) {
    const json& msg = messages[m];
    if (!msg.is_object()) return error(fmt::format("messages[{}] is not an object", m));
    auto role = msg.find("role");
    auto content = msg.find("content");
    if (role == msg.end() || !role->is_string())
      return error(fmt::format("messages[{}] has no string \"role\"", m));
    if (content == msg.end() || !content->is_string())
      return error(fmt::format("messages[{}] has no string \"content\"", m));
    const std::string& role_s = role->get_ref<const std::string&>();
    const std::string header = role_s + "\n";
    const std::vector<int32_t> seg = tok.encode(header + content->get_ref<const std::string&>());
    const bool assistant_targets = opt.targets == Targets::assistant && role_s == "assistant";
    const uint8_t all = opt.targets == Targets::all ? 1 : 0;
    append(d, chat.im_start, all);
    if (assistant_targets) {
      const size_t k = content_start(tok, seg, header.size());
      for (size_t i = 0; i < seg.size(); ++i) append(d, seg[i], i >= k ? 1 : 0);
    } else {
      append(d, seg, all);
    }
    append(d, chat.im_end, assistant_targets ? 1 : all);
    append(d, chat.newline, all);
  }
  if (d.ids.empty()) r.status = ParsedRecord::Status::empty;
  return r;
}

ParsedRecord from_input_ids(const json& line, const json& ids, const DocumentOptions& opt) {
  if (!ids.is_array()) return error("\"input_ids\" is not an array");
  ParsedRecord r;
  r.status = ParsedRecord::Status::document;
  Document& d = r.doc;
  d.ids.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const json& v = ids[i];
    if (!v.is_number_integer())
      return error(fmt::format("input_ids[{}] is not an integer", i));
    const int64_t id = v.is_number_unsigned() ? (v.get<uint64_t>() > INT64_MAX ? INT64_MAX : v.get<int64_t>())
                                              : v.get<int64_t>();
    if (id < 0 || id >= opt.vocab_size)
      return error(fmt::format("input_ids[{}] = {} is outside the vocabulary [0, {})", i, id, opt.vocab_size));
    d.ids.push_back(static_cast<int32_t>(id));
  }
  auto mask = line.find("target_mask");
  if (mask != line.end()) {
    if (!mask->is_array()) return error("\"target_mask\" is not an array");
    if (mask->size() != ids.size())
      return error(fmt::format("\"target_mask\" has {} values for {} input_ids", mask->size(), ids.size()));
    for (size_t i = 0; i < mask->size(); ++i) {
      const json& v = (*mask)[i];
      if (v.is_boolean()) {
        d.target_mask.push_back(v.get<bool>() ? 1 : 0);
      } else if (v.is_number_integer() && (v.get<int64_t>() == 0 || v.get<int64_t>() == 1)) {
        d.target_mask.push_back(static_cast<uint8_t>(v.get<int64_t>()));
      } else {
        return error(fmt::format("target_mask[{}] = {} is not 0 or 1", i, v.dump()));
      }
    }
  } else {
    d.target_mask.assign(d.ids.size(), 1);
  }
  if (d.ids.empty()) r.status = ParsedRecord::Status::empty;
  return r;
}

bool is_blank(std::string_view s) {
  for (char c : s)
    if (c != ' ' && c != '\t' && c != '\r' && c != '\n') return false;
  return true;
}

// The separator ends every document and belongs to it. It is a target when the document's
// last token is (so a prompt-only tail stays unpredicted); text documents are all targets.
void finish(ParsedRecord& r, const DocumentOptions& opt) {
  if (r.status != ParsedRecord::Status::document) return;
  const uint8_t last = r.doc.target_mask.back();
  append(r.doc, opt.eos_id, last);
}

}  // namespace

ChatTokens ChatTokens::of(const Tokenizer& tok) {
  ChatTokens c;
  c.im_start = tok.token_to_id("<|im_start|>").value_or(-1);
  c.im_end = tok.token_to_id("<|im_end|>").value_or(-1);
  c.newline = tok.encode("\n");
  return c;
}

ParsedRecord parse_json_record(std::string_view line, const Tokenizer& tok, const ChatTokens& chat,
                               const DocumentOptions& opt) {
  if (is_blank(line)) return ParsedRecord{};
  // nlohmann's parser takes a NUL byte for the end of the input and would ignore what follows.
  if (line.find('\0') != std::string_view::npos) return error("invalid JSON: the line holds a NUL byte");
  json j;
  try {
    j = json::parse(line);
  } catch (const json::exception& e) {
    // nlohmann's message starts with "[json.exception.parse_error.101] "; keep the rest.
    std::string what = e.what();
    if (auto p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
    return error("invalid JSON: " + what);
  }
  if (!j.is_object()) return error("the line is not a JSON object");
  const int kinds = int(j.contains("text")) + int(j.contains("messages")) + int(j.contains("input_ids"));
  if (kinds == 0) return error("the object has none of \"text\", \"messages\", \"input_ids\"");
  if (kinds > 1) return error("the object has more than one of \"text\", \"messages\", \"input_ids\"");
  if (j.contains("target_mask") && !j.contains("input_ids"))
    return error("\"target_mask\" goes only with \"input_ids\"");
  ParsedRecord r;
  if (auto t = j.find("text"); t != j.end()) {
    if (!t->is_string()) return error("\"text\" is not a string");
    r = parse_text_record(t->get_ref<const std::string&>(), tok, opt);
    return r;  // parse_text_record already appended the separator
  } else if (auto m = j.find("messages"); m != j.end()) {
    r = from_messages(*m, tok, chat, opt);
  } else {
    r = from_input_ids(j, j["input_ids"], opt);
  }
  finish(r, opt);
  return r;
}

ParsedRecord parse_text_record(std::string_view text, const Tokenizer& tok, const DocumentOptions& opt) {
  ParsedRecord r;
  if (text.empty()) {
    r.status = ParsedRecord::Status::empty;
    return r;
  }
  if (!is_valid_utf8(text)) {
    r.status = ParsedRecord::Status::invalid_utf8;
    return r;
  }
  r.status = ParsedRecord::Status::document;
  tok.encode_append(text, r.doc.ids);
  if (r.doc.ids.empty()) {
    r.status = ParsedRecord::Status::empty;
    return r;
  }
  r.doc.target_mask.assign(r.doc.ids.size(), 1);
  finish(r, opt);
  return r;
}

bool is_valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) len = 2, cp = c & 0x1F;
    else if ((c & 0xF0) == 0xE0) len = 3, cp = c & 0x0F;
    else if ((c & 0xF8) == 0xF0) len = 4, cp = c & 0x07;
    else return false;
    if (i + len > n) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    // Overlong forms, surrogates and values past U+10FFFF are not UTF-8.
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += len;
  }
  return true;
}

}  // namespace retain::data
