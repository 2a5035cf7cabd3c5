// One exception type for every user-facing failure. Tools catch it in main and print
// its message as a single line on stderr, so messages name the file/argument and the problem.
#pragma once
#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace retain {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// RETAIN_FAIL("{}: bad header", path) throws retain::Error with a formatted message.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

// A string from an untrusted file, fit for a one-line message: control bytes and bytes ≥ 0x7f
// as \xNN (valid UTF-8 is not decoded: a message stays ASCII), at most `max` bytes shown.
inline std::string printable(std::string_view s, size_t max = 96) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < max; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  if (s.size() > max) out += fmt::format("… ({} bytes)", s.size());
  return out;
}

// Checks an internal invariant (a bug if it fails, not bad user input).
#define RETAIN_CHECK(cond, ...)                                                   \
  do {                                                                            \
    if (!(cond))                                                                  \
      ::retain::fail("internal check failed at {}:{}: {}: {}", __FILE__, __LINE__, \
                     #cond, ::fmt::format(__VA_ARGS__));                          \
  } while (0)

}  // namespace retain
