#include "kernels/base/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

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

void replace_directory(const std::string& built, const std::string& target, const std::string& what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(target, ec)) {
    fs::rename(built, target, ec);
    if (ec) fail("{}: cannot create: {}", what, ec.message());
    return;
  }
  const fs::path old = target + ".old." + std::to_string(::getpid());
  fs::rename(target, old, ec);
  if (ec) fail("{}: cannot replace: {}", what, ec.message());
  fs::rename(built, target, ec);
  if (ec) {
    std::error_code e2;
    fs::rename(old, target, e2);
    fail("{}: cannot replace: {}", what, ec.message());
  }
  fs::remove_all(old, ec);
}

void publish_file(const std::string& tmp, const std::string& path) {
  const int fd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
  const bool synced = fd >= 0 && ::fsync(fd) == 0;
  const int err = errno;
  if (fd >= 0) ::close(fd);
  if (!synced || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int why = synced ? errno : err;
    std::remove(tmp.c_str());
    fail("{}: cannot write: {}", path, std::strerror(why));
  }
}

void write_file_atomic(const std::string& path, std::string_view contents) {
  AtomicFile f(path);
  f.write(contents);
  f.commit();
}

namespace {

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

int open_regular_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail("{}: cannot read: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int err = errno;
    const bool stat_failed = !S_ISREG(st.st_mode) && st.st_mode == 0;
    ::close(fd);
    if (stat_failed) fail("{}: cannot read: {}", path, std::strerror(err));
    fail("{}: not a regular file ({})", path, kind_of(st.st_mode));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);  // a regular file: ordinary reads from here
  return fd;
}

void require_regular_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) fail("{}: cannot read: {}", path, std::strerror(errno));
  if (!S_ISREG(st.st_mode)) fail("{}: not a regular file ({})", path, kind_of(st.st_mode));
}

std::string read_file(const std::string& path, size_t max_bytes) {
  // POSIX reads in one loop, not an ifstream through a stringstream: the same bytes take the
  // same code path every time (the fuzz targets' coverage, and so CI's fuzzing, stays repeatable).
  const int fd = open_regular_file(path);
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
    if (out.size() > max_bytes) {
      ::close(fd);
      fail("{}: larger than {} MiB, the most this file is read up to", path, max_bytes >> 20);
    }
  }
  ::close(fd);
  return out;
}

}  // namespace retain
