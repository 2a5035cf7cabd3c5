// The MPI backend: host buffers, a private duplicate of MPI_COMM_WORLD whose errors return
// (and become retain::Error through MPI_CHECK), and counts above INT_MAX sent in pieces.
#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "kernels/base/error.h"
#include "trainer/dist/comm.h"
#include "trainer/dist/mpi_check.h"

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
      int provided = 0;
      // Funneled: the trainer's threads (OpenMP) never call MPI; its main thread does.
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
      if (rc != MPI_SUCCESS) fail("MPI_Init_thread failed: {}", mpi_error_string(rc));
      owner_ = true;
      // Errors on the world return too (they would abort the job otherwise).
      MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    }
    ++live_;
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

class MpiComm final : public Comm {
 public:
  MpiComm() {
    MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
    MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    MPI_CHECK(MPI_Comm_size(comm_, &size_));
  }
  ~MpiComm() override {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);  // before lease_ may finalize
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "mpi"; }

 private:
  // Every piece is at most max_chunk() <= INT_MAX elements, so the int casts below are exact.
  static int as_int(size_t n) { return static_cast<int>(n); }

  void do_all_gather(const float* send, float* recv, size_t count) override {
    const void* src = send == recv + static_cast<size_t>(rank_) * count ? MPI_IN_PLACE : send;
    if (count <= max_chunk()) {
      MPI_CHECK(
          MPI_Allgather(src, as_int(count), MPI_FLOAT, recv, as_int(count), MPI_FLOAT, comm_));
      return;
    }
    // Piece [off, off + n) of every rank's block: one element of a type of n floats whose
    // extent is a whole block, so rank r's piece lands at recv + r * count + off.
    for (size_t off = 0; off < count; off += max_chunk()) {
      const size_t n = std::min(max_chunk(), count - off);
      TypeGuard piece, strided;
      MPI_CHECK(MPI_Type_contiguous(as_int(n), MPI_FLOAT, &piece.type));
      MPI_CHECK(MPI_Type_create_resized(piece.type, 0, static_cast<MPI_Aint>(count * sizeof(float)),
                                        &strided.type));
      MPI_CHECK(MPI_Type_commit(&strided.type));
      MPI_CHECK(MPI_Allgather(src == MPI_IN_PLACE ? MPI_IN_PLACE : send + off, as_int(n), MPI_FLOAT,
                              recv + off, 1, strided.type, comm_));
    }
  }

  void do_reduce_scatter(const float* send, float* recv, size_t count) override {
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
  void all_reduce_impl(T* buf, size_t count) {
    for (size_t off = 0; off < count; off += max_chunk()) {
      const size_t n = std::min(max_chunk(), count - off);
      MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, buf + off, as_int(n), mpi_type<T>(), MPI_SUM, comm_));
    }
  }
  void do_all_reduce(float* buf, size_t count) override { all_reduce_impl(buf, count); }
  void do_all_reduce(double* buf, size_t count) override { all_reduce_impl(buf, count); }

  void do_broadcast(void* buf, size_t bytes, int root) override {
    auto* p = static_cast<char*>(buf);
    for (size_t off = 0; off < bytes; off += max_chunk()) {
      const size_t n = std::min(max_chunk(), bytes - off);
      MPI_CHECK(MPI_Bcast(p + off, as_int(n), MPI_BYTE, root, comm_));
    }
  }

  void do_barrier() override { MPI_CHECK(MPI_Barrier(comm_)); }

  MpiLease lease_;  // first member: MPI is up before comm_ is made and down after it is freed
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace

std::unique_ptr<Comm> make_mpi_comm() { return std::make_unique<MpiComm>(); }

}  // namespace retain::dist
