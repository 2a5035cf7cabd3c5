// An advisory lock (flock) on a run directory, held for the life of a run: a second retain-train
// into the same --out, or a --resume started while the run still goes, stops before it writes
// anything, with one line naming the holder's PID and host — instead of two runs interleaving
// their checkpoints and metrics.jsonl. The lock is a file beside the run directory,
// "<parent>/.<name>.lock" (the directory itself appears only after the first step), holding
// "PID HOST"; it is removed when the run ends, and a crashed holder's file is taken over (the
// kernel released its lock). Advisory: it stops retain's tools, not `rm -r`.
#pragma once
#include <string>

namespace retain {

class RunLock {
 public:
  // Takes the lock of `run_dir` or throws retain::Error "RUN_DIR: in use by another run (PID …
  // on HOST, since …); wait for it to end or choose another --out".
  static RunLock acquire(const std::string& run_dir);
  RunLock(RunLock&& other) noexcept;
  RunLock& operator=(RunLock&&) = delete;
  RunLock(const RunLock&) = delete;
  ~RunLock();

  const std::string& path() const { return path_; }
  static std::string lock_path(const std::string& run_dir);

 private:
  RunLock(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};

}  // namespace retain
