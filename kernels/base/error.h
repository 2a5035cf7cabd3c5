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

// s with control characters as '?' (no length limit): a message built from untrusted pieces
// stays one line.
inline std::string one_line(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  return out;
}

// A string from an untrusted file (a tensor name, a key, a path it names), fit for a
// one-line message: control characters become '?', at most 200 bytes are shown ("..." after).
inline std::string printable(std::string_view s) {
  return s.size() > 200 ? one_line(s.substr(0, 200)) + "..." : one_line(s);
}

// Checks an internal invariant (a bug if it fails, not bad user input).
#define RETAIN_CHECK(cond, ...)                                                   \
  do {                                                                            \
    if (!(cond))                                                                  \
      ::retain::fail("internal check failed at {}:{}: {}: {}", __FILE__, __LINE__, \
                     #cond, ::fmt::format(__VA_ARGS__));                          \
  } while (0)

}  // namespace retain
