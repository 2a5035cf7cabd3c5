#include "kernels/base/fault.h"

#include <unistd.h>

#include <cstdlib>
#include <string>

namespace retain::fault {

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

}  // namespace

bool write_fails(std::string_view path) {
  static const std::string needle = env("RETAIN_FAULT_ENOSPC");
  return !needle.empty() && path.find(needle) != std::string_view::npos;
}

bool hangs_at(int rank, int64_t step) {
  static const std::string hang_rank = env("RETAIN_FAULT_HANG_RANK"), at = env("RETAIN_FAULT_AT_STEP"),
                           where = env("RETAIN_FAULT_HANG_IN");
  if (hang_rank.empty() || std::atoi(hang_rank.c_str()) != rank || !where.empty()) return false;
  return step == (at.empty() ? 1 : std::atoll(at.c_str()));
}

bool hangs_in_ring(int group_rank) {
  static const std::string hang_rank = env("RETAIN_FAULT_HANG_RANK"), where = env("RETAIN_FAULT_HANG_IN");
  return where == "ring" && !hang_rank.empty() && std::atoi(hang_rank.c_str()) == group_rank;
}

bool overflows_after(int64_t step) {
  static const std::string at = env("RETAIN_FAULT_OVERFLOW_AFTER_STEP");
  return !at.empty() && step == std::atoll(at.c_str());
}

void hang_forever() {
  for (;;) ::pause();  // signals that are handled (SIGTERM's flag) return here and pause again
}

}  // namespace retain::fault
