// MPI_CHECK(call): runs an MPI call and turns a failure into retain::Error naming the call
// and MPI's own error string. Only effective on communicators whose error handler is
// MPI_ERRORS_RETURN (the MPI comm sets it); with the default handler MPI aborts first.
#pragma once
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1  // the C API only: no deprecated C++ bindings
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <string>

namespace retain::dist {

// MPI's text for an error code, e.g. "MPI_ERR_COUNT: invalid count argument".
std::string mpi_error_string(int code);

// Throws retain::Error: "rank R: MPI_Bcast failed at file:line: <MPI's error string>".
[[noreturn]] void mpi_fail(const char* call, int code, const char* file, int line);

}  // namespace retain::dist

#define MPI_CHECK(call)                                                    \
  do {                                                                     \
    const int retain_mpi_rc_ = (call);                                     \
    if (retain_mpi_rc_ != MPI_SUCCESS)                                     \
      ::retain::dist::mpi_fail(#call, retain_mpi_rc_, __FILE__, __LINE__); \
  } while (0)
