// The main() of the multi-rank test binaries: the same binary runs plainly (a one-rank
// LocalComm) and under `mpirun -np N` (MpiComm). Every rank runs every test in the same order
// and must issue the same collectives, so tests use non-fatal checks (EXPECT_*) around
// collectives: a failure on one rank must never skip a collective the others wait in.
// Rank 0 prints as usual; other ranks print their failures only, tagged with the rank; the
// exit status is 1 on every rank if any rank failed.
#pragma once
#include "kernels/dist/comm.h"

namespace retain::dist::mpi_test {

// The world the tests run in (built once by main).
Comm& world();

}  // namespace retain::dist::mpi_test
