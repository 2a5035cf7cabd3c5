// Argument checks shared by every backend, the staging of buffers of the other memory kind,
// and the choice of backend.
#include "kernels/dist/comm.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/cuda/memory.h"
#include "kernels/tensor.h"

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

// A caller's buffer as the backend takes it: the buffer itself when it is of the backend's
// native memory kind, else a temporary of that kind (host bytes, or a device tensor) that
// copies the caller's contents in on request and back out after the collective.
class Staged {
 public:
  Staged(const void* user, size_t bytes, bool native_device)
      : user_(const_cast<void*>(user)), bytes_(bytes) {
    const bool on_device = cuda::is_device_pointer(user);
    if (on_device == native_device) return;
    staged_ = true;
    user_on_device_ = on_device;
    if (native_device)
      device_ = Tensor::empty({static_cast<int64_t>(bytes)}, DType::U8, Device::CUDA);
    else
      host_.resize(bytes);
  }
  Staged(const Staged&) = delete;
  Staged& operator=(const Staged&) = delete;
  Staged(Staged&&) = default;

  bool staged() const { return staged_; }
  char* ptr() {
    if (!staged_) return static_cast<char*>(user_);
    return user_on_device_ ? host_.data() : static_cast<char*>(device_.raw());
  }
  // The caller's bytes [offset, offset + n) into the stand-in.
  void copy_in(size_t offset = 0, size_t n = SIZE_MAX) {
    if (!staged_) return;
    n = std::min(n, bytes_ - offset);
    const char* src = static_cast<const char*>(user_) + offset;
    if (user_on_device_)
      cuda::copy_to_host(host_.data() + offset, src, n);
    else
      cuda::copy_to_device(static_cast<char*>(device_.raw()) + offset, src, n);
  }
  // The stand-in's bytes back into the caller's buffer (after the collective is done).
  void copy_out() {
    if (!staged_) return;
    char* dst = static_cast<char*>(user_);
    if (user_on_device_)
      cuda::copy_to_device(dst, host_.data(), bytes_);
    else
      cuda::copy_to_host(dst, device_.raw(), bytes_);
  }

 private:
  void* user_;
  size_t bytes_;
  bool staged_ = false, user_on_device_ = false;
  std::vector<char> host_;
  Tensor device_;
};

// An all_gather's send and recv as the backend takes them. In place (send inside recv at this
// rank's block) stays in place: only recv is staged, with this rank's block copied in.
struct StagedGather {
  StagedGather(const Comm& comm, const void* send, void* recv, size_t block)
      : out(recv, block * static_cast<size_t>(comm.size()), comm.native_device_buffers()) {
    const size_t mine = static_cast<size_t>(comm.rank()) * block;
    if (send == static_cast<const char*>(recv) + mine) {  // in place
      out.copy_in(mine, block);
      send_ptr = out.ptr() + mine;
    } else {
      in.emplace(send, block, comm.native_device_buffers());
      in->copy_in();
      send_ptr = in->ptr();
    }
  }
  bool staged() const { return out.staged() || (in && in->staged()); }
  char* recv_ptr() { return out.ptr(); }

  Staged out;
  std::optional<Staged> in;  // none in place
  const char* send_ptr = nullptr;
};

// A nonblocking gather through stand-ins: the backend's request, then the copy out on wait().
class StagedRequest final : public Request {
 public:
  StagedRequest(StagedGather buffers, std::unique_ptr<Request> inner)
      : buffers_(std::move(buffers)), inner_(std::move(inner)) {}
  ~StagedRequest() override { inner_.reset(); }  // waits for the collective; the stand-ins outlive it
  void wait() override {
    if (done_) return;
    done_ = true;
    inner_->wait();
    buffers_.out.copy_out();
  }
  bool test() override { return done_ || inner_->test(); }

 private:
  StagedGather buffers_;
  std::unique_ptr<Request> inner_;
  bool done_ = false;
};

}  // namespace

