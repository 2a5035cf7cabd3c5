// The NCCL backend: device buffers, one NCCL communicator over the ranks of a host comm (MPI,
// or local for one rank) that carried its unique id and still serves barrier and abort.
//
// Streams. Every retain kernel runs on the legacy default stream ("compute"). Collectives run
// on a non-blocking stream of their own ("communication"), ordered by events both ways and
// never by a host sync: before each collective the communication stream waits for what compute
// has queued so far (the buffers it reads or overwrites may still be in use there), and a
// blocking call makes compute wait for the collective, so the host returns at once and the
// next kernel sees the result. A nonblocking gather hands out that second wait as its
// Request::wait(), which is how the FSDP provider overlaps layer l+1's gather with layer l.
//
// Failures. Every NCCL and CUDA call is checked (retain::Error naming the call, the rank and
// NCCL's own message). A monitor thread polls ncclCommGetAsyncError, so a peer that died or a
// network error ends this rank with one line instead of a hang; with a timeout set, a device
// watchdog (the MPI backend's CollectiveWatchdog, fed with the collectives as they are queued
// and completed) names the rank that never joined a collective. Comm::abort aborts the NCCL
// communicator first, then the job through the host comm.
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/cuda/check.h"
#include "kernels/dist/comm.h"
#include "kernels/dist/watchdog.h"

