#include "data/tokenizer/utf8.h"

namespace retain::data::utf8 {

size_t valid_sequence_length(std::string_view s, size_t i, size_t* bad_len) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  if (b0 < 0x80) return 1;
  // Unicode Table 3-7: lead byte -> number of bytes and the range of the second byte.
  size_t need = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) need = 2;
  else if (b0 == 0xE0) need = 3, lo = 0xA0;
  else if (b0 >= 0xE1 && b0 <= 0xEC) need = 3;
  else if (b0 == 0xED) need = 3, hi = 0x9F;
  else if (b0 >= 0xEE && b0 <= 0xEF) need = 3;
  else if (b0 == 0xF0) need = 4, lo = 0x90;
  else if (b0 >= 0xF1 && b0 <= 0xF3) need = 4;
  else if (b0 == 0xF4) need = 4, hi = 0x8F;
  size_t got = 1;  // bytes of a well-formed prefix seen so far
  if (need != 0) {
    for (; got < need && i + got < s.size(); ++got) {
      const unsigned char b = byte(i + got);
      const unsigned char l = got == 1 ? lo : 0x80, h = got == 1 ? hi : 0xBF;
      if (b < l || b > h) break;
    }
    if (got == need) return need;
  }
  if (bad_len) *bad_len = got;
  return 0;
}

size_t count_invalid(std::string_view s) {
  size_t n = 0;
  for (size_t i = 0; i < s.size();) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    size_t bad = 0;
    const size_t len = valid_sequence_length(s, i, &bad);
    if (len) {
      i += len;
    } else {
      ++n;
      i += bad;
    }
  }
  return n;
}

std::string sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 16);
  size_t i = 0;
  while (i < s.size()) {
    size_t bad = 0;
    const size_t len = valid_sequence_length(s, i, &bad);
    if (len) {
      out.append(s.data() + i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      i += bad;
    }
  }
  return out;
}

char32_t next_code_point(std::string_view s, size_t& i) {
  const auto b = [&](size_t k) { return static_cast<char32_t>(static_cast<unsigned char>(s[k])); };
  const char32_t b0 = b(i);
  if (b0 < 0x80) return i += 1, b0;
  if (b0 < 0xE0) return i += 2, ((b0 & 0x1F) << 6) | (b(i - 1) & 0x3F);
  if (b0 < 0xF0) return i += 3, ((b0 & 0x0F) << 12) | ((b(i - 2) & 0x3F) << 6) | (b(i - 1) & 0x3F);
  i += 4;
  return ((b0 & 0x07) << 18) | ((b(i - 3) & 0x3F) << 12) | ((b(i - 2) & 0x3F) << 6) | (b(i - 1) & 0x3F);
}

void append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace retain::data::utf8