namespace {

// The checks all_gather and all_gather_async share.
void check_all_gather(const char* op, const Comm& comm, const void* send, const void* recv,
                      size_t count_per_rank, size_t elem_bytes) {
  check_ptr(op, "send", send);
  check_ptr(op, "recv", recv);
  const size_t n = static_cast<size_t>(comm.size());
  const size_t block = checked_bytes(op, count_per_rank, elem_bytes, 1);
  const Span out = span_of(recv, checked_bytes(op, count_per_rank, elem_bytes, n));
  const bool in_place =
      send == static_cast<const char*>(recv) + static_cast<size_t>(comm.rank()) * block;
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
  check_all_gather("all_gather", *this, send, recv, count_per_rank, sizeof(float));
  StagedGather b(*this, send, recv, count_per_rank * sizeof(float));
  do_all_gather(reinterpret_cast<const float*>(b.send_ptr), reinterpret_cast<float*>(b.recv_ptr()),
                count_per_rank);
  b.out.copy_out();
}

std::unique_ptr<Request> Comm::all_gather_async(const float* send, float* recv,
                                                size_t count_per_rank) {
  if (count_per_rank == 0) return std::make_unique<DoneRequest>();
  check_all_gather("all_gather_async", *this, send, recv, count_per_rank, sizeof(float));
  StagedGather b(*this, send, recv, count_per_rank * sizeof(float));
  auto r = do_all_gather_async(reinterpret_cast<const float*>(b.send_ptr),
                               reinterpret_cast<float*>(b.recv_ptr()), count_per_rank);
  if (!b.staged()) return r;
  return std::make_unique<StagedRequest>(std::move(b), std::move(r));
}

void Comm::all_gather_bytes(const void* send, void* recv, size_t bytes_per_rank) {
  if (bytes_per_rank == 0) return;
  check_ptr("all_gather_bytes", "send", send);
  check_ptr("all_gather_bytes", "recv", recv);
  const size_t n = static_cast<size_t>(size());
  const Span out = span_of(recv, checked_bytes("all_gather_bytes", bytes_per_rank, 1, n));
  if (overlap(span_of(send, bytes_per_rank), out))
    fail("all_gather_bytes: send and recv overlap");
  StagedGather b(*this, send, recv, bytes_per_rank);
  do_all_gather_bytes(b.send_ptr, b.recv_ptr(), bytes_per_rank);
  b.out.copy_out();
}

std::unique_ptr<Request> Comm::all_gather_bytes_async(const void* send, void* recv,
                                                      size_t bytes_per_rank) {
  if (bytes_per_rank == 0) return std::make_unique<DoneRequest>();
  check_all_gather("all_gather_bytes_async", *this, send, recv, bytes_per_rank, 1);
  StagedGather b(*this, send, recv, bytes_per_rank);
  auto r = do_all_gather_bytes_async(b.send_ptr, b.recv_ptr(), bytes_per_rank);
  if (!b.staged()) return r;
  return std::make_unique<StagedRequest>(std::move(b), std::move(r));
}

namespace {
// A ring shift through stand-ins: the backend's request, then the copy out on wait().
class StagedShift final : public Request {
 public:
  StagedShift(std::unique_ptr<Staged> in, std::unique_ptr<Staged> out, std::unique_ptr<Request> inner)
      : in_(std::move(in)), out_(std::move(out)), inner_(std::move(inner)) {}
  ~StagedShift() override { inner_.reset(); }  // waits for the transfer; the stand-ins outlive it
  void wait() override {
    if (done_) return;
    done_ = true;
    inner_->wait();
    out_->copy_out();
  }
  bool test() override { return done_ || inner_->test(); }

