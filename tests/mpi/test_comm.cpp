// Collectives of retain::dist::Comm against closed-form expectations. The same binary runs
// plainly (a one-rank LocalComm) and under `mpirun -np N` (MpiComm); see mpi_test_main.h for
// the rules every multi-rank test follows.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/device.h"
#include "kernels/dist/comm.h"
#include "kernels/dist/mpi_check.h"
#include "tests/mpi/mpi_test_main.h"

namespace retain::dist {
namespace {

Comm& comm() { return mpi_test::world(); }

// Odd sizes, zero, and primes (not a multiple of any chunk limit below).
const size_t kCounts[] = {0, 1, 3, 17, 1013, 65537};

// Element values are small integers (or multiples of 1/4), so float/double sums are exact
// and results can be compared with ==.
float gather_value(int rank, size_t i) { return static_cast<float>(rank * 1000 + int(i % 997)); }

// Rank r's element i of block b for reduce_scatter / all_reduce.
float block_value(int rank, int block, size_t i) {
  return static_cast<float>(rank * 7 + block * 100 + int(i % 97));
}
// Sum over ranks r in [0, S) of block_value(r, block, i), in closed form.
float block_sum(int world, int block, size_t i) {
  return static_cast<float>(7 * world * (world - 1) / 2 + world * (block * 100 + int(i % 97)));
}

// ---- basics -----------------------------------------------------------------------------

TEST(Comm, RankAndSizeMatchTheLauncher) {
  const int s = comm().size(), r = comm().rank();
  EXPECT_GE(s, 1);
  EXPECT_GE(r, 0);
  EXPECT_LT(r, s);
  EXPECT_EQ(comm().is_main_rank(), r == 0);
  EXPECT_EQ(comm().backend(), launched_by_mpirun() ? "mpi" : "local");
  if (const char* env = std::getenv("OMPI_COMM_WORLD_SIZE")) {
    EXPECT_EQ(s, std::atoi(env));
  }
  if (const char* env = std::getenv("OMPI_COMM_WORLD_RANK")) {
    EXPECT_EQ(r, std::atoi(env));
  }
  // Set by the CTest registration, so that a launcher that silently gave every process its
  // own one-rank world cannot pass.
  if (const char* env = std::getenv("RETAIN_TEST_WORLD_SIZE")) {
    EXPECT_EQ(s, std::atoi(env));
  }

  // Ranks are distinct and cover [0, size).
  std::vector<float> ranks(static_cast<size_t>(s), -1.0f);
  const float mine = static_cast<float>(r);
  comm().all_gather(&mine, ranks.data(), 1);
  for (int i = 0; i < s; ++i) EXPECT_EQ(ranks[size_t(i)], float(i));
}

TEST(Comm, BarrierWaitsForTheSlowestRank) {
  using Clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC: one clock for the whole host
  const auto delay = std::chrono::milliseconds(100);
  comm().barrier();
  const auto start = Clock::now();
  std::this_thread::sleep_for(delay * comm().rank());
  comm().barrier();
  const auto waited = Clock::now() - start;
  // Every rank leaves the second barrier only after the last rank (which slept
  // (size-1) * delay) entered it; the first barrier's exits are a few ms apart at most.
  EXPECT_GE(waited, delay * (comm().size() - 1) - std::chrono::milliseconds(30));
  comm().barrier();
}

// ---- broadcast --------------------------------------------------------------------------

TEST(Comm, BroadcastFromEveryRoot) {
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{13}, size_t{4099}, size_t{100003}}) {
    for (int root = 0; root < comm().size(); ++root) {
      std::vector<uint8_t> buf(bytes);
      for (size_t i = 0; i < bytes; ++i) buf[i] = uint8_t(comm().rank() * 31 + i * 7);
      comm().broadcast(buf.data(), bytes, root);
      size_t bad = 0;
      for (size_t i = 0; i < bytes; ++i) bad += buf[i] != uint8_t(root * 31 + i * 7);
      EXPECT_EQ(bad, 0u) << bytes << " bytes from root " << root;
    }
  }
}

