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

// Whole-file helpers.
void write_file_atomic(const std::string& path, std::string_view contents);
std::string read_file(const std::string& path);  // throws "PATH: cannot read: <reason>"

}  // namespace retain
