// Comm::abort under mpirun, for the CTest comm.abort_np2: the last rank aborts with code 42
// while the others wait in a barrier it never enters. Without a working abort the job hangs
// (CTest's timeout fails it) or the waiting ranks go on and print UNREACHABLE (the test's
// FAIL_REGULAR_EXPRESSION). The test expects mpirun to exit with 42.
#include <cstdio>
#include <exception>

#include "kernels/dist/comm.h"

int main() {
  try {
    auto comm = retain::dist::make_comm();
    if (comm->size() < 2) {
      std::fprintf(stderr, "abort_demo: run under mpirun with at least 2 ranks\n");
      return 2;
    }
    comm->barrier();  // every rank is up
    if (comm->rank() == comm->size() - 1) {
      std::printf("abort_demo: rank %d aborts the job with code 42\n", comm->rank());
      comm->abort(42);
    }
    comm->barrier();  // never completes: the last rank does not come
    std::printf("abort_demo: UNREACHABLE on rank %d\n", comm->rank());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "abort_demo: %s\n", e.what());
    return 1;
  }
}
