// Argument checks shared by every backend, and the choice of backend.
#include <cmath>
#include "trainer/dist/comm.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "kernels/base/error.h"

namespace retain::dist {
namespace {

// Bytes [p, p + n) as integers, so that ranges from different objects compare safely.
struct Span {
  uintptr_t begin, end;
};
Span span_of(const void* p, size_t bytes) {
  const auto b = reinterpret_cast<uintptr_t>(p);
  return {b, b + bytes};
}
bool overlap(Span a, Span b) { return a.begin < b.end && b.begin < a.end; }

// n * elem_bytes * factor without wrapping around.
size_t checked_bytes(const char* op, size_t n, size_t elem_bytes, size_t factor) {
  if (n > SIZE_MAX / elem_bytes / factor) fail("{}: count {} overflows the address space", op, n);
  return n * elem_bytes * factor;
}

void check_ptr(const char* op, const char* what, const void* p) {
  if (p == nullptr) fail("{}: {} is null with a nonzero count", op, what);
}

}  // namespace

namespace {

// The checks all_gather and all_gather_async share.
void check_all_gather(const char* op, const Comm& comm, const float* send, const float* recv,
                      size_t count_per_rank) {
  check_ptr(op, "send", send);
  check_ptr(op, "recv", recv);
  const size_t n = static_cast<size_t>(comm.size());
  const size_t block = checked_bytes(op, count_per_rank, sizeof(float), 1);
  const Span out = span_of(recv, checked_bytes(op, count_per_rank, sizeof(float), n));
  const bool in_place = send == recv + static_cast<size_t>(comm.rank()) * count_per_rank;
  if (!in_place && overlap(span_of(send, block), out))
    fail("{}: send overlaps recv without being this rank's block of it", op);
}

// A request that completed when it was made.
class DoneRequest final : public Request {
 public:
  void wait() override {}
  bool test() override { return true; }
};

}  // namespace

void Comm::all_gather(const float* send, float* recv, size_t count_per_rank) {
  if (count_per_rank == 0) return;
  check_all_gather("all_gather", *this, send, recv, count_per_rank);
  do_all_gather(send, recv, count_per_rank);
}

std::unique_ptr<Request> Comm::all_gather_async(const float* send, float* recv,
                                                size_t count_per_rank) {
  if (count_per_rank == 0) return std::make_unique<DoneRequest>();
  check_all_gather("all_gather_async", *this, send, recv, count_per_rank);
  return do_all_gather_async(send, recv, count_per_rank);
}

void Comm::all_gather_bytes(const void* send, void* recv, size_t bytes_per_rank) {
  if (bytes_per_rank == 0) return;
  check_ptr("all_gather_bytes", "send", send);
  check_ptr("all_gather_bytes", "recv", recv);
  const size_t n = static_cast<size_t>(size());
  const Span out = span_of(recv, checked_bytes("all_gather_bytes", bytes_per_rank, 1, n));
  if (overlap(span_of(send, bytes_per_rank), out))
    fail("all_gather_bytes: send and recv overlap");
  do_all_gather_bytes(send, recv, bytes_per_rank);
}

void Comm::reduce_scatter(const float* send, float* recv, size_t count_per_rank) {
  if (count_per_rank == 0) return;
  check_ptr("reduce_scatter", "send", send);
  check_ptr("reduce_scatter", "recv", recv);
  const size_t n = static_cast<size_t>(size());
  const Span in = span_of(send, checked_bytes("reduce_scatter", count_per_rank, sizeof(float), n));
  if (overlap(in, span_of(recv, count_per_rank * sizeof(float))))
    fail("reduce_scatter: send and recv overlap");
  do_reduce_scatter(send, recv, count_per_rank);
}

void Comm::all_reduce(float* buf, size_t count) {
  if (count == 0) return;
  check_ptr("all_reduce", "buf", buf);
  do_all_reduce(buf, count);
}

void Comm::all_reduce(double* buf, size_t count) {
  if (count == 0) return;
  check_ptr("all_reduce", "buf", buf);
  do_all_reduce(buf, count);
}

void Comm::all_reduce_max(double* buf, size_t count) {
  if (count == 0) return;
  check_ptr("all_reduce_max", "buf", buf);
  do_all_reduce_max(buf, count);
}

void Comm::broadcast(void* buf, size_t bytes, int root) {
  if (root < 0 || root >= size())
    fail("broadcast: root {} is not a rank of this {}-rank world", root, size());
  if (bytes == 0) return;
  check_ptr("broadcast", "buf", buf);
  do_broadcast(buf, bytes, root);
}

void Comm::barrier() { do_barrier(); }

void Comm::abort(int code) {
  std::fflush(nullptr);  // what the process printed so far still reaches the log
  do_abort(code);
  std::_Exit(code);  // the backend could not abort the job: at least this rank stops
}

void Comm::set_timeout(double seconds) {
  if (!(seconds >= 0) || !std::isfinite(seconds)) fail("timeout must be a finite number of seconds ≥ 0, got {}", seconds);
  do_set_timeout(seconds);
}

void Comm::set_max_chunk(size_t elems) {
  if (elems == 0 || elems > static_cast<size_t>(INT_MAX))
    fail("set_max_chunk: {} is not in [1, {}]", elems, INT_MAX);
  max_chunk_ = elems;
}

bool launched_by_mpirun() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK"}) {
    const char* v = std::getenv(var);
    if (v != nullptr && *v != '\0') return true;
  }
  return false;
}

std::unique_ptr<Comm> make_comm() {
  return launched_by_mpirun() ? make_mpi_comm() : make_local_comm();
}

}  // namespace retain::dist
