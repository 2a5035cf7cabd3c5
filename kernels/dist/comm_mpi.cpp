// The MPI backend: host buffers, a private duplicate of MPI_COMM_WORLD whose errors return
// (and become retain::Error through MPI_CHECK), and counts above INT_MAX sent in pieces.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/dist/comm.h"
#include "kernels/dist/mpi_check.h"
#include "kernels/dist/watchdog.h"

namespace retain::dist {

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<size_t>(len));
}

void mpi_fail(const char* call, int code, const char* file, int line) {
  std::string_view name(call);
  name = name.substr(0, name.find('('));  // "MPI_Bcast(buf, n, ...)" -> "MPI_Bcast"
  while (!name.empty() && name.back() == ' ') name.remove_suffix(1);
  std::string_view base(file);
  if (const size_t slash = base.rfind('/'); slash != std::string_view::npos)
    base.remove_prefix(slash + 1);
  int initialized = 0, finalized = 0, rank = -1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::string where = rank >= 0 ? fmt::format("rank {}: ", rank) : std::string();
  fail("{}{} failed at {}:{}: {}", where, name, base, line, mpi_error_string(code));
}

namespace {

// MPI can be initialized once per process. Every MPI comm holds a lease; if we were the ones
// to initialize MPI, the last lease to go finalizes it.
class MpiLease {
 public:
  MpiLease() {
    std::lock_guard lock(mu_);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized)
      fail("MPI was already finalized in this process; keep one MPI comm alive for the run");
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      // Multiple: the main thread makes the collectives and, with a timeout set, the
      // collective watchdog's thread talks to the other ranks meanwhile (OpenMP threads never
      // call MPI). A library that offers less still runs, without the watchdog.
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided_);
      if (rc != MPI_SUCCESS) fail("MPI_Init_thread failed: {}", mpi_error_string(rc));
      owner_ = true;
      // Errors on the world return too (they would abort the job otherwise).
      MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    }
    ++live_;
  }
  // The thread support MPI was initialized with (by us, or by whoever did it first).
  static int thread_level() {
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    return level;
  }
  ~MpiLease() {
    std::lock_guard lock(mu_);
    if (--live_ == 0 && owner_) MPI_Finalize();
  }
  MpiLease(const MpiLease&) = delete;
  MpiLease& operator=(const MpiLease&) = delete;

 private:
  static inline std::mutex mu_;
  static inline int live_ = 0;
  static inline bool owner_ = false;
  static inline int provided_ = 0;
};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Where a step's communication time goes (Comm::take_device_times, on the host's clock): busy, from
// each collective's start to the moment this rank saw it complete (a blocking one's return, a
// nonblocking one's wait or successful test); exposed, the time the calling thread spent inside
// MPI for them (a blocking one whole, a nonblocking one's start and wait), i.e. what computing
// meanwhile did not hide. The trainer's thread alone touches it: collectives are made and waited
// for there.
struct CommClock {
  int64_t busy_ns = 0, exposed_ns = 0;
};

// One collective call on the main thread: the watchdog's view of it (nothing when it is off), and
// its time on the clock (busy too for a blocking call: it is the whole collective).
class Watched {
 public:
  Watched(CollectiveWatchdog* w, const char* op, CommClock* clock, bool blocking, bool counted = true)
      : w_(w), clock_(clock), blocking_(blocking), start_ns_(now_ns()) {
    if (w_) w_->enter(op, counted);
  }
  ~Watched() {
    if (w_) w_->leave();
    const int64_t ns = now_ns() - start_ns_;
    clock_->exposed_ns += ns;
    if (blocking_) clock_->busy_ns += ns;
  }
  Watched(const Watched&) = delete;
  Watched& operator=(const Watched&) = delete;

 private:
  CollectiveWatchdog* w_;
  CommClock* clock_;
  bool blocking_;
  int64_t start_ns_;
};

