// Shared by the retain-train tests: a scratch directory, running the tools (plainly or under
// mpirun -np N with the environment CI needs), the committed fixture model and corpus packed
// into a dataset, and tensor comparisons.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/tensor.h"
#include "model/safetensors.h"

namespace retain::trainer::test {

namespace fs = std::filesystem;

inline const std::string kFixtures = std::string(RETAIN_FIXTURES_DIR) + "/trainer";
inline const std::string kModel = kFixtures + "/model";
inline std::string bin(const std::string& tool) { return std::string(RETAIN_BIN_DIR) + "/" + tool; }

class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() /
            ("retain_train_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

struct Result {
  int code = -1;
  std::string out, err;
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// mpirun -np N as tests/mpi runs it (shared memory only, root allowed, no binding, yielding),
// one OpenMP thread per rank (more threads than cores make OpenMP's spinning barriers crawl).
inline std::string mpirun(int np) {
  return "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1 "
         "OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_mpi_yield_when_idle=1 "
         "OMPI_MCA_hwloc_base_binding_policy=none OMP_NUM_THREADS=1 " +
         std::string(RETAIN_MPIEXEC) + " -np " + std::to_string(np) + " --oversubscribe ";
}

// Runs `command` through the shell with stdout/stderr captured into scratch files. Launcher
// variables are cleared so a plain command is a one-rank world even inside an MPI job.
inline Result run(const std::string& command, const TempDir& dir) {
  static int n = 0;
  const std::string out = dir / (".out" + std::to_string(n)), err = dir / (".err" + std::to_string(n));
  ++n;
  const std::string cmd = "env -u OMPI_COMM_WORLD_SIZE -u PMIX_RANK -u PMI_SIZE -u PMI_RANK " + command + " >" + out +
                          " 2>" + err;
  const int status = std::system(cmd.c_str());
  Result r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

// The fixture corpus packed as the fixtures were (make_fixtures.py: --seq-len 40 --packing bfd).
inline std::string pack_fixture_corpus(const TempDir& dir) {
  const std::string data = dir / "data.h5";
  const Result r = run(bin("retain-pack") + " --tokenizer " + kModel + " --input " + kFixtures +
                           "/corpus.jsonl --out " + data + " --seq-len 40 --packing bfd -q",
                       dir);
  EXPECT_EQ(r.code, 0) << r.err;
  return data;
}

// ‖a − b‖ / ‖b‖ in double (‖a − b‖ when b = 0). Both tensors are converted to F64.
inline double rel_diff(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to_dtype(DType::F64), y = b.to_dtype(DType::F64);
  EXPECT_EQ(x.numel(), y.numel());
  double num = 0, den = 0;
  for (int64_t i = 0; i < std::min(x.numel(), y.numel()); ++i) {
    const double d = x.data<double>()[i] - y.data<double>()[i];
    num += d * d;
    den += y.data<double>()[i] * y.data<double>()[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline bool bytes_equal(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::equal(static_cast<const char*>(a.raw()), static_cast<const char*>(a.raw()) + a.nbytes(),
                    static_cast<const char*>(b.raw()));
}

}  // namespace retain::trainer::test