namespace retain::dist {

bool nccl_built() noexcept { return true; }

namespace {

// Ends the whole job from a thread that found it cannot go on: through MPI when it is up (every
// rank of every process goes), else this process alone.
[[noreturn]] void end_job(int code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

// "ncclAllGather(send, ...)" -> "ncclAllGather".
std::string_view call_name(std::string_view call) {
  call = call.substr(0, call.find('('));
  while (!call.empty() && call.back() == ' ') call.remove_suffix(1);
  return call;
}

[[noreturn]] void nccl_fail(int rank, const char* call, ncclResult_t r, ncclComm_t comm, const char* file,
                            int line) {
  std::string_view base(file);
  if (const size_t slash = base.rfind('/'); slash != std::string_view::npos) base.remove_prefix(slash + 1);
  const char* detail = ncclGetLastError(comm);
  fail("rank {}: {} failed at {}:{}: {}{}{}", rank, call_name(call), base, line, ncclGetErrorString(r),
       detail != nullptr && *detail != '\0' ? ": " : "", detail != nullptr ? detail : "");
}

#define NCCL_CHECK(call)                                                    \
  do {                                                                      \
    const ncclResult_t r_ = (call);                                         \
    if (r_ != ncclSuccess) nccl_fail(rank_, #call, r_, comm_, __FILE__, __LINE__); \
  } while (0)

// Pairs of timing events whose elapsed times add up to one of CommTimes' figures.
class EventTimer {
 public:
  ~EventTimer() {
    for (auto [a, b] : pairs_) {
      cudaEventDestroy(a);
      cudaEventDestroy(b);
    }
  }
  // Records the start of an interval on `stream`; end() records its end.
  void begin(cudaStream_t stream) {
    if (pairs_.size() >= 1024) harvest();  // nobody asks: fold what completed, keep memory bounded
    cudaEvent_t a = nullptr, b = nullptr;
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
    CUDA_CHECK(cudaEventRecord(a, stream));
    pairs_.push_back({a, b});
  }
  void end(cudaStream_t stream) { CUDA_CHECK(cudaEventRecord(pairs_.back().second, stream)); }
  // Seconds of the completed intervals since the last take (the others wait for a later one).
  double take() {
    harvest();
    return std::exchange(seconds_, 0.0);
  }

 private:
  void harvest() {
    size_t kept = 0;
    for (auto [a, b] : pairs_) {
      if (cudaEventQuery(b) != cudaSuccess) {  // not done yet (cudaErrorNotReady is not sticky)
        pairs_[kept++] = {a, b};
        continue;
      }
      float ms = 0;
      if (cudaEventElapsedTime(&ms, a, b) == cudaSuccess) seconds_ += ms * 1e-3;
      cudaEventDestroy(a);
      cudaEventDestroy(b);
    }
    pairs_.resize(kept);
  }
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> pairs_;
  double seconds_ = 0;
};

// One collective's completion on the communication stream: wait() makes compute wait for it,
// timing the stall on `exposed` (compute's stream: events around the wait).
class NcclRequest final : public Request {
 public:
  NcclRequest(cudaEvent_t done, EventTimer* exposed, std::mutex* mu) : done_(done), exposed_(exposed), mu_(mu) {}
  ~NcclRequest() override {
    if (done_ != nullptr) {  // a collective cannot be abandoned: compute still waits for it
      cudaStreamWaitEvent(cudaStreamLegacy, done_, 0);
      cudaEventDestroy(done_);
    }
  }
  void wait() override {
    if (done_ == nullptr) return;
    const cudaEvent_t e = std::exchange(done_, nullptr);
    std::lock_guard lock(*mu_);
    exposed_->begin(cudaStreamLegacy);
    const cudaError_t err = cudaStreamWaitEvent(cudaStreamLegacy, e, 0);
    exposed_->end(cudaStreamLegacy);
    cudaEventDestroy(e);  // released once the event has completed
    if (err != cudaSuccess) fail("cudaStreamWaitEvent after a collective: {}", cudaGetErrorString(err));
  }
  bool test() override {
    if (done_ == nullptr) return true;
    const cudaError_t err = cudaEventQuery(done_);
    if (err == cudaErrorNotReady) return false;
    if (err != cudaSuccess) fail("cudaEventQuery after all_gather_async: {}", cudaGetErrorString(err));
    return true;  // wait() still orders compute after it (cheap: the event is complete)
  }

 private:
  cudaEvent_t done_;
  EventTimer* exposed_;
  std::mutex* mu_;
};

class NcclComm final : public Comm {
 public:
  explicit NcclComm(Comm& host) : host_(host) {
    rank_ = host_.rank();
    size_ = host_.size();
    CUDA_CHECK(cudaGetDevice(&device_));
    ncclUniqueId id{};
    if (rank_ == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    host_.broadcast(&id, sizeof id, 0);
    NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&latest_, cudaEventDisableTiming));
    monitor_ = std::thread([this] { monitor(); });
  }
  // A communicator over a host comm it owns (a group of do_split).
  explicit NcclComm(std::unique_ptr<Comm> host) : NcclComm(*host) { owned_host_ = std::move(host); }

  ~NcclComm() override {
    stop_ = true;
    if (monitor_.joinable()) monitor_.join();
    watchdog_.reset();
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);  // teardown: errors are not actionable
    if (comm_ != nullptr) {
      ncclCommFinalize(comm_);
      ncclCommDestroy(comm_);
    }
    if (ready_ != nullptr) cudaEventDestroy(ready_);
    if (latest_ != nullptr) cudaEventDestroy(latest_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "nccl"; }
  bool native_device_buffers() const override { return true; }

 private:
  // Queues `call(stream)` on the communication stream after everything compute queued so far;
  // returns the event that marks its end (the caller owns it).
  template <typename Call>
  cudaEvent_t enqueue(const char* op, Call&& call) {
    std::lock_guard lock(mu_);
    CUDA_CHECK(cudaSetDevice(device_));
    CUDA_CHECK(cudaEventRecord(ready_, cudaStreamLegacy));
    CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
    if (watchdog_) watchdog_->enter(op);
    busy_.begin(stream_);
    NCCL_CHECK(call(stream_));
    busy_.end(stream_);
    CUDA_CHECK(cudaEventRecord(latest_, stream_));
    watched_ = true;
    cudaEvent_t done = nullptr;
    CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(done, stream_));
    return done;
  }
  // A blocking collective: compute waits for it; the host does not.
  template <typename Call>
  void run(const char* op, Call&& call) {
    request(enqueue(op, std::forward<Call>(call))).wait();
  }
  NcclRequest request(cudaEvent_t done) { return NcclRequest(done, &exposed_, &mu_); }
  std::unique_ptr<Request> async_request(cudaEvent_t done) {
    return std::make_unique<NcclRequest>(done, &exposed_, &mu_);
  }

  CommTimes take_device_times() override {
    std::lock_guard lock(mu_);
    return {busy_.take(), exposed_.take()};
  }

  void do_all_gather(const float* send, float* recv, size_t count) override {
    run("all_gather", [&](cudaStream_t s) { return ncclAllGather(send, recv, count, ncclFloat, comm_, s); });
  }
  std::unique_ptr<Request> do_all_gather_async(const float* send, float* recv, size_t count) override {
    return async_request(enqueue(
        "all_gather_async", [&](cudaStream_t s) { return ncclAllGather(send, recv, count, ncclFloat, comm_, s); }));
  }
  void do_all_gather_bytes(const void* send, void* recv, size_t bytes) override {
    run("all_gather_bytes", [&](cudaStream_t s) { return ncclAllGather(send, recv, bytes, ncclUint8, comm_, s); });
  }
  std::unique_ptr<Request> do_all_gather_bytes_async(const void* send, void* recv, size_t bytes) override {
    return async_request(enqueue(
        "all_gather_bytes_async",
        [&](cudaStream_t s) { return ncclAllGather(send, recv, bytes, ncclUint8, comm_, s); }));
  }
  std::unique_ptr<Request> do_ring_shift_bytes_async(const void* send, void* recv, size_t bytes,
                                                     int distance) override {
    const int next = (rank_ + distance) % size_, prev = (rank_ + size_ - distance) % size_;
    return async_request(enqueue("ring_shift_bytes_async", [&](cudaStream_t s) {
      ncclResult_t r = ncclGroupStart();
      if (r == ncclSuccess) r = ncclSend(send, bytes, ncclUint8, next, comm_, s);
      if (r == ncclSuccess) r = ncclRecv(recv, bytes, ncclUint8, prev, comm_, s);
      const ncclResult_t end = ncclGroupEnd();  // closes the group even after a failed call
      return r != ncclSuccess ? r : end;
    }));
  }
  void do_reduce_scatter(const float* send, float* recv, size_t count) override {
    run("reduce_scatter",
        [&](cudaStream_t s) { return ncclReduceScatter(send, recv, count, ncclFloat, ncclSum, comm_, s); });
  }
  void do_all_reduce(float* buf, size_t count) override {
    run("all_reduce", [&](cudaStream_t s) { return ncclAllReduce(buf, buf, count, ncclFloat, ncclSum, comm_, s); });
  }
  void do_all_reduce(double* buf, size_t count) override {
    run("all_reduce", [&](cudaStream_t s) { return ncclAllReduce(buf, buf, count, ncclDouble, ncclSum, comm_, s); });
  }
  void do_all_reduce_max(double* buf, size_t count) override {
    run("all_reduce_max",
        [&](cudaStream_t s) { return ncclAllReduce(buf, buf, count, ncclDouble, ncclMax, comm_, s); });
  }
  void do_broadcast(void* buf, size_t bytes, int root) override {
    run("broadcast", [&](cudaStream_t s) { return ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, s); });
  }
  // A host-side meeting point: the host comm's barrier (device work is not waited for).
  void do_barrier() override { host_.barrier(); }

