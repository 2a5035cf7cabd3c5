// The collective watchdog of the MPI backend (Comm::set_timeout, docs/reliability.md).
//
// A rank whose collective has not completed after the timeout must end the job and say which
// rank it was waiting for; MPI itself cannot say (a blocking collective just waits). So each
// rank runs a watchdog thread that knows where its main thread is (collectives entered, inside
// one or not, since when) and answers its peers' questions about that over a private
// communicator. When this rank's collective times out, its thread asks every other rank; a
// rank that has not entered the same collective, or does not answer at all, is the one named.
// The lowest-numbered waiting rank prints the line and calls MPI_Abort, so the job ends once,
// with one message, within the timeout plus a few seconds.
//
// Needs MPI_THREAD_MULTIPLE (the thread sends and receives while the main thread sits in a
// collective). Counting is identical on every rank: each collective call (blocking, or the
// start of a nonblocking one) is one; waiting for a nonblocking one is watched but not counted.
#pragma once
#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

namespace retain::dist {

class CollectiveWatchdog {
 public:
  // Collective over `world` (it is duplicated for the watchdog's messages). `before_abort`, if
  // set, runs on the watchdog's thread just before it ends the job (the NCCL backend aborts its
  // communicator there).
  CollectiveWatchdog(MPI_Comm world, double timeout_seconds, std::function<void()> before_abort = {});
  ~CollectiveWatchdog();
  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;

  // The main thread around a collective: enter (counted or not), then leave. The NCCL backend
  // enters when it queues a collective and leaves (from its monitor thread) when the latest
  // queued one has completed on the device.
  void enter(const char* op, bool counted = true);
  void leave();

  // The exit status of a job the watchdog ended (EX_TEMPFAIL: the run may be resumed).
  static constexpr int kExitCode = 75;

 private:
  struct Reply;
  void run();
  void serve_queries();
  void investigate(uint64_t seq, const char* op, double waited);
  [[noreturn]] void end_job(const std::string& line);
  int world_rank(int r) const;  // rank r of the watched comm in MPI_COMM_WORLD (the messages' ranks)

  MPI_Comm side_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  double timeout_;
  std::function<void()> before_abort_;
  int64_t query_id_ = 0;                    // the watchdog thread's own
  std::atomic<uint64_t> seq_{0};            // collectives entered (counted ones)
  std::atomic<bool> inside_{false};         // in a collective now
  std::atomic<int64_t> since_ns_{0};        // steady-clock time of the last enter/leave
  std::atomic<const char*> op_{"none"};     // the current or last collective (a literal)
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace retain::dist
