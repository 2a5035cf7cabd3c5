// What the tests of one-line errors share: every retain::Error a user can meet is one line
// ("tool: error: FILE: problem"), so each check of an error also checks that.
#pragma once
#include <string>

#include <gtest/gtest.h>

#include "kernels/base/error.h"

namespace retain::test_support {

// The message of the retain::Error `call` throws, after checking it is one line; "" and a test
// failure when it throws none.
template <typename F> std::string one_line_error(F&& call) {
  try {
    call();
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.find('\n'), std::string::npos) << "not one line: " << m;
    return m;
  }
  ADD_FAILURE() << "no error";
  return "";
}

// `call` throws a one-line retain::Error that mentions `needle`.
template <typename F> void expect_one_line_error(F&& call, const std::string& needle) {
  const std::string m = one_line_error(call);
  EXPECT_NE(m.find(needle), std::string::npos) << "expected an error mentioning '" << needle << "', got: " << m;
}

}  // namespace retain::test_support
