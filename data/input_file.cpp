#include "data/input_file.h"

#include <cctype>
#include <cerrno>
#include <cstring>
#include <fcntl.h>

#include "kernels/base/error.h"

namespace retain::data {

namespace {

constexpr size_t kReadChunk = 1 << 20;

std::string lower_extension(std::filesystem::path p) {
  auto ext = [](const std::filesystem::path& q) {
    std::string e = q.extension().string();
    for (char& c : e) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return e;
  };
  if (ext(p) == ".gz") p = p.stem();
  return ext(p);
}

}  // namespace

InputFormat resolve_format(const std::filesystem::path& path, InputFormat requested) {
  if (requested != InputFormat::automatic) return requested;
  const std::string e = lower_extension(path);
  if (e == ".jsonl" || e == ".json" || e == ".ndjson") return InputFormat::jsonl;
  if (e == ".txt" || e == ".text") return InputFormat::txt;
  fail("{}: cannot tell the input format from the name (expected .jsonl, .json, .ndjson or .txt, optionally "
       "+ .gz); give --format jsonl|txt",
       path.string());
}

InputFile::InputFile(std::filesystem::path path, InputFormat format, TxtMode txt_mode)
    : path_(std::move(path)), format_(resolve_format(path_, format)), txt_mode_(txt_mode) {
  std::error_code ec;
  if (std::filesystem::is_directory(path_, ec)) fail("{}: is a directory, not an input file", path_.string());
  size_ = std::filesystem::file_size(path_, ec);
  if (ec) fail("{}: cannot open: {}", path_.string(), ec.message());
  errno = 0;
  gz_ = gzopen(path_.c_str(), "rb");
  if (!gz_) fail("{}: cannot open: {}", path_.string(), errno ? std::strerror(errno) : "out of memory");
  gzbuffer(gz_, 1 << 18);
}

InputFile::~InputFile() {
  if (gz_) gzclose_r(gz_);
}

uint64_t InputFile::bytes_consumed() const {
  const z_off_t off = gzoffset(gz_);
  return off < 0 ? 0 : static_cast<uint64_t>(off);
}

bool InputFile::fill() {
  if (eof_) return false;
  if (pos_ > 0) {
    buf_.erase(0, pos_);
    pos_ = 0;
  }
  const size_t old = buf_.size();
  buf_.resize(old + kReadChunk);
  const int n = gzread(gz_, buf_.data() + old, static_cast<unsigned>(kReadChunk));
  if (n < 0) {
    int err = 0;
    const char* msg = gzerror(gz_, &err);
    fail("{}: read error: {}", path_.string(), err == Z_ERRNO ? std::strerror(errno) : msg);
  }
  buf_.resize(old + static_cast<size_t>(n));
  if (n == 0) {
    // A gzip stream cut short reads as a clean end unless we ask.
    int err = Z_OK;
    const char* msg = gzerror(gz_, &err);
    if (err != Z_OK && err != Z_STREAM_END) fail("{}: corrupt or truncated gzip data: {}", path_.string(), msg);
    eof_ = true;
    return false;
  }
  return true;
}

bool InputFile::next_line(std::string& out) {
  size_t scan = pos_;
  for (;;) {
    const char* start = buf_.data() + scan;
    const void* nl = std::memchr(start, '\n', buf_.size() - scan);
    if (nl) {
      const size_t end = static_cast<size_t>(static_cast<const char*>(nl) - buf_.data());
      out.assign(buf_, pos_, end - pos_);
      pos_ = end + 1;
      break;
    }
    const size_t scanned = buf_.size() - pos_;
    if (!fill()) {
      if (pos_ >= buf_.size()) return false;
      out.assign(buf_, pos_, std::string::npos);  // a last line without a newline
      pos_ = buf_.size();
      break;
    }
    scan = pos_ + scanned;  // fill() moved the unread bytes to the front
  }
  if (!out.empty() && out.back() == '\r') out.pop_back();
  ++line_;
  return true;
}

bool InputFile::next(InputRecord& record) {
  if (format_ == InputFormat::txt && txt_mode_ == TxtMode::file) {
    if (line_ > 0) return false;
    while (fill()) {
    }
    record.text.assign(buf_, pos_, std::string::npos);
    pos_ = buf_.size();
    record.line = 1;
    line_ = 1;
    return true;
  }
  if (!next_line(record.text)) return false;
  record.line = line_;
  return true;
}

}  // namespace retain::data
