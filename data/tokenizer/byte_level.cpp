#include "data/tokenizer/byte_level.h"

#include "data/tokenizer/utf8.h"

namespace retain::data::byte_level {

namespace {

struct Tables {
  std::array<char32_t, 256> to_cp{};
  std::array<std::string, 256> to_utf8;
  std::array<int, 324> from_cp{};  // code points used are < 256 + 68
  Tables() {
    from_cp.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_cp[b] = printable ? static_cast<char32_t>(b) : next++;
      from_cp[to_cp[b]] = b;
      utf8::append(to_utf8[b], to_cp[b]);
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

const std::array<char32_t, 256>& byte_to_code_point() { return tables().to_cp; }
const std::array<std::string, 256>& byte_to_utf8() { return tables().to_utf8; }
int code_point_to_byte(char32_t cp) { return cp < tables().from_cp.size() ? tables().from_cp[cp] : -1; }

}  // namespace retain::data::byte_level
