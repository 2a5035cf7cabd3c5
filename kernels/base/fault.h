// Fault injection for the reliability tests (docs/reliability.md). Each fault is off unless
// its environment variable is set; none is a user option. They let tests produce, on demand,
// what real clusters produce by accident: a full disk, a rank that stops.
//   RETAIN_FAULT_ENOSPC=TEXT        every AtomicFile whose path contains TEXT fails its writes
//                                   with ENOSPC, as on a full disk.
//   RETAIN_FAULT_HANG_RANK=R        rank R of retain-train stops before step RETAIN_FAULT_AT_STEP
//   RETAIN_FAULT_AT_STEP=S          (default 1): it sleeps forever, calling no collective.
//   RETAIN_FAULT_HANG_IN=ring       instead, rank R of a context-parallel group stops at its
//                                   first ring shift (trainer/context_parallel.cpp), the others
//                                   waiting in the ring.
//   RETAIN_FAULT_OVERFLOW_AFTER_STEP=S  after optimizer step S retain-train's trainable values
//                                   overflow to ±inf, as a learning rate beyond any sane one would
//                                   make them (the command line now refuses such rates).
#pragma once
#include <cstdint>
#include <string_view>

namespace retain::fault {

// True when writes to `path` are to fail as on a full disk.
bool write_fails(std::string_view path);

// True when rank `rank` is to hang before step `step` (1-based).
bool hangs_at(int rank, int64_t step);

// True when rank `group_rank` of a context-parallel group is to hang at its first ring shift.
bool hangs_in_ring(int group_rank);

// True when the trainable values are to overflow after optimizer step `step` (1-based).
bool overflows_after(int64_t step);

// Never returns: sleeps, calling nothing, until killed.
[[noreturn]] void hang_forever();

}  // namespace retain::fault
