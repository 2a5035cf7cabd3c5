// Small RAII layer over the HDF5 C API, shared by the packed-dataset writer and reader. Every
// call is checked; failures become retain::Error naming the file. HDF5's own error-stack
// printing is switched off (silence_hdf5_errors) so users see one line, ours.
#pragma once
#include <hdf5.h>

#include <cstdint>
#include <string>
#include <utility>

namespace retain::formats::h5 {

// Turns off HDF5's automatic printing of its error stack (once per process).
void silence_hdf5_errors();

// An owned hid_t closed by the matching H5?close.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, Closer close) : id_(id), close_(close) {}
  Handle(Handle&& o) noexcept : id_(std::exchange(o.id_, H5I_INVALID_HID)), close_(o.close_) {}
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = std::exchange(o.id_, H5I_INVALID_HID);
      close_ = o.close_;
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { reset(); }

  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  // Closes now, reporting failure (a file close is where buffered data reaches the disk).
  bool close() {
    if (id_ < 0) return true;
    const herr_t r = close_(id_);
    id_ = H5I_INVALID_HID;
    return r >= 0;
  }
  void reset() { (void)close(); }

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer close_ = nullptr;
};

// Wraps a freshly created/opened id, failing with "<file>: <what> failed" when it is negative.
Handle checked(hid_t id, Handle::Closer close, const std::string& file, const std::string& what);
void check(herr_t status, const std::string& file, const std::string& what);

// libhdf5 (1.10, as Debian ships it) can loop forever, or crash, on a damaged global heap,
// the store of variable-length strings (found by tests/fuzz; regressions/packed_dataset).
// Reads that go there are guarded: past a deadline, or on SIGSEGV/SIGBUS inside the read, the
// process ends with exit status 1 and one line "<tool>: error: <file>: <what> did not finish
// in N s: the file is damaged" (or "crashed inside libhdf5"), since a thread stuck inside
// libhdf5 can be neither interrupted nor left running while the library is used, and a crashed
// one leaves it in no usable state. The deadline is 30 s by default; tests shorten it.
void set_read_deadline_seconds(double seconds);

// Scalar attributes on an object (a file or a dataset).
void write_attr_i64(hid_t obj, const char* name, int64_t value, const std::string& file);
void write_attr_u64(hid_t obj, const char* name, uint64_t value, const std::string& file);
void write_attr_str(hid_t obj, const char* name, const std::string& value, const std::string& file);
bool has_attr(hid_t obj, const char* name);
// Reads an integer attribute of any integer type; fails naming the file and attribute when it is
// missing, not an integer or not a scalar.
int64_t read_attr_int(hid_t obj, const char* name, const std::string& file);
std::string read_attr_str(hid_t obj, const char* name, const std::string& file);

}  // namespace retain::formats::h5