TEST(Comm, BroadcastOfAStruct) {
  struct Header {
    int64_t step;
    double lr;
    char name[12];
  };
  Header h{};
  if (comm().is_main_rank()) {
    h = Header{1234567890123, 3e-4, {}};
    std::snprintf(h.name, sizeof h.name, "%s", "qwen3-0.6b");
  }
  comm().broadcast(&h, sizeof h, 0);
  EXPECT_EQ(h.step, 1234567890123);
  EXPECT_EQ(h.lr, 3e-4);
  EXPECT_STREQ(h.name, "qwen3-0.6b");
}

// ---- argument errors: thrown on every rank alike, before any communication ------------------

TEST(Comm, BadArgumentsThrow) {
  char byte = 0;
  EXPECT_THROW(comm().broadcast(&byte, 1, comm().size()), retain::Error);
  EXPECT_THROW(comm().broadcast(&byte, 1, -1), retain::Error);
  EXPECT_THROW(comm().broadcast(nullptr, 1, 0), retain::Error);
  EXPECT_THROW(comm().all_reduce(static_cast<float*>(nullptr), 4), retain::Error);

  const size_t n = 8, s = size_t(comm().size());
  std::vector<float> buf(n * s + n);
  // reduce_scatter's recv inside its send.
  EXPECT_THROW(comm().reduce_scatter(buf.data(), buf.data() + 1, n), retain::Error);
  // all_gather's send overlapping recv, but not this rank's block.
  EXPECT_THROW(comm().all_gather(buf.data() + comm().rank() * n + 1, buf.data(), n), retain::Error);
  EXPECT_THROW(comm().set_max_chunk(0), retain::Error);
  EXPECT_THROW(comm().set_max_chunk(size_t{INT_MAX} + 1), retain::Error);

  // Zero counts are no-ops, null buffers allowed.
  comm().all_gather(nullptr, nullptr, 0);
  comm().reduce_scatter(nullptr, nullptr, 0);
  comm().all_reduce(static_cast<double*>(nullptr), 0);
  comm().broadcast(nullptr, 0, 0);
}

TEST(Comm, BadArgumentsOfTheNewerCollectivesThrow) {
  const size_t n = 8, s = size_t(comm().size());
  std::vector<float> buf(n * s + n);
  EXPECT_THROW(comm().all_gather_async(nullptr, buf.data(), n), retain::Error);
  EXPECT_THROW(comm().all_gather_async(buf.data() + comm().rank() * n + 1, buf.data(), n),
               retain::Error);
  EXPECT_THROW(comm().all_gather_bytes(buf.data(), nullptr, 4), retain::Error);
  // Bytes: no in-place form, any overlap is an error.
  EXPECT_THROW(comm().all_gather_bytes(reinterpret_cast<char*>(buf.data()) + comm().rank() * 4,
                                       buf.data(), 4),
               retain::Error);
  EXPECT_THROW(comm().all_reduce_max(nullptr, 1), retain::Error);
  // Zero counts: no-ops; the request is complete at once.
  auto req = comm().all_gather_async(nullptr, nullptr, 0);
  ASSERT_NE(req, nullptr);
  EXPECT_TRUE(req->test());
  req->wait();
  comm().all_gather_bytes(nullptr, nullptr, 0);
  comm().all_reduce_max(nullptr, 0);
}

// abort() ends the process with the code at once, flushing stdio first (no destructors).
// The MPI form (every rank of the job ends) is the CTest comm.abort_np2: see abort_demo.cpp.
TEST(Comm, LocalAbortFlushesAndExitsWithTheCode) {
  if (comm().backend() != "local") GTEST_SKIP() << "death tests fork; not inside an MPI job";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::string path = ::testing::TempDir() + "retain_abort_flush.txt";
  std::remove(path.c_str());
  auto local = make_local_comm();
  EXPECT_EXIT(
      {
        FILE* f = std::fopen(path.c_str(), "w");
        if (f == nullptr) std::_Exit(99);
        std::fputs("written before abort", f);  // sits in f's buffer until flushed
        local->abort(3);
      },
      ::testing::ExitedWithCode(3), "");
  FILE* f = std::fopen(path.c_str(), "r");
  ASSERT_NE(f, nullptr);
  char text[64] = {};
  const size_t n = std::fread(text, 1, sizeof text - 1, f);
  std::fclose(f);
  std::remove(path.c_str());
  EXPECT_EQ(std::string(text, n), "written before abort");
}