template <typename T>
MPI_Datatype mpi_type();
template <>
MPI_Datatype mpi_type<float>() {
  return MPI_FLOAT;
}
template <>
MPI_Datatype mpi_type<double>() {
  return MPI_DOUBLE;
}

// A committed datatype, freed on scope exit.
class TypeGuard {
 public:
  TypeGuard() = default;
  ~TypeGuard() {
    if (type != MPI_DATATYPE_NULL) MPI_Type_free(&type);
  }
  TypeGuard(const TypeGuard&) = delete;
  TypeGuard& operator=(const TypeGuard&) = delete;
  MPI_Datatype type = MPI_DATATYPE_NULL;
};

// The pieces of one nonblocking collective, and the datatypes they use (freed after).
// It must be waited for (or destroyed) before the comm that made it.
class MpiRequest final : public Request {
 public:
  // `wait_label`: what the watchdog calls a wait for it (a literal, "wait for all_gather_async").
  MpiRequest(CollectiveWatchdog* watchdog, CommClock* clock, const char* wait_label)
      : watchdog_(watchdog), clock_(clock), wait_label_(wait_label), start_ns_(now_ns()) {}
  ~MpiRequest() override {
    // A collective cannot be abandoned; errors have nowhere to go from a destructor.
    if (!done_) {
      Watched watched(watchdog_, wait_label_, clock_, false, false);
      MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE);
      clock_->busy_ns += now_ns() - start_ns_;
    }
    free_types();
  }

  void add(MPI_Request r) { requests_.push_back(r); }
  void keep(MPI_Datatype t) { types_.push_back(t); }

  void wait() override {
    if (done_) return;
    done_ = true;  // even if it fails: the destructor must not wait on a failed collective
    {
      Watched watched(watchdog_, wait_label_, clock_, false, false);
      MPI_CHECK(
          MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE));
    }
    clock_->busy_ns += now_ns() - start_ns_;
    free_types();
  }

  bool test() override {
    if (done_) return true;
    int flag = 0;
    MPI_CHECK(MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &flag,
                          MPI_STATUSES_IGNORE));
    if (flag) {
      done_ = true;
      clock_->busy_ns += now_ns() - start_ns_;
      free_types();
    }
    return flag != 0;
  }

 private:
  void free_types() {
    for (MPI_Datatype& t : types_) MPI_Type_free(&t);
    types_.clear();
  }

  std::vector<MPI_Request> requests_;
  std::vector<MPI_Datatype> types_;
  bool done_ = false;
  CollectiveWatchdog* watchdog_;
  CommClock* clock_;
  const char* wait_label_;
  int64_t start_ns_;  // when the collective was started (busy time runs from here)
};