  // Context parallelism's groups: the host comm split alike (MPI_Comm_split), then a NCCL
  // communicator of the group's own over it (its unique id broadcast within the group). The
  // group's ranks are devices of the parent's ranks, so each already has its device bound.
  // Unverified on GPUs (none lent with two devices yet).
  std::unique_ptr<Comm> do_split(int color, int key) override {
    return std::make_unique<NcclComm>(host_.split(color, key));
  }

  void do_set_timeout(double seconds) override {
    host_.set_timeout(seconds);  // the id broadcast and barriers are host collectives
    std::lock_guard lock(mu_);
    watchdog_.reset();
    watched_ = false;
    if (seconds == 0 || size_ == 1 || host_.backend() != "mpi") return;  // one rank waits for nobody
    // The job ends right after the hook (MPI_Abort), so the monitor's next poll of the aborted
    // communicator never comes.
    watchdog_ = std::make_unique<CollectiveWatchdog>(MPI_COMM_WORLD, seconds, [this] {
      stop_ = true;
      ncclCommAbort(comm_);
    });
  }

  // The NCCL communicator first (peers blocked in a collective with us get an error instead of
  // waiting), then the whole job through the host comm.
  void do_abort(int code) override {
    stop_ = true;  // the monitor polls comm_, which is about to go
    if (monitor_.joinable()) monitor_.join();
    ncclCommAbort(comm_);
    comm_ = nullptr;
    host_.abort(code);
  }

  // Polls the communicator's asynchronous error and, for the watchdog, the completion of the
  // latest collective.
  void monitor() {
    cudaSetDevice(device_);
    while (!stop_) {
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress) {
        const char* detail = ncclGetLastError(comm_);
        std::fprintf(stderr, "%s: error: rank %d: NCCL reported %s%s%s; ending the job\n",
                     program_invocation_short_name, rank_, ncclGetErrorString(async),
                     detail != nullptr && *detail != '\0' ? ": " : "", detail != nullptr ? detail : "");
        std::fflush(stderr);
        ncclCommAbort(comm_);
        end_job(CollectiveWatchdog::kExitCode);
      }
      {
        std::lock_guard lock(mu_);
        if (watchdog_ && watched_ && cudaEventQuery(latest_) == cudaSuccess) {
          watchdog_->leave();  // the latest queued collective is done on this rank
          watched_ = false;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  Comm& host_;
  std::unique_ptr<Comm> owned_host_;  // host_ when this comm is a split's group, else null
  int rank_ = 0, size_ = 1, device_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;   // compute's progress, for the communication stream to wait on
  cudaEvent_t latest_ = nullptr;  // the end of the latest queued collective
  std::mutex mu_;                 // enqueue and waits vs the monitor and the timers' readers
  EventTimer busy_, exposed_;     // collectives on the comm stream; compute's waits for them
  bool watched_ = false;          // the watchdog was told of a collective not yet seen complete
  std::unique_ptr<CollectiveWatchdog> watchdog_;
  std::atomic<bool> stop_{false};
  std::thread monitor_;
};

}  // namespace

std::unique_ptr<Comm> make_nccl_comm(Comm& host) { return std::make_unique<NcclComm>(host); }

}  // namespace retain::dist
