#include "kernels/dist/watchdog.h"

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "kernels/dist/mpi_check.h"

namespace retain::dist {

namespace {

constexpr int kQueryTag = 1, kReplyTag = 2;
constexpr auto kPoll = std::chrono::milliseconds(20);

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double seconds_since(int64_t ns) { return static_cast<double>(now_ns() - ns) * 1e-9; }

struct Query {
  int64_t id;
  uint64_t seq;  // the collective the asker waits in
};

}  // namespace

// What a rank says about itself. Plain bytes on the wire: every rank runs the same binary.
struct CollectiveWatchdog::Reply {
  int64_t id;
  uint64_t seq;
  int32_t inside;
  double idle_seconds;  // since its last enter/leave
  char op[32];
};

// Rank r of the watched communicator as a rank of MPI_COMM_WORLD: what the messages name, so that
// a group's watchdog (context parallelism's ring, Comm::split) names the ranks mpirun knows.
int CollectiveWatchdog::world_rank(int r) const {
  MPI_Group mine = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  int out = r;
  if (MPI_Comm_group(side_, &mine) == MPI_SUCCESS && MPI_Comm_group(MPI_COMM_WORLD, &world) == MPI_SUCCESS)
    MPI_Group_translate_ranks(mine, 1, &r, world, &out);
  if (mine != MPI_GROUP_NULL) MPI_Group_free(&mine);
  if (world != MPI_GROUP_NULL) MPI_Group_free(&world);
  return out == MPI_UNDEFINED ? r : out;
}

CollectiveWatchdog::CollectiveWatchdog(MPI_Comm world, double timeout_seconds, std::function<void()> before_abort)
    : timeout_(timeout_seconds), before_abort_(std::move(before_abort)) {
  MPI_CHECK(MPI_Comm_dup(world, &side_));
  MPI_CHECK(MPI_Comm_set_errhandler(side_, MPI_ERRORS_RETURN));
  MPI_CHECK(MPI_Comm_rank(side_, &rank_));
  MPI_CHECK(MPI_Comm_size(side_, &size_));
  since_ns_ = now_ns();
  thread_ = std::thread([this] { run(); });
}

CollectiveWatchdog::~CollectiveWatchdog() {
  stop_ = true;
  thread_.join();
  MPI_Comm_free(&side_);
}

void CollectiveWatchdog::enter(const char* op, bool counted) {
  op_ = op;
  if (counted) ++seq_;
  since_ns_ = now_ns();
  inside_ = true;
}

void CollectiveWatchdog::leave() {
  inside_ = false;
  since_ns_ = now_ns();
}

void CollectiveWatchdog::run() {
  bool investigated = false;
  uint64_t investigated_seq = 0;
  while (!stop_) {
    serve_queries();
    const uint64_t seq = seq_;
    if (inside_ && !(investigated && investigated_seq == seq)) {
      const double waited = seconds_since(since_ns_);
      if (waited > timeout_) {
        investigated = true;
        investigated_seq = seq;
        investigate(seq, op_.load(), waited);
      }
    }
    std::this_thread::sleep_for(kPoll);
  }
}

void CollectiveWatchdog::serve_queries() {
  for (;;) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kQueryTag, side_, &flag, &st) != MPI_SUCCESS || !flag) return;
    Query q{};
    if (MPI_Recv(&q, sizeof q, MPI_BYTE, st.MPI_SOURCE, kQueryTag, side_, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
    Reply r{};
    r.id = q.id;
    r.seq = seq_;
    r.inside = inside_ ? 1 : 0;
    r.idle_seconds = seconds_since(since_ns_);
    std::snprintf(r.op, sizeof r.op, "%s", op_.load());
    // Small: sent eagerly, never waits for the asker to receive it.
    MPI_Send(&r, sizeof r, MPI_BYTE, st.MPI_SOURCE, kReplyTag, side_);
  }
}

void CollectiveWatchdog::investigate(uint64_t seq, const char* op, double waited) {
  const Query q{++query_id_, seq};
  for (int r = 0; r < size_; ++r)
    if (r != rank_) MPI_Send(&q, sizeof q, MPI_BYTE, r, kQueryTag, side_);
  // A live rank answers within its polling interval; a stopped one never does.
  const double grace = 5.0;
  std::vector<std::optional<Reply>> replies(static_cast<size_t>(size_));
  int missing = size_ - 1;
  const int64_t asked = now_ns();
  while (missing > 0 && seconds_since(asked) < grace) {
    serve_queries();  // the other waiting ranks ask us too
    if (!inside_ || seq_ != seq) return;  // it completed after all: a slow peer, not a dead one
    int flag = 0;
    MPI_Status st;
    while (MPI_Iprobe(MPI_ANY_SOURCE, kReplyTag, side_, &flag, &st) == MPI_SUCCESS && flag) {
      Reply r{};
      MPI_Recv(&r, sizeof r, MPI_BYTE, st.MPI_SOURCE, kReplyTag, side_, MPI_STATUS_IGNORE);
      r.op[sizeof r.op - 1] = '\0';
      auto& slot = replies[static_cast<size_t>(st.MPI_SOURCE)];
      if (r.id == q.id && !slot) {  // a late reply to an earlier question is dropped
        slot = r;
        --missing;
      }
    }
    std::this_thread::sleep_for(kPoll);
  }
  if (!inside_ || seq_ != seq) return;

  // The ranks this collective waits for, and who reports: the lowest rank that is waiting in it.
  std::vector<std::string> late;
  int reporter = rank_;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const auto& reply = replies[static_cast<size_t>(r)];
    if (!reply) {
      late.push_back(fmt::format("rank {}, which does not answer (stopped, or its process is gone)", world_rank(r)));
    } else if (reply->seq < seq || (reply->seq == seq && !reply->inside)) {
      late.push_back(fmt::format("rank {}, which {} collective #{} ({}) {:.0f} s ago and has not joined this one "
                                 "(hung, or stuck between collectives)",
                                 world_rank(r), reply->inside ? "entered" : "left", reply->seq, reply->op,
                                 reply->idle_seconds));
    } else if (r < reporter) {
      reporter = r;
    }
  }
  std::string who;
  for (const std::string& l : late) who += (who.empty() ? "" : "; ") + l;
  if (late.empty()) who = "every rank, although all of them are in it (do the ranks call collectives in different orders?)";
  const std::string line = fmt::format("rank {}: collective #{} ({}) has waited {:.0f} s (--timeout {:g}) for {}; "
                                       "ending the job",
                                       world_rank(rank_), seq, op, waited, timeout_, who);
  if (reporter != rank_) {
    // The reporter ends the job; should it fail to, this rank does, with the same finding.
    const int64_t since = now_ns();
    while (seconds_since(since) < grace) {
      serve_queries();
      std::this_thread::sleep_for(kPoll);
    }
  }
  end_job(line);
}

void CollectiveWatchdog::end_job(const std::string& line) {
  std::fprintf(stderr, "%s: error: %s\n", program_invocation_short_name, line.c_str());
  std::fflush(stderr);
  if (before_abort_) before_abort_();
  MPI_Abort(MPI_COMM_WORLD, kExitCode);
  std::_Exit(kExitCode);
}

}  // namespace retain::dist
