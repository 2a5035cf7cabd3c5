#include "kernels/base/run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "kernels/base/error.h"

namespace retain {

std::string RunLock::lock_path(const std::string& run_dir) {
  const std::filesystem::path p = std::filesystem::absolute(run_dir).lexically_normal();
  const std::filesystem::path dir = p.filename().empty() ? p.parent_path() : p;  // "runs/a/" names a
  return (dir.parent_path() / fmt::format(".{}.lock", dir.filename().string())).string();
}

RunLock RunLock::acquire(const std::string& run_dir) {
  const std::string path = lock_path(run_dir);
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) fail("{}: cannot create the run's lock file {}: {}", run_dir, path, std::strerror(errno));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      char holder[256] = {};
      const ssize_t n = ::pread(fd, holder, sizeof holder - 1, 0);
      ::close(fd);
      if (err != EWOULDBLOCK) fail("{}: cannot lock {}: {}", run_dir, path, std::strerror(err));
      const std::string_view text(holder, n > 0 ? static_cast<size_t>(n) : 0);
      const size_t space = text.find(' '), end = text.find('\n');
      const std::string who =
          space == std::string_view::npos
              ? fmt::format("its lock file {} is held", path)
              : fmt::format("PID {} on {}", text.substr(0, space), text.substr(space + 1, end == std::string_view::npos ? std::string_view::npos : end - space - 1));
      fail("{}: in use by another run ({}); wait for it to end or choose another --out", run_dir, who);
    }
    // The holder before us may have removed the file after we opened it: our lock would then be
    // on a file nobody else sees. Only a lock on the file at `path` counts.
    struct stat mine {}, there {};
    if (::fstat(fd, &mine) == 0 && ::stat(path.c_str(), &there) == 0 && mine.st_ino == there.st_ino &&
        mine.st_dev == there.st_dev) {
      char host[256] = {};
      ::gethostname(host, sizeof host - 1);
      const std::string text = fmt::format("{} {}\n", ::getpid(), host);
      if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size()))
        fail("{}: cannot write the run's lock file {}: {}", run_dir, path, std::strerror(errno));
      return RunLock(fd, path);
    }
    ::close(fd);
  }
  fail("{}: cannot take the run's lock file {} (it keeps being replaced)", run_dir, path);
}

RunLock::RunLock(RunLock&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) { other.fd_ = -1; }

RunLock::~RunLock() {
  if (fd_ < 0) return;
  ::unlink(path_.c_str());  // while still held: a waiting run then creates a fresh file
  ::close(fd_);
}

}  // namespace retain
