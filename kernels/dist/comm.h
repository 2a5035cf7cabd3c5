// The communicator the trainer's ranks talk through. One interface, several backends:
//   - MPI   (host buffers), used when the process was started by mpirun/mpiexec;
//   - local (a one-rank world, plain copies), used for a plain run, which needs no MPI runtime;
//   - NCCL  (device buffers, comm_nccl.cpp): the NCCL id goes out over an MPI (or local) comm
//           it wraps, and collectives run on a communication stream of their own.
// Every collective must be called by all ranks in the same order with the same counts (and
// root); blocking ones return when done, all_gather_async returns a Request to wait on.
// Reductions are sums unless named otherwise. Buffers of `count == 0` may be null.
//
// Host or device buffers, on every backend. Each backend has a native kind (MPI and local:
// host memory; NCCL: device memory); a buffer of the other kind is staged through a temporary
// one of the native kind (a copy in, a copy out). So the trainer's host-side gate gradients go
// through NCCL, and device weights through MPI (two ranks sharing one GPU, as tests do).
// "Done" for a device buffer on a device-native backend is stream-ordered: the host does not
// wait, and work queued afterwards on the legacy default stream (where every retain kernel
// runs) sees the result. Anything staged through the host is done when the call returns.
#pragma once
#include <climits>
#include <cstddef>
#include <limits>
#include <memory>
#include <string_view>
#include <utility>

namespace retain::dist {

// A collective in flight (all_gather_async). Its buffers belong to it until wait() returns:
// the send buffer must not be written, the recv buffer neither read nor written.
// Destroying a Request that was not waited for waits for it (a collective cannot be
// abandoned: the other ranks take part in it), dropping any error; call wait() to see errors.
// A Request must be waited for or destroyed before the Comm that made it.
class Request {
 public:
  virtual ~Request() = default;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;

  // Blocks until the collective completed on this rank (recv holds the result). Idempotent.
  virtual void wait() = 0;
  // Never blocks: true when complete (then wait() returns at once). With MPI it also drives
  // the collective forward: without a progress thread, MPI advances a nonblocking
  // collective only inside MPI calls, so a caller that computes meanwhile may test() now
  // and then to overlap more of the transfer.
  virtual bool test() = 0;

 protected:
  Request() = default;
};

// Time spent on collectives (Comm::take_device_times), in seconds; NaN = not measured.
struct CommTimes {
  double busy_seconds = std::numeric_limits<double>::quiet_NaN();     // collectives in flight
  double exposed_seconds = std::numeric_limits<double>::quiet_NaN();  // compute stalled waiting for them
};

class Comm {
 public:
  virtual ~Comm() = default;
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view backend() const = 0;  // "mpi", "local", "nccl"
  // True when the backend takes device buffers natively (NCCL); host buffers are then staged.
  virtual bool native_device_buffers() const { return false; }

  // Rank 0 alone prints: `if (comm.is_main_rank()) spdlog::info(...)`.
  bool is_main_rank() const { return rank() == 0; }

  // recv[r * count_per_rank + i] = send_of_rank_r[i]; recv holds size() * count_per_rank.
  // In place when send == recv + rank() * count_per_rank; any other overlap is an error.
  void all_gather(const float* send, float* recv, size_t count_per_rank);

  // all_gather without blocking (MPI_Iallgather, in max_chunk() pieces like all_gather).
  // Same layout and in-place rule; see Request for who owns the buffers until wait().
  // Blocking and nonblocking collectives may interleave, in the same order on every rank.
  // The local backend copies at once and returns a completed request.
  std::unique_ptr<Request> all_gather_async(const float* send, float* recv,
                                            size_t count_per_rank);

  // all_gather of raw bytes (any trivially copyable data: int32 token ids, uint8 masks):
  // recv[r * bytes_per_rank + i] = send_of_rank_r[i]. send and recv must not overlap.
  void all_gather_bytes(const void* send, void* recv, size_t bytes_per_rank);