 private:
  std::unique_ptr<Staged> in_, out_;
  std::unique_ptr<Request> inner_;
  bool done_ = false;
};
}  // namespace

std::unique_ptr<Request> Comm::ring_shift_bytes_async(const void* send, void* recv, size_t bytes, int distance) {
  if (distance < 0) fail("ring_shift_bytes_async: distance {} is negative", distance);
  if (bytes == 0) return std::make_unique<DoneRequest>();
  check_ptr("ring_shift_bytes_async", "send", send);
  check_ptr("ring_shift_bytes_async", "recv", recv);
  if (overlap(span_of(send, bytes), span_of(recv, bytes))) fail("ring_shift_bytes_async: send and recv overlap");
  auto in = std::make_unique<Staged>(send, bytes, native_device_buffers());
  auto out = std::make_unique<Staged>(recv, bytes, native_device_buffers());
  in->copy_in();
  auto r = do_ring_shift_bytes_async(in->ptr(), out->ptr(), bytes, distance % size());
  ring_bytes_ += bytes;
  if (!in->staged() && !out->staged()) return r;
  return std::make_unique<StagedShift>(std::move(in), std::move(out), std::move(r));
}

void Comm::reduce_scatter(const float* send, float* recv, size_t count_per_rank) {
  if (count_per_rank == 0) return;
  check_ptr("reduce_scatter", "send", send);
  check_ptr("reduce_scatter", "recv", recv);
  const size_t n = static_cast<size_t>(size());
  const size_t in_bytes = checked_bytes("reduce_scatter", count_per_rank, sizeof(float), n);
  if (overlap(span_of(send, in_bytes), span_of(recv, count_per_rank * sizeof(float))))
    fail("reduce_scatter: send and recv overlap");
  Staged in(send, in_bytes, native_device_buffers());
  Staged out(recv, count_per_rank * sizeof(float), native_device_buffers());
  in.copy_in();
  do_reduce_scatter(reinterpret_cast<const float*>(in.ptr()), reinterpret_cast<float*>(out.ptr()),
                    count_per_rank);
  out.copy_out();
}

namespace {
// An in-place reduction on `buf` through a stand-in when its memory kind is not the backend's.
template <typename T, typename Op>
void reduce_in_place(const Comm& comm, T* buf, size_t count, Op op) {
  Staged b(buf, count * sizeof(T), comm.native_device_buffers());
  b.copy_in();
  op(reinterpret_cast<T*>(b.ptr()));
  b.copy_out();
}
}  // namespace

void Comm::all_reduce(float* buf, size_t count) {
  if (count == 0) return;
  check_ptr("all_reduce", "buf", buf);
  reduce_in_place(*this, buf, count, [&](float* p) { do_all_reduce(p, count); });
}

void Comm::all_reduce(double* buf, size_t count) {
  if (count == 0) return;
  check_ptr("all_reduce", "buf", buf);
  reduce_in_place(*this, buf, count, [&](double* p) { do_all_reduce(p, count); });
}

void Comm::all_reduce_max(double* buf, size_t count) {
  if (count == 0) return;
  check_ptr("all_reduce_max", "buf", buf);
  reduce_in_place(*this, buf, count, [&](double* p) { do_all_reduce_max(p, count); });
}

void Comm::broadcast(void* buf, size_t bytes, int root) {
  if (root < 0 || root >= size())
    fail("broadcast: root {} is not a rank of this {}-rank world", root, size());
  if (bytes == 0) return;
  check_ptr("broadcast", "buf", buf);
  reduce_in_place(*this, static_cast<char*>(buf), bytes, [&](char* p) { do_broadcast(p, bytes, root); });
}

void Comm::barrier() { do_barrier(); }

std::unique_ptr<Comm> Comm::split(int color, int key) {
  if (color < 0) fail("split: color {} is negative", color);
  return do_split(color, key);
}

std::unique_ptr<Comm> Comm::do_split(int, int) {
  fail("split: the {} communicator cannot split its ranks into groups yet", backend());
}

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

namespace {
constexpr size_t kHostRecord = 256;  // bytes per rank in node_local_rank's gather

int count_same_host(Comm& comm, const std::array<char, kHostRecord>& mine) {
  std::vector<char> all(kHostRecord * static_cast<size_t>(comm.size()));
  comm.all_gather_bytes(mine.data(), all.data(), kHostRecord);
  int local = 0;
  for (int r = 0; r < comm.rank(); ++r)
    if (std::memcmp(all.data() + kHostRecord * static_cast<size_t>(r), mine.data(), kHostRecord) == 0) ++local;
  return local;
}
}  // namespace

int node_local_rank(Comm& comm) {
  // [0, 192): the hostname; [192, 256): the boot id. Zero padding, so records compare whole.
  // No error is raised before the collective (the other ranks would wait in it): a rank
  // that cannot read its hostname or boot id compares by what it could read.
  constexpr size_t kHostBytes = 192;
  std::array<char, kHostRecord> mine{};
  if (::gethostname(mine.data(), kHostBytes - 1) != 0) mine.fill('\0');
  mine[kHostBytes - 1] = '\0';
  if (std::FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    const size_t n = std::fread(mine.data() + kHostBytes, 1, kHostRecord - kHostBytes - 1, f);
    std::fclose(f);
    if (n > 0 && mine[kHostBytes + n - 1] == '\n') mine[kHostBytes + n - 1] = '\0';
  }
  return count_same_host(comm, mine);
}

int node_local_rank(Comm& comm, std::string_view host_id) {
  std::array<char, kHostRecord> mine{};
  std::memcpy(mine.data(), host_id.data(), std::min(host_id.size(), kHostRecord - 1));
  return count_same_host(comm, mine);
}

#if !RETAIN_HAVE_NCCL
bool nccl_built() noexcept { return false; }
std::unique_ptr<Comm> make_nccl_comm(Comm&) {
  fail("this build of retain has no NCCL backend (CUDA or NCCL was not found at configure time): use the MPI "
       "backend");
}
#endif

std::unique_ptr<Comm> make_comm() {
  return launched_by_mpirun() ? make_mpi_comm() : make_local_comm();
}

}  // namespace retain::dist
