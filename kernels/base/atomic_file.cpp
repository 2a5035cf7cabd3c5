#include "kernels/base/atomic_file.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "kernels/base/error.h"
#include "kernels/base/fault.h"

namespace retain {

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  tmp_path_ = fmt::format("{}.tmp.{}", path_, ::getpid());
  f_ = std::fopen(tmp_path_.c_str(), "wb");
  if (!f_) fail("{}: cannot create: {}", path_, std::strerror(errno));
}

AtomicFile::~AtomicFile() {
  if (f_) std::fclose(f_);
  if (!committed_) std::remove(tmp_path_.c_str());
}

void AtomicFile::write(const void* data, size_t bytes) {
  RETAIN_CHECK(f_ && !committed_, "write after commit to {}", path_);
  if (bytes && fault::write_fails(path_)) fail("{}: write failed: {}", path_, std::strerror(ENOSPC));
  if (bytes && std::fwrite(data, 1, bytes, f_) != bytes) fail("{}: write failed: {}", path_, std::strerror(errno));
}

void AtomicFile::commit() {
  RETAIN_CHECK(f_ && !committed_, "double commit of {}", path_);
  bool ok = std::fflush(f_) == 0 && ::fsync(::fileno(f_)) == 0;
  ok = (std::fclose(f_) == 0) && ok;
  f_ = nullptr;
  if (!ok) fail("{}: write failed: {}", path_, std::strerror(errno));
  if (std::rename(tmp_path_.c_str(), path_.c_str()) != 0)
    fail("{}: cannot rename temporary file into place: {}", path_, std::strerror(errno));
  committed_ = true;
}

void write_file_atomic(const std::string& path, std::string_view contents) {
  AtomicFile f(path);
  f.write(contents);
  f.commit();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot read: {}", path, std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) fail("{}: read failed", path);
  return ss.str();
}

}  // namespace retain