  // all_gather_bytes without blocking, with all_gather's in-place rule (send == recv +
  // rank() * bytes_per_rank, or no overlap) and all_gather_async's buffer ownership: what the
  // FSDP provider gathers its mixed bf16/f32 layers with.
  std::unique_ptr<Request> all_gather_bytes_async(const void* send, void* recv, size_t bytes_per_rank);

  // The ring shift of context parallelism (trainer/context_parallel.h), without blocking: rank
  // r sends `bytes` bytes of `send` to rank (r + distance) % size() and receives rank
  // (r − distance)'s into `recv` (distance ≡ 0 mod size(), e.g. a one-rank world: its own
  // bytes). Collective: every rank calls it with the same byte count and distance, in the same
  // order among the collectives. send and recv must not overlap; both belong to the request
  // until wait() returns (all_gather_async's rule). Distances other than 1 make the pairwise
  // exchange of trainer/context_parallel.h's gather_to_owners.
  std::unique_ptr<Request> ring_shift_bytes_async(const void* send, void* recv, size_t bytes, int distance = 1);
  // Bytes this rank has sent through ring_shift_bytes_async since the last call (local: any rank
  // may call it alone). What context parallelism exchanges, in retain-train's metrics (ring_mb).
  size_t take_ring_bytes() { return std::exchange(ring_bytes_, 0); }

  // send holds size() * count_per_rank; recv[i] = sum over ranks r of
  // send_of_rank_r[rank() * count_per_rank + i]. send and recv must not overlap.
  void reduce_scatter(const float* send, float* recv, size_t count_per_rank);

  // buf[i] = sum over ranks of buf[i], in place. Losses are reduced in float64.
  void all_reduce(float* buf, size_t count);
  void all_reduce(double* buf, size_t count);

  // buf[i] = max over ranks of buf[i], in place (e.g. agreeing on a stop signal: 1 on any
  // rank stops every rank). NaN on any rank gives an unspecified result: don't.
  void all_reduce_max(double* buf, size_t count);

  // The ranks of this comm that pass the same `color` (≥ 0), as a comm of their own, ranked by
  // `key` (then by rank here): context parallelism's groups, rank / N (trainer/train.cpp).
  // Collective. MPI: MPI_Comm_split; local: the one-rank world itself again; NCCL: the host comm
  // split, and a NCCL communicator over each group.
  std::unique_ptr<Comm> split(int color, int key);

  // Copies `bytes` bytes of rank `root`'s buf into every rank's buf.
  void broadcast(void* buf, size_t bytes, int root);

  void barrier();

  // Ends the whole job at once with exit status `code`: MPI_Abort on MPI_COMM_WORLD (every
  // rank of every process is killed, so one rank's fatal error never leaves the others
  // waiting in a collective forever), for the local backend std::_Exit after flushing stdio.
  // No destructors run and nothing else is flushed: write and close files first. Use it for
  // errors seen by some ranks only; an error every rank sees alike may simply be thrown.
  [[noreturn]] void abort(int code);

  // The collective watchdog (docs/reliability.md): when a collective has waited `seconds` on
  // this rank, the job ends (exit status 75, EX_TEMPFAIL) with one line on stderr naming the
  // rank(s) that never joined it: hung, stuck in computation, or stopped. 0 turns it off (the
  // default). Collective: every rank calls it alike. A one-rank world waits for nobody and
  // ignores it. MPI: needs MPI_THREAD_MULTIPLE (a thread answers the peers' questions).
  void set_timeout(double seconds);

  // The time of the collectives completed since the last call; exposed: time compute waited for
  // them, i.e. what overlapping did not hide. NCCL: device time, with CUDA events (busy: the
  // communication stream in collectives). MPI: host wall time (busy: from each collective's start
  // to when this rank saw it complete; exposed: the calling thread's time inside MPI for them, a
  // blocking collective whole, a nonblocking one's start and wait). Local: NaN (nothing to wait
  // for). Never blocks: a collective still running is counted at a later call. Local (any rank may
  // call it alone).
  virtual CommTimes take_device_times() { return {}; }

