// Parsing of the integer lists tools take on the command line ("5 10 7" or "5,10,7"); a
// malformed list is a usage error (exit 2).
#pragma once
#include <charconv>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kernels/base/cli.h"

namespace retain::cli {

inline std::vector<int64_t> parse_int_list(const std::string& text, const char* option) {
  std::vector<int64_t> out;
  size_t i = 0;
  while (i < text.size()) {
    if (text[i] == ' ' || text[i] == ',' || text[i] == '\t' || text[i] == '\n') {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < text.size() && text[j] != ' ' && text[j] != ',' && text[j] != '\t' && text[j] != '\n') ++j;
    int64_t v = 0;
    auto [end, ec] = std::from_chars(text.data() + i, text.data() + j, v);
    if (ec != std::errc() || end != text.data() + j)
      throw UsageError(fmt::format("{}: '{}' is not an integer", option, text.substr(i, j - i)));
    out.push_back(v);
    i = j;
  }
  return out;
}

}  // namespace retain::cli
