#include "kernels/base/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

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
  // POSIX reads in one loop, not an ifstream through a stringstream: the same bytes take the
  // same code path every time (the fuzz targets' coverage, and so CI's fuzzing, stays repeatable).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot read: {}", path, std::strerror(errno));
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      fail("{}: read failed: {}", path, std::strerror(err));
    }
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

}  // namespace retain