  // Most elements handed to one backend call (bytes for broadcast and all_gather_bytes);
  // larger buffers go in pieces. MPI takes int counts, so the default is INT_MAX. Tests
  // lower it to exercise the chunked paths. Every rank must use the same value. NCCL takes
  // size_t counts and ignores it (one call per collective).
  void set_max_chunk(size_t elems);
  size_t max_chunk() const { return max_chunk_; }

 protected:
  Comm() = default;

 private:
  // Called with validated arguments and count > 0 only.
  virtual void do_all_gather(const float* send, float* recv, size_t count_per_rank) = 0;
  virtual std::unique_ptr<Request> do_all_gather_async(const float* send, float* recv,
                                                       size_t count_per_rank) = 0;
  virtual void do_all_gather_bytes(const void* send, void* recv, size_t bytes_per_rank) = 0;
  virtual std::unique_ptr<Request> do_all_gather_bytes_async(const void* send, void* recv,
                                                             size_t bytes_per_rank) = 0;
  // `distance` in [0, size()): 0 is a copy to itself.
  virtual std::unique_ptr<Request> do_ring_shift_bytes_async(const void* send, void* recv, size_t bytes,
                                                             int distance) = 0;
  virtual void do_reduce_scatter(const float* send, float* recv, size_t count_per_rank) = 0;
  virtual void do_all_reduce(float* buf, size_t count) = 0;
  virtual void do_all_reduce(double* buf, size_t count) = 0;
  virtual void do_all_reduce_max(double* buf, size_t count) = 0;
  virtual void do_broadcast(void* buf, size_t bytes, int root) = 0;
  virtual void do_barrier() = 0;
  // May return only if it could not abort; abort() then ends this process.
  virtual void do_abort(int code) = 0;
  virtual void do_set_timeout(double /*seconds*/) {}
  virtual std::unique_ptr<Comm> do_split(int color, int key);

  size_t max_chunk_ = INT_MAX;
  size_t ring_bytes_ = 0;
};

// True when an MPI launcher started this process (OpenMPI's OMPI_COMM_WORLD_SIZE, PMIx's
// PMIX_RANK, PMI's PMI_SIZE/PMI_RANK).
bool launched_by_mpirun();

// The world this process belongs to: an MPI comm when launched_by_mpirun(), else a local
// one-rank comm. Keep it alive for the whole run: MPI can be initialized only once per process.
std::unique_ptr<Comm> make_comm();

// A one-rank world with no MPI at all.
std::unique_ptr<Comm> make_local_comm();

// An MPI comm over a duplicate of MPI_COMM_WORLD (errors return, and throw retain::Error).
// Initializes MPI if nobody has; the last MPI comm destroyed finalizes it in that case.
std::unique_ptr<Comm> make_mpi_comm();

// This rank's index among the ranks on its host, counted as llm.c does: every rank's host
// identity (gethostname, and the kernel's boot id, so that two machines that share a hostname
// stay apart) is all-gathered in a fixed 256-byte record, and the result is the number of
// lower ranks with the same identity. What retain::bind_local_gpu falls back to when the
// launcher exported no node-local rank (a PMIx direct launch outside Slurm, say):
// `bind_local_gpu(dist::node_local_rank(comm))`. Collective.
int node_local_rank(Comm& comm);
// The same count with `host_id` (its first 255 bytes) as this rank's host identity (tests).
int node_local_rank(Comm& comm, std::string_view host_id);

// True when this build has the NCCL backend (CUDA and NCCL found at configure time).
bool nccl_built() noexcept;

// An NCCL comm over the same ranks as `host` (an MPI or local comm, which must outlive it), on
// the calling thread's current CUDA device: bind the GPU first (retain::bind_local_gpu).
// Collective over `host`: rank 0 makes the NCCL id and broadcasts it through `host`, which the
// NCCL comm then uses for barrier, abort and its watchdog. Two ranks on one GPU cannot share an NCCL communicator (NCCL
// refuses duplicate devices): use the MPI backend, which stages device buffers, for that.
// Without NCCL in the build: a retain::Error saying so.
std::unique_ptr<Comm> make_nccl_comm(Comm& host);

}  // namespace retain::dist