class MpiComm final : public Comm {
 public:
  MpiComm() {
    MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
    adopt();
  }
  // The ranks of `parent` with this color, ordered by key (Comm::split).
  MpiComm(MPI_Comm parent, int color, int key) {
    MPI_CHECK(MPI_Comm_split(parent, color, key, &comm_));
    adopt();
  }
  ~MpiComm() override {
    watchdog_.reset();
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);  // before lease_ may finalize
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "mpi"; }

  // Host time (CommClock), not device time: what the MPI backend spends is the host's.
  CommTimes take_device_times() override {
    const CommClock c = std::exchange(clock_, {});
    return {static_cast<double>(c.busy_ns) * 1e-9, static_cast<double>(c.exposed_ns) * 1e-9};
  }

 private:
  // Every piece is at most max_chunk() <= INT_MAX elements, so the int casts below are exact.
  static int as_int(size_t n) { return static_cast<int>(n); }

  void do_all_gather(const float* send, float* recv, size_t count) override {
    Watched watched(watchdog_.get(), "all_gather", &clock_, true);
    gather(send, recv, count, MPI_FLOAT, sizeof(float), nullptr);
  }

  std::unique_ptr<Request> do_all_gather_async(const float* send, float* recv,
                                               size_t count) override {
    auto request = std::make_unique<MpiRequest>(watchdog_.get(), &clock_, "wait for all_gather_async");
    Watched watched(watchdog_.get(), "all_gather_async", &clock_, false);
    gather(send, recv, count, MPI_FLOAT, sizeof(float), request.get());
    return request;
  }

  void do_all_gather_bytes(const void* send, void* recv, size_t bytes) override {
    Watched watched(watchdog_.get(), "all_gather_bytes", &clock_, true);
    gather(send, recv, bytes, MPI_BYTE, 1, nullptr);
  }

  std::unique_ptr<Request> do_all_gather_bytes_async(const void* send, void* recv,
                                                     size_t bytes) override {
    auto request = std::make_unique<MpiRequest>(watchdog_.get(), &clock_, "wait for all_gather_bytes_async");
    Watched watched(watchdog_.get(), "all_gather_bytes_async", &clock_, false);
    gather(send, recv, bytes, MPI_BYTE, 1, request.get());
    return request;
  }

  // all_gather of `count` elements of `type` (`elem` bytes each) per rank, in max_chunk()
  // pieces. Blocking when `pending` is null; otherwise nonblocking, and the requests (with
  // the datatypes they use) go to `pending`.
  void gather(const void* send, void* recv, size_t count, MPI_Datatype type, size_t elem,
              MpiRequest* pending) {
    auto* out = static_cast<char*>(recv);
    const bool in_place = send == out + static_cast<size_t>(rank_) * count * elem;
    if (count <= max_chunk()) {
      const void* src = in_place ? MPI_IN_PLACE : send;
      const int n = as_int(count);
      if (pending == nullptr) {
        MPI_CHECK(MPI_Allgather(src, n, type, out, n, type, comm_));
      } else {
        MPI_Request r = MPI_REQUEST_NULL;
        MPI_CHECK(MPI_Iallgather(src, n, type, out, n, type, comm_, &r));
        pending->add(r);
      }
      return;
    }
    // Piece [off, off + n) of every rank's block: one element of a type of n elements whose
    // extent is a whole block, so rank r's piece lands at recv + (r * count + off) elements.
    for (size_t off = 0; off < count; off += max_chunk()) {
      const size_t n = std::min(max_chunk(), count - off);
      TypeGuard piece, strided;
      MPI_CHECK(MPI_Type_contiguous(as_int(n), type, &piece.type));
      MPI_CHECK(MPI_Type_create_resized(piece.type, 0, static_cast<MPI_Aint>(count * elem),
                                        &strided.type));
      MPI_CHECK(MPI_Type_commit(&strided.type));
      const void* src = in_place ? MPI_IN_PLACE : static_cast<const char*>(send) + off * elem;
      if (pending == nullptr) {
        MPI_CHECK(MPI_Allgather(src, as_int(n), type, out + off * elem, 1, strided.type, comm_));
      } else {
        MPI_Request r = MPI_REQUEST_NULL;
        MPI_CHECK(MPI_Iallgather(src, as_int(n), type, out + off * elem, 1, strided.type, comm_,
                                 &r));
        pending->add(r);
        pending->keep(std::exchange(strided.type, MPI_DATATYPE_NULL));
      }
    }
  }

  // Isend to the next rank, Irecv from the previous, in max_chunk() pieces (MPI keeps the
  // order of messages between two ranks on one tag, so the pieces match up in turn).
  std::unique_ptr<Request> do_ring_shift_bytes_async(const void* send, void* recv, size_t bytes,
                                                     int distance) override {
    auto request = std::make_unique<MpiRequest>(watchdog_.get(), &clock_, "wait for ring_shift_bytes_async");
    Watched watched(watchdog_.get(), "ring_shift_bytes_async", &clock_, false);
    const int next = (rank_ + distance) % size_, prev = (rank_ + size_ - distance) % size_;
    for (size_t off = 0; off < bytes; off += max_chunk()) {
      const int n = as_int(std::min(max_chunk(), bytes - off));
      MPI_Request r = MPI_REQUEST_NULL;
      MPI_CHECK(MPI_Irecv(static_cast<char*>(recv) + off, n, MPI_BYTE, prev, kRingTag, comm_, &r));
      request->add(r);
      MPI_CHECK(MPI_Isend(static_cast<const char*>(send) + off, n, MPI_BYTE, next, kRingTag, comm_, &r));
      request->add(r);
    }
    return request;
  }
  static constexpr int kRingTag = 39;

  void do_reduce_scatter(const float* send, float* recv, size_t count) override {
    Watched watched(watchdog_.get(), "reduce_scatter", &clock_, true);
    if (count <= max_chunk()) {
      MPI_CHECK(MPI_Reduce_scatter_block(send, recv, as_int(count), MPI_FLOAT, MPI_SUM, comm_));
      return;
    }
    // Predefined reductions take predefined types only, so no strided type here: each piece
    // of each rank's block is reduced onto that rank.
    for (size_t off = 0; off < count; off += max_chunk()) {
      const size_t n = std::min(max_chunk(), count - off);
      for (int root = 0; root < size_; ++root) {
        const float* src = send + static_cast<size_t>(root) * count + off;
        MPI_CHECK(MPI_Reduce(src, root == rank_ ? recv + off : nullptr, as_int(n), MPI_FLOAT,
                             MPI_SUM, root, comm_));
      }
    }
  }

  template <typename T>
  void all_reduce_impl(T* buf, size_t count, MPI_Op op = MPI_SUM) {
    Watched watched(watchdog_.get(), op == MPI_MAX ? "all_reduce_max" : "all_reduce", &clock_, true);
    for (size_t off = 0; off < count; off += max_chunk()) {
      const size_t n = std::min(max_chunk(), count - off);
      MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, buf + off, as_int(n), mpi_type<T>(), op, comm_));
    }
  }
  void do_all_reduce(float* buf, size_t count) override { all_reduce_impl(buf, count); }
  void do_all_reduce(double* buf, size_t count) override { all_reduce_impl(buf, count); }
  void do_all_reduce_max(double* buf, size_t count) override {
    all_reduce_impl(buf, count, MPI_MAX);
  }

  void do_broadcast(void* buf, size_t bytes, int root) override {
    Watched watched(watchdog_.get(), "broadcast", &clock_, true);
    auto* p = static_cast<char*>(buf);
    for (size_t off = 0; off < bytes; off += max_chunk()) {
      const size_t n = std::min(max_chunk(), bytes - off);
      MPI_CHECK(MPI_Bcast(p + off, as_int(n), MPI_BYTE, root, comm_));
    }
  }

  void do_barrier() override {
    Watched watched(watchdog_.get(), "barrier", &clock_, true);
    MPI_CHECK(MPI_Barrier(comm_));
  }

  void do_set_timeout(double seconds) override {
    watchdog_.reset();
    if (seconds == 0) return;
    if (MpiLease::thread_level() < MPI_THREAD_MULTIPLE)
      fail("a collective timeout needs MPI_THREAD_MULTIPLE, which this MPI library was not initialized with");
    watchdog_ = std::make_unique<CollectiveWatchdog>(comm_, seconds);
  }

  std::unique_ptr<Comm> do_split(int color, int key) override {
    Watched watched(watchdog_.get(), "split", &clock_, true);
    return std::make_unique<MpiComm>(comm_, color, key);
  }

  void adopt() {
    MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    MPI_CHECK(MPI_Comm_size(comm_, &size_));
  }

  // On the world, not our duplicate: every process of the job goes, whatever it is doing.
  void do_abort(int code) override { MPI_Abort(MPI_COMM_WORLD, code); }

  MpiLease lease_;  // first member: MPI is up before comm_ is made and down after it is freed
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::unique_ptr<CollectiveWatchdog> watchdog_;  // with a timeout set
  CommClock clock_;                                // since the last take_device_times()
};

}  // namespace

std::unique_ptr<Comm> make_mpi_comm() { return std::make_unique<MpiComm>(); }

}  // namespace retain::dist
