#include "tests/mpi/mpi_test_main.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace retain::dist::mpi_test {
namespace {

std::unique_ptr<Comm> g_world;

// Non-main ranks print their failures only, each line tagged with the rank.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.message());
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed())
      std::fprintf(stderr, "[rank %d] [  FAILED  ] %s.%s\n", rank_, info.test_suite_name(),
                   info.name());
  }

 private:
  int rank_;
};

}  // namespace

Comm& world() { return *g_world; }

}  // namespace retain::dist::mpi_test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  using retain::dist::mpi_test::g_world;
  const std::string name = argc > 0 ? argv[0] : "test";
  try {
    g_world = retain::dist::make_comm();
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    if (!g_world->is_main_rank()) {
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new retain::dist::mpi_test::FailurePrinter(g_world->rank()));
    }
    const int local = RUN_ALL_TESTS();
    // Every rank's failure fails every rank's exit status, and rank 0 says which ones.
    std::vector<double> failed(size_t(g_world->size()), 0.0);
    failed[size_t(g_world->rank())] = local != 0 ? 1.0 : 0.0;
    g_world->all_reduce(failed.data(), failed.size());
    std::string bad;
    for (size_t r = 0; r < failed.size(); ++r)
      if (failed[r] != 0.0) bad += (bad.empty() ? "" : ", ") + std::to_string(r);
    if (!bad.empty() && g_world->is_main_rank())
      std::fprintf(stderr, "%s: tests failed on rank(s) %s of %d\n", name.c_str(), bad.c_str(),
                   g_world->size());
    g_world.reset();  // finalizes MPI
    return bad.empty() ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name.c_str(), e.what());
    return 1;
  }
}
