#include "data/formats/h5.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels/base/error.h"

namespace retain::formats::h5 {

void silence_hdf5_errors() {
  static std::once_flag once;
  std::call_once(once, [] { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); });
}

Handle checked(hid_t id, Handle::Closer close, const std::string& file, const std::string& what) {
  if (id < 0) fail("{}: HDF5: {} failed", file, what);
  return Handle(id, close);
}

void check(herr_t status, const std::string& file, const std::string& what) {
  if (status < 0) fail("{}: HDF5: {} failed", file, what);
}

namespace {

void write_scalar(hid_t obj, const char* name, hid_t file_type, hid_t mem_type, const void* value,
                  const std::string& file) {
  Handle space = checked(H5Screate(H5S_SCALAR), H5Sclose, file, "creating a scalar dataspace");
  Handle attr = checked(H5Acreate2(obj, name, file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose, file,
                        std::string("creating attribute ") + name);
  check(H5Awrite(attr.get(), mem_type, value), file, std::string("writing attribute ") + name);
}

Handle open_scalar_attr(hid_t obj, const char* name, const std::string& file) {
  if (H5Aexists(obj, name) <= 0) fail("{}: missing attribute '{}'", file, name);
  Handle attr = checked(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose, file, std::string("opening attribute ") + name);
  Handle space = checked(H5Aget_space(attr.get()), H5Sclose, file, "reading an attribute's dataspace");
  if (H5Sget_simple_extent_type(space.get()) != H5S_SCALAR &&
      !(H5Sget_simple_extent_ndims(space.get()) == 1 && H5Sget_simple_extent_npoints(space.get()) == 1))
    fail("{}: attribute '{}' is not a scalar", file, name);
  return attr;
}

}  // namespace

void write_attr_i64(hid_t obj, const char* name, int64_t value, const std::string& file) {
  write_scalar(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &value, file);
}

void write_attr_u64(hid_t obj, const char* name, uint64_t value, const std::string& file) {
  write_scalar(obj, name, H5T_STD_U64LE, H5T_NATIVE_UINT64, &value, file);
}

void write_attr_str(hid_t obj, const char* name, const std::string& value, const std::string& file) {
  // A variable-length UTF-8 string: h5py reads it as str.
  Handle type = checked(H5Tcopy(H5T_C_S1), H5Tclose, file, "creating a string type");
  check(H5Tset_size(type.get(), H5T_VARIABLE), file, "sizing a string type");
  check(H5Tset_cset(type.get(), H5T_CSET_UTF8), file, "setting a string charset");
  const char* p = value.c_str();
  write_scalar(obj, name, type.get(), type.get(), &p, file);
}

bool has_attr(hid_t obj, const char* name) { return H5Aexists(obj, name) > 0; }

int64_t read_attr_int(hid_t obj, const char* name, const std::string& file) {
  Handle attr = open_scalar_attr(obj, name, file);
  Handle type = checked(H5Aget_type(attr.get()), H5Tclose, file, "reading an attribute's type");
  if (H5Tget_class(type.get()) != H5T_INTEGER) fail("{}: attribute '{}' is not an integer", file, name);
  if (H5Tget_sign(type.get()) == H5T_SGN_NONE) {
    uint64_t v = 0;
    check(H5Aread(attr.get(), H5T_NATIVE_UINT64, &v), file, std::string("reading attribute ") + name);
    if (v > static_cast<uint64_t>(INT64_MAX)) fail("{}: attribute '{}' = {} is too large", file, name, v);
    return static_cast<int64_t>(v);
  }
  int64_t v = 0;
  check(H5Aread(attr.get(), H5T_NATIVE_INT64, &v), file, std::string("reading attribute ") + name);
  return v;
}

namespace {

std::atomic<double> g_deadline_seconds{30.0};

// The message of a guarded read that crashed, made before the read: the signal handler may
// only write it out.
char g_crash_line[1024];
size_t g_crash_len = 0;

extern "C" void on_crash_in_libhdf5(int) {
  (void)!::write(STDERR_FILENO, g_crash_line, g_crash_len);
  std::_Exit(1);
}

// A libhdf5 call on untrusted metadata (see set_read_deadline_seconds): ends the process with
// one line and exit status 1 if it has not returned by the deadline, or if it crashes inside
// libhdf5 (SIGSEGV/SIGBUS: libhdf5 1.10 trusts a string's heap reference, tests/fuzz). Only
// around the call itself, so a crash anywhere else stays a crash.
class GuardedRead {
 public:
  GuardedRead(std::string file, std::string what) : file_(std::move(file)), what_(std::move(what)) {
    const int n = std::snprintf(g_crash_line, sizeof g_crash_line, "%s: error: %s: %s crashed inside libhdf5: the file is damaged\n",
                                program_invocation_short_name, file_.c_str(), what_.c_str());
    g_crash_len = n < 0 ? 0 : std::min(static_cast<size_t>(n), sizeof g_crash_line - 1);
    struct sigaction sa {};
    sa.sa_handler = on_crash_in_libhdf5;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &old_segv_);
    sigaction(SIGBUS, &sa, &old_bus_);
    thread_ = std::thread([this] {
      const double seconds = g_deadline_seconds.load();
      std::unique_lock lock(mu_);
      if (cv_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return done_; })) return;
      std::fprintf(stderr, "%s: error: %s: %s did not finish in %g s: the file is damaged\n",
                   program_invocation_short_name, file_.c_str(), what_.c_str(), seconds);
      std::fflush(stderr);
      std::_Exit(1);
    });
  }
  ~GuardedRead() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_one();
    thread_.join();
    sigaction(SIGSEGV, &old_segv_, nullptr);
    sigaction(SIGBUS, &old_bus_, nullptr);
  }
  GuardedRead(const GuardedRead&) = delete;
  GuardedRead& operator=(const GuardedRead&) = delete;

 private:
  std::string file_, what_;
  struct sigaction old_segv_ {}, old_bus_ {};
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace

void set_read_deadline_seconds(double seconds) { g_deadline_seconds = seconds; }

std::string read_attr_str(hid_t obj, const char* name, const std::string& file) {
  Handle attr = open_scalar_attr(obj, name, file);
  Handle type = checked(H5Aget_type(attr.get()), H5Tclose, file, "reading an attribute's type");
  if (H5Tget_class(type.get()) != H5T_STRING) fail("{}: attribute '{}' is not a string", file, name);
  if (H5Tis_variable_str(type.get()) > 0) {
    Handle mem = checked(H5Tcopy(H5T_C_S1), H5Tclose, file, "creating a string type");
    check(H5Tset_size(mem.get(), H5T_VARIABLE), file, "sizing a string type");
    check(H5Tset_cset(mem.get(), H5Tget_cset(type.get())), file, "setting a string charset");
    char* p = nullptr;
    {
      const GuardedRead guard(file, std::string("reading attribute ") + name);  // the global heap
      check(H5Aread(attr.get(), mem.get(), &p), file, std::string("reading attribute ") + name);
    }
    std::string s = p ? p : "";
    if (p) H5free_memory(p);
    return s;
  }
  const size_t n = H5Tget_size(type.get());
  std::vector<char> buf(n + 1, '\0');
  check(H5Aread(attr.get(), type.get(), buf.data()), file, std::string("reading attribute ") + name);
  return std::string(buf.data());  // fixed-length strings may be NUL-padded
}

}  // namespace retain::formats::h5
