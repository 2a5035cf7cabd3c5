// Files appear complete or not at all: write to "<path>.tmp.<pid>", fsync, rename over
// <path>. If the writer is destroyed before commit() (an exception, a bad input), the
// temporary is removed and nothing is left behind.
#pragma once
#include <cstdio>
#include <string>
#include <string_view>

namespace retain {

class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t bytes);
  void write(std::string_view s) { write(s.data(), s.size()); }
  // Flushes, fsyncs and renames onto the final path. Throws retain::Error on failure.
  void commit();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::string tmp_path_;
  std::FILE* f_ = nullptr;
  bool committed_ = false;
};

// Moves the folder `built` (complete, beside `target`) to `target`: renamed into place when
// target is absent; an existing target is renamed aside, the new one renamed in, and the old one
// removed — restored if the second rename fails. Errors name `what` (the user's spelling).
void replace_directory(const std::string& built, const std::string& target, const std::string& what);

// Whole-file helpers.
void write_file_atomic(const std::string& path, std::string_view contents);
// For a file a library wrote under a temporary name (a PNG from PLplot): fsyncs it and renames
// it onto `path`; on failure the temporary is removed and the error names `path`.
void publish_file(const std::string& tmp, const std::string& path);
// The bytes of a regular file (open_regular_file) of at most `max_bytes`; throws
// "PATH: cannot read: <reason>", or names the limit.
inline constexpr size_t kMaxReadFileBytes = size_t{1} << 30;
std::string read_file(const std::string& path, size_t max_bytes = kMaxReadFileBytes);

// Where a tool reads a file, the path must name a regular file (or a symlink to one): a FIFO
// would block the tool forever, a device (/dev/zero) never end, a directory is no file.
// open_regular_file returns an O_RDONLY | O_CLOEXEC descriptor of one (opened without blocking,
// then checked, so a FIFO cannot stall the open itself); require_regular_file checks a path that
// a library then opens by name (libzip, HDF5). Both throw "PATH: not a regular file (a FIFO)".
int open_regular_file(const std::string& path);
void require_regular_file(const std::string& path);

}  // namespace retain