TEST(Comm, MpiErrorsBecomeRetainErrors) {
  if (comm().backend() != "mpi") GTEST_SKIP() << "no MPI in a one-rank plain run";
  // A negative count fails MPI's own argument check, locally on every rank.
  char byte = 0;
  try {
    MPI_CHECK(MPI_Bcast(&byte, -1, MPI_BYTE, 0, MPI_COMM_WORLD));
    ADD_FAILURE() << "MPI_Bcast with count -1 did not fail";
  } catch (const retain::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("MPI_Bcast failed"), std::string::npos) << what;
    EXPECT_NE(what.find(mpi_error_string(MPI_ERR_COUNT)), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  EXPECT_EQ(mpi_error_string(MPI_SUCCESS).empty(), false);
}

TEST(Comm, LocalCommIsAOneRankWorld) {
  auto local = make_local_comm();
  EXPECT_EQ(local->size(), 1);
  EXPECT_EQ(local->rank(), 0);
  EXPECT_TRUE(local->is_main_rank());
  std::vector<float> send = {1, 2, 3}, recv(3);
  local->all_gather(send.data(), recv.data(), 3);
  EXPECT_EQ(recv, send);
  recv.assign(3, 0);
  local->reduce_scatter(send.data(), recv.data(), 3);
  EXPECT_EQ(recv, send);
  local->all_reduce(send.data(), 3);
  EXPECT_EQ(send, (std::vector<float>{1, 2, 3}));
  EXPECT_THROW(local->broadcast(send.data(), 4, 1), retain::Error);
  recv.assign(3, 0);
  auto req = local->all_gather_async(send.data(), recv.data(), 3);
  EXPECT_TRUE(req->test());  // the copy is done when the request is made
  EXPECT_EQ(recv, send);
  const int32_t ids[2] = {-5, 7};
  int32_t all_ids[2] = {};
  local->all_gather_bytes(ids, all_ids, sizeof ids);
  EXPECT_EQ(all_ids[0], -5);
  EXPECT_EQ(all_ids[1], 7);
  double m[2] = {-1.5, 2};
  local->all_reduce_max(m, 2);
  EXPECT_EQ(m[0], -1.5);
  EXPECT_EQ(m[1], 2.0);
}

TEST(Comm, SplitMakesGroupsOfTheSameColor) {
  // Groups of two consecutive ranks (context parallelism's rank / N), ranked within by rank % 2.
  const int r = comm().rank(), s = comm().size();
  std::unique_ptr<Comm> group = comm().split(r / 2, r % 2);
  EXPECT_EQ(group->rank(), r % 2);
  EXPECT_EQ(group->size(), std::min(2, s - (r / 2) * 2));
  double x = r;  // the sum over the group is the sum of its world ranks
  group->all_reduce(&x, 1);
  double want = 0;
  for (int q = (r / 2) * 2; q < std::min(s, (r / 2) * 2 + 2); ++q) want += q;
  EXPECT_EQ(x, want);
  EXPECT_THROW(comm().split(-1, 0), retain::Error);
}

// ---- the reductions and gathers, with the chunk limit as parameter ---------------------------

class Chunked : public ::testing::TestWithParam<size_t> {
 protected:
  void SetUp() override { comm().set_max_chunk(GetParam()); }
  void TearDown() override { comm().set_max_chunk(INT_MAX); }
  int r() const { return comm().rank(); }
  int s() const { return comm().size(); }
  // Nonblocking pieces cost a request each (and a datatype): keep the chunk7 runs to a few
  // thousand; larger counts are covered by the bigger chunk limits.
  static bool too_many_pieces(size_t elems) { return elems / GetParam() > 2000; }
};

TEST_P(Chunked, AllGather) {
  for (size_t count : kCounts) {
    std::vector<float> send(count), recv(count * size_t(s()), -1.0f);
    for (size_t i = 0; i < count; ++i) send[i] = gather_value(r(), i);
    comm().all_gather(send.data(), recv.data(), count);
    size_t bad = 0;
    for (int from = 0; from < s(); ++from)
      for (size_t i = 0; i < count; ++i)
        bad += recv[size_t(from) * count + i] != gather_value(from, i);
    EXPECT_EQ(bad, 0u) << "count " << count;
  }
}

TEST_P(Chunked, AllGatherInPlace) {
  for (size_t count : kCounts) {
    std::vector<float> buf(count * size_t(s()), -1.0f);
    float* mine = buf.data() + size_t(r()) * count;
    for (size_t i = 0; i < count; ++i) mine[i] = gather_value(r(), i);
    comm().all_gather(mine, buf.data(), count);
    size_t bad = 0;
    for (int from = 0; from < s(); ++from)
      for (size_t i = 0; i < count; ++i)
        bad += buf[size_t(from) * count + i] != gather_value(from, i);
    EXPECT_EQ(bad, 0u) << "count " << count;
  }
}

TEST_P(Chunked, ReduceScatter) {
  for (size_t count : kCounts) {
    std::vector<float> send(count * size_t(s())), recv(count, -1.0f);
    for (int b = 0; b < s(); ++b)
      for (size_t i = 0; i < count; ++i) send[size_t(b) * count + i] = block_value(r(), b, i);
    const std::vector<float> before = send;
    comm().reduce_scatter(send.data(), recv.data(), count);
    size_t bad = 0;
    for (size_t i = 0; i < count; ++i) bad += recv[i] != block_sum(s(), r(), i);
    EXPECT_EQ(bad, 0u) << "count " << count;
    EXPECT_TRUE(send == before) << "reduce_scatter wrote into send, count " << count;
  }
}

TEST_P(Chunked, AllReduceFloat) {
  for (size_t count : kCounts) {
    std::vector<float> buf(count);
    for (size_t i = 0; i < count; ++i) buf[i] = block_value(r(), 0, i);
    comm().all_reduce(buf.data(), count);
    size_t bad = 0;
    for (size_t i = 0; i < count; ++i) bad += buf[i] != block_sum(s(), 0, i);
    EXPECT_EQ(bad, 0u) << "count " << count;
  }
}

TEST_P(Chunked, AllReduceDouble) {
  for (size_t count : kCounts) {
    // (rank + 1) * 0.25 + i: sum over ranks = 0.25 * S(S+1)/2 + S * i, exact in float64
    // where float32 could not hold it (i up to 65536 plus fractions beyond 2^24 / S).
    std::vector<double> buf(count);
    for (size_t i = 0; i < count; ++i) buf[i] = (r() + 1) * 0.25 + double(i) * 1024.0;
    comm().all_reduce(buf.data(), count);
    const double S = s();
    size_t bad = 0;
    for (size_t i = 0; i < count; ++i)
      bad += buf[i] != 0.25 * S * (S + 1) / 2 + S * double(i) * 1024.0;
    EXPECT_EQ(bad, 0u) << "count " << count;
  }
  // A loss reduced across ranks: sum of per-rank means.
  double loss = 1.0 / 3.0 + comm().rank();
  comm().all_reduce(&loss, 1);
  EXPECT_DOUBLE_EQ(loss, comm().size() / 3.0 + comm().size() * (comm().size() - 1) / 2.0);
}

TEST_P(Chunked, ReduceScatterThenAllGatherEqualsAllReduce) {
  for (size_t count : kCounts) {
    const size_t total = count * size_t(s());
    std::vector<float> data(total);
    for (size_t j = 0; j < total; ++j) data[j] = block_value(r(), int(j % 5), j);

    std::vector<float> reduced = data;
    comm().all_reduce(reduced.data(), total);

    std::vector<float> shard(count), gathered(total, -1.0f);
    comm().reduce_scatter(data.data(), shard.data(), count);
    comm().all_gather(shard.data(), gathered.data(), count);

    EXPECT_TRUE(gathered == reduced) << "count " << count;
    size_t bad = 0;
    for (size_t j = 0; j < total; ++j) bad += reduced[j] != block_sum(s(), int(j % 5), j);
    EXPECT_EQ(bad, 0u) << "count " << count;
  }
}

TEST_P(Chunked, BroadcastChunked) {
  const size_t bytes = 10007;
  const int root = comm().size() - 1;
  std::vector<uint8_t> buf(bytes);
  for (size_t i = 0; i < bytes; ++i) buf[i] = uint8_t(comm().rank() + i * 3);
  comm().broadcast(buf.data(), bytes, root);
  size_t bad = 0;
  for (size_t i = 0; i < bytes; ++i) bad += buf[i] != uint8_t(root + i * 3);
  EXPECT_EQ(bad, 0u);
}

TEST_P(Chunked, AllGatherAsync) {
  for (size_t count : kCounts) {
    if (too_many_pieces(count)) continue;
    std::vector<float> send(count), recv(count * size_t(s()), -1.0f);
    for (size_t i = 0; i < count; ++i) send[i] = gather_value(r(), i);
    std::unique_ptr<Request> req = comm().all_gather_async(send.data(), recv.data(), count);
    ASSERT_NE(req, nullptr);
    req->wait();
    req->wait();  // idempotent
    EXPECT_TRUE(req->test());
    size_t bad = 0;
    for (int from = 0; from < s(); ++from)
      for (size_t i = 0; i < count; ++i)
        bad += recv[size_t(from) * count + i] != gather_value(from, i);
    EXPECT_EQ(bad, 0u) << "count " << count;
  }
}

// Several gathers in flight at once (one in place), a blocking collective issued while they
// are, completion polled with test(), and one request never waited for (its destructor waits).
TEST_P(Chunked, AllGatherAsyncOverlapping) {
  const size_t a = 1013, b = 4099;
  std::vector<float> send_a(a), recv_a(a * size_t(s()), -1.0f);
  std::vector<float> in_place(b * size_t(s()), -1.0f);
  std::vector<float> send_c(17), recv_c(17 * size_t(s()), -1.0f);
  for (size_t i = 0; i < a; ++i) send_a[i] = gather_value(r(), i);
  for (size_t i = 0; i < b; ++i) in_place[size_t(r()) * b + i] = gather_value(r(), i + 1);
  for (size_t i = 0; i < 17; ++i) send_c[i] = gather_value(r(), i + 2);

  auto req_a = comm().all_gather_async(send_a.data(), recv_a.data(), a);
  auto req_b = comm().all_gather_async(in_place.data() + size_t(r()) * b, in_place.data(), b);
  {
    auto req_c = comm().all_gather_async(send_c.data(), recv_c.data(), 17);
    double x = 1.0;
    comm().all_reduce(&x, 1);  // blocking, while three gathers are in flight
    EXPECT_EQ(x, double(s()));
  }  // req_c destroyed unwaited: it completes there
  while (!req_b->test()) {
  }
  req_a->wait();
  size_t bad = 0;
  for (int from = 0; from < s(); ++from) {
    for (size_t i = 0; i < a; ++i) bad += recv_a[size_t(from) * a + i] != gather_value(from, i);
    for (size_t i = 0; i < b; ++i)
      bad += in_place[size_t(from) * b + i] != gather_value(from, i + 1);
    for (size_t i = 0; i < 17; ++i)
      bad += recv_c[size_t(from) * 17 + i] != gather_value(from, i + 2);
  }
  EXPECT_EQ(bad, 0u);
}

TEST_P(Chunked, AllGatherBytes) {
  for (size_t count : kCounts) {
    if (too_many_pieces(count * sizeof(int32_t))) continue;
    // int32 token ids and uint8 masks, as --dump-grads gathers a batch.
    auto id = [](int rank, size_t i) { return int32_t(rank * 100000 + int(i)) * (i % 2 ? -1 : 1); };
    std::vector<int32_t> ids(count), all_ids(count * size_t(s()), -1);
    std::vector<uint8_t> mask(count), all_mask(count * size_t(s()), 7);
    for (size_t i = 0; i < count; ++i) {
      ids[i] = id(r(), i);
      mask[i] = uint8_t((i + size_t(r())) % 3 == 0);
    }
    comm().all_gather_bytes(ids.data(), all_ids.data(), count * sizeof(int32_t));
    comm().all_gather_bytes(mask.data(), all_mask.data(), count);
    size_t bad = 0;
    for (int from = 0; from < s(); ++from)
      for (size_t i = 0; i < count; ++i) {
        bad += all_ids[size_t(from) * count + i] != id(from, i);
        bad += all_mask[size_t(from) * count + i] != uint8_t((i + size_t(from)) % 3 == 0);
      }
    EXPECT_EQ(bad, 0u) << "count " << count;
  }
}

TEST_P(Chunked, AllReduceMax) {
  for (size_t count : kCounts) {
    // Rank r's value at i is highest on rank (i mod S); negative values and fractions too.
    std::vector<double> buf(count);
    for (size_t i = 0; i < count; ++i)
      buf[i] = -1e6 + double((size_t(r()) + s() - i % size_t(s())) % size_t(s())) * 0.5 +
               double(i);
    comm().all_reduce_max(buf.data(), count);
    size_t bad = 0;
    for (size_t i = 0; i < count; ++i) bad += buf[i] != -1e6 + double(s() - 1) * 0.5 + double(i);
    EXPECT_EQ(bad, 0u) << "count " << count;
  }
  // A stop signal raised on the last rank only reaches every rank.
  double stop = comm().rank() == comm().size() - 1 ? 1.0 : 0.0;
  comm().all_reduce_max(&stop, 1);
  EXPECT_EQ(stop, 1.0);
}

TEST_P(Chunked, RingShift) {
  // Each rank's bytes reach the next rank; two shifts in flight at once, as a ring step holds
  // the keys/values and their gradients.
  comm().take_ring_bytes();
  size_t sent = 0;
  for (size_t count : kCounts) {
    if (too_many_pieces(count)) continue;
    auto value = [](int rank, size_t i) { return uint8_t((rank * 131 + int(i) * 7) & 0xff); };
    std::vector<uint8_t> a(count), b(count + 5), got_a(count, 0), got_b(count + 5, 0);
    for (size_t i = 0; i < count; ++i) a[i] = value(r(), i);
    for (size_t i = 0; i < count + 5; ++i) b[i] = value(r() + 1000, i);
    auto req_a = comm().ring_shift_bytes_async(a.data(), got_a.data(), count);
    auto req_b = comm().ring_shift_bytes_async(b.data(), got_b.data(), count + 5);
    sent += count == 0 ? 5 : 2 * count + 5;
    req_b->wait();
    req_a->wait();
    const int from = (r() + s() - 1) % s();
    size_t bad = 0;
    for (size_t i = 0; i < count; ++i) bad += got_a[i] != value(from, i);
    for (size_t i = 0; i < count + 5; ++i) bad += got_b[i] != value(from + 1000, i);
    EXPECT_EQ(bad, 0u) << "count " << count;
  }
  EXPECT_EQ(comm().take_ring_bytes(), sent);
  EXPECT_EQ(comm().take_ring_bytes(), 0u);
  std::vector<uint8_t> x(8);
  EXPECT_THROW(comm().ring_shift_bytes_async(x.data(), x.data() + 4, 8), retain::Error);  // overlap
  EXPECT_THROW(comm().ring_shift_bytes_async(nullptr, x.data(), 8), retain::Error);
}

TEST_P(Chunked, ShiftByDistance) {
  // Distance d: rank r's bytes reach rank r + d (mod size), d ≥ size wraps; the pairwise
  // exchange of gather_to_owners.
  for (int d = 0; d <= s() + 1; ++d)
    for (size_t count : {size_t{1}, size_t{1000}, size_t{4097}}) {
      if (too_many_pieces(count)) continue;
      auto value = [d](int rank, size_t i) { return uint8_t((rank * 37 + d * 11 + int(i) * 5) & 0xff); };
      std::vector<uint8_t> a(count), got(count, 0);
      for (size_t i = 0; i < count; ++i) a[i] = value(r(), i);
      comm().ring_shift_bytes_async(a.data(), got.data(), count, d)->wait();
      const int from = ((r() - d) % s() + s()) % s();
      size_t bad = 0;
      for (size_t i = 0; i < count; ++i) bad += got[i] != value(from, i);
      EXPECT_EQ(bad, 0u) << "distance " << d << " count " << count;
    }
  std::vector<uint8_t> x(8), y(8);
  EXPECT_THROW(comm().ring_shift_bytes_async(x.data(), y.data(), 8, -1), retain::Error);
}

// INT_MAX: one call per collective; 1000 and 64: several pieces, the last one short; 7: many.
INSTANTIATE_TEST_SUITE_P(MaxChunk, Chunked, ::testing::Values(size_t{INT_MAX}, 1000, 64, 7),
                         [](const auto& p) {
                           return p.param == size_t{INT_MAX} ? std::string("unchunked")
                                                             : "chunk" + std::to_string(p.param);
                         });

// Over INT_MAX for real: 2 GiB + a bit per rank, so only when asked (RETAIN_TEST_LARGE=1).
TEST(Comm, BroadcastAboveIntMax) {
  const char* large = std::getenv("RETAIN_TEST_LARGE");
  if (large == nullptr || std::string(large) != "1") GTEST_SKIP() << "set RETAIN_TEST_LARGE=1";
  const size_t bytes = size_t{INT_MAX} + 12345;
  std::vector<uint8_t> buf(bytes, uint8_t(comm().rank() + 1));
  buf[bytes - 1] = uint8_t(100 + comm().rank());
  comm().broadcast(buf.data(), bytes, 0);
  size_t bad = 0;
  for (size_t i = 0; i + 1 < bytes; ++i) bad += buf[i] != 1;
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(buf[bytes - 1], 100);
}

// ---- node-local rank (which GPU a rank binds) ---------------------------------------------

// The launcher variables local_rank_from_env reads, saved and cleared for a test's scope and
// restored after (under mpirun OpenMPI set OMPI_COMM_WORLD_LOCAL_RANK; it reads it at MPI init
// only, so clearing it later changes nothing but what retain reads).
class LauncherVariables {
 public:
  static constexpr const char* kNames[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"};
  LauncherVariables() {
    for (const char* n : kNames) {
      const char* v = std::getenv(n);
      saved_.emplace_back(v != nullptr, v ? v : "");
      ::unsetenv(n);
    }
  }
  ~LauncherVariables() {
    for (size_t i = 0; i < std::size(kNames); ++i)
      if (saved_[i].first)
        ::setenv(kNames[i], saved_[i].second.c_str(), 1);
      else
        ::unsetenv(kNames[i]);
  }
  LauncherVariables(const LauncherVariables&) = delete;
  LauncherVariables& operator=(const LauncherVariables&) = delete;

 private:
  std::vector<std::pair<bool, std::string>> saved_;
};

TEST(LocalRank, LauncherVariablesTakePrecedenceInOrder) {
  const LauncherVariables clear;
  EXPECT_EQ(local_rank_from_env(5), 5);  // none set: the fallback
  ::setenv("MPI_LOCALRANKID", "3", 1);
  EXPECT_EQ(local_rank_from_env(5), 3);
  ::setenv("SLURM_LOCALID", "2", 1);
  EXPECT_EQ(local_rank_from_env(5), 2);  // Slurm's before MPICH's
  ::setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
  EXPECT_EQ(local_rank_from_env(5), 1);  // OpenMPI's before both
  ::setenv("OMPI_COMM_WORLD_LOCAL_RANK", "", 1);
  EXPECT_EQ(local_rank_from_env(5), 2);  // empty counts as unset
  ::setenv("SLURM_LOCALID", "0", 1);
  EXPECT_EQ(local_rank_from_env(5), 0);  // 0 is a value, not "unset"
  for (const char* bad : {"x", "-1", "1x", "99999999999"}) {
    ::setenv("SLURM_LOCALID", bad, 1);
    try {
      local_rank_from_env(5);
      ADD_FAILURE() << "SLURM_LOCALID=" << bad << " was accepted";
    } catch (const retain::Error& e) {
      EXPECT_NE(std::string(e.what()).find("SLURM_LOCALID"), std::string::npos) << e.what();
    }
  }
}

// With no launcher variable the rank is counted from the hosts: every rank of this test runs
// on this host, so rank r is the r-th there, and the ranks' local ranks are 0..size-1.
TEST(LocalRank, HostnameCountWhenNoVariableIsSet) {
  const LauncherVariables clear;
  const int local = local_rank_from_env(node_local_rank(comm()));
  EXPECT_EQ(local, comm().rank());
  std::vector<float> all(static_cast<size_t>(comm().size()), -1.0f);
  const float mine = static_cast<float>(local);
  comm().all_gather(&mine, all.data(), 1);
  for (int r = 0; r < comm().size(); ++r) EXPECT_EQ(all[size_t(r)], float(r));
}

// Ranks on different hosts count apart: with even and odd ranks on two pretend hosts, rank r
// is the (r / 2)-th of its host.
TEST(LocalRank, RanksOnOtherHostsAreNotCounted) {
  const int r = comm().rank();
  EXPECT_EQ(node_local_rank(comm(), r % 2 == 0 ? "node-a" : "node-b"), r / 2);
  EXPECT_EQ(node_local_rank(comm(), "same"), r);
  // Only the first 255 bytes count.
  EXPECT_EQ(node_local_rank(comm(), std::string(300, 'h') + std::to_string(r)), r);
}

}  // namespace
}  // namespace retain::dist
