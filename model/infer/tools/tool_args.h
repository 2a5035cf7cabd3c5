// What retain-generate, retain-eval and retain-plot check on their command lines, the same way
// (README conventions): a policy, budget or buffer that cannot be right whatever the files hold
// is a usage error (exit 2); an output whose folder is missing is refused before any work.
#pragma once
#include <filesystem>
#include <string>

#include <fmt/format.h>

#include "kernels/base/cli.h"
#include "model/infer/policy.h"

namespace retain::infer {

inline PolicyKind policy_arg(const std::string& text, const char* option) {
  try {
    return parse_policy(text, option);
  } catch (const Error& e) {
    throw cli::UsageError(e.what());
  }
}

// Budget/buffer range, gates present for the policies that rank by logβ or by KVPOP scorers.
// (kvpop's exact minimum budget needs the scorers' window and sinks: checked once they are loaded.)
inline void check_policy_args(const PolicyOptions& p, bool have_gates) {
  if (p.kind == PolicyKind::kvpop && !have_gates)
    throw cli::UsageError("--policy kvpop ranks tokens by KVPOP scorers: give --gates FILE (retain-train --gate kvpop)");
  if (p.kind == PolicyKind::oracle_m && !have_gates)
    throw cli::UsageError(
        "--policy oracle-m takes the window, sinks and decay of KVPOP scorers: give --gates FILE (retain-train --gate kvpop)");
  try {
    make_policy(p);
  } catch (const Error& e) {
    throw cli::UsageError(e.what());
  }
  if (policy_needs_gates(p.kind) && !have_gates)
    throw cli::UsageError(fmt::format("--policy {} ranks tokens by their retention gates: give --gates FILE",
                                      policy_name(p.kind)));
}

}  // namespace retain::infer
