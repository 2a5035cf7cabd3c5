// Shared by the retain-train tests: a scratch directory, running the tools (plainly or under
// mpirun -np N with the environment CI needs), the committed fixture model and corpus packed
// into a dataset, and tensor comparisons.
#pragma once
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "kernels/tensor.h"
#include "data/formats/safetensors.h"

namespace retain::trainer::test {

namespace fs = std::filesystem;

// Paths compiled in, each overridable by the environment variable of the same name: on a GPU
// machine launch/gpu-verify.sh runs these tests from a bundle (launch/gpu-bundle.sh) in another
// checkout, with the tools in the bundle and mpirun from it.
inline std::string path_setting(const char* name, const char* built_in) {
  const char* v = std::getenv(name);
  return v && *v ? v : built_in;
}
inline const std::string kFixtures = path_setting("RETAIN_FIXTURES_DIR", RETAIN_FIXTURES_DIR) + "/trainer";
inline const std::string kModel = kFixtures + "/model";
inline std::string bin(const std::string& tool) { return path_setting("RETAIN_BIN_DIR", RETAIN_BIN_DIR) + "/" + tool; }

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
         path_setting("RETAIN_MPIEXEC", RETAIN_MPIEXEC) + " -np " + std::to_string(np) + " --oversubscribe ";
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

// A run of the fixture model with gates that visibly decay, a learning rate that moves them.
inline std::string train_args(const std::string& data, const std::string& out, const std::string& kind, int steps,
                       const std::string& lr = "0.01") {
  return " --model " + kModel + " --data " + data + " --out " + out + " --gate " + kind + " --init-gates " +
         kFixtures + "/gates-" + kind + ".safetensors --memory 4 --global-batch 4 --seed 3 --warmup 2 " +
         "--loss-chunk 16 --lr " + lr + " --steps " + std::to_string(steps);
}

inline std::vector<nlohmann::json> metrics(const std::string& run_dir) {
  std::vector<nlohmann::json> v;
  std::ifstream in(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) v.push_back(nlohmann::json::parse(line));
  return v;
}

// Every gate tensor of two runs' final gates: bit-identical (tol = 0) or within tol relative.
inline void expect_same_gates(const std::string& run_a, const std::string& run_b, double tol) {
  const formats::SafetensorsFile a = formats::SafetensorsFile::open(run_a + "/gates.safetensors");
  const formats::SafetensorsFile b = formats::SafetensorsFile::open(run_b + "/gates.safetensors");
  ASSERT_EQ(a.names(), b.names());
  for (const std::string& n : a.names()) {
    if (tol == 0)
      EXPECT_TRUE(bytes_equal(a.tensor(n), b.tensor(n))) << n << " differs";
    else
      EXPECT_LE(rel_diff(a.tensor(n), b.tensor(n)), tol) << n;
  }
}

// The per-step losses of two runs' metrics.jsonl: equal (tol = 0) or within tol relative, on a
// scale of at least 1e-2: the capacity hinge near 0 (S(t) just above M) turns the last-bit
// differences of another summation order (2 ranks vs 1; how much depends on the CPU's BLAS
// kernels) into a large relative change of a tiny value (7e-9 on 5.9e-4 was seen on an EPYC).
// (The same change as main's 1c13106, made here where the function moved.)
inline void expect_same_losses(const std::string& run_a, const std::string& run_b, double tol) {
  const auto a = metrics(run_a), b = metrics(run_b);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    for (const char* f : {"step", "loss", "kl", "ntp", "cap", "grad_norm", "lr"}) {
      const double x = a[i].at(f).get<double>(), y = b[i].at(f).get<double>();
      EXPECT_LE(std::abs(x - y), tol * (tol == 0 ? 0.0 : std::max(std::abs(y), 1e-2)))
          << "step " << i + 1 << " " << f << ": " << x << " vs " << y;
    }
}

// The step named by RUN/checkpoints/latest, or -1.
inline int latest_step(const std::string& run_dir) {
  std::ifstream in(run_dir + "/checkpoints/latest");
  std::string name;
  if (!(in >> name) || name.rfind("step-", 0) != 0) return -1;
  return std::stoi(name.substr(5));
}

// Starts `command` through the shell without waiting; its output goes to `log` (both streams).
inline pid_t spawn(const std::string& command, const std::string& log = "/dev/null") {
  const pid_t pid = fork();
  if (pid == 0) {
    // As a login shell would start it: no signal blocked or ignored. (A test runner may block
    // signals, and children inherit that; mpirun and the ranks then handle none.)
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    for (int sig : {SIGINT, SIGQUIT, SIGTERM, SIGHUP, SIGPIPE}) signal(sig, SIG_DFL);
    execl("/bin/sh", "sh", "-c", ("exec " + command + " >" + log + " 2>&1").c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

// Waits until RUN/checkpoints/latest names step >= `step` (or the process ended); true if so.
inline bool wait_for_checkpoint(const std::string& run_dir, int step, pid_t pid) {
  for (int i = 0; i < 3000; ++i) {
    if (latest_step(run_dir) >= step) return true;
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// The processes whose parent is `parent` (mpirun's ranks on this host).
inline std::vector<pid_t> children(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(e.path() / "stat");
    std::string line;
    if (!std::getline(stat, line)) continue;
    // pid (comm) state ppid ...: comm may hold spaces, so parse after the last ')'.
    const size_t close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 1));
    std::string state;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent) out.push_back(static_cast<pid_t>(std::stoi(name)));
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace retain::trainer::test
