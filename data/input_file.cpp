#include "data/input_file.h"

#include <cctype>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>

#include "kernels/base/atomic_file.h"
#include "kernels/base/error.h"

namespace retain::data {

namespace {

constexpr size_t kReadChunk = 1 << 20;  // decoded bytes per fill()
constexpr size_t kRawChunk = 1 << 18;   // file bytes per read()

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
  fd_ = open_regular_file(path_.string());  // before anything that could block on a FIFO
  size_ = std::filesystem::file_size(path_, ec);
  if (ec) {
    ::close(fd_);
    fd_ = -1;
    fail("{}: cannot open: {}", path_.string(), ec.message());
  }
  try {
    raw_.resize(kRawChunk);
    read_raw();
    gzip_ = z_.avail_in >= 2 && z_.next_in[0] == 0x1f && z_.next_in[1] == 0x8b;
    if (gzip_ && inflateInit2(&z_, 16 + MAX_WBITS) != Z_OK) {  // 16: gzip wrapper only
      gzip_ = false;
      fail("{}: cannot start gzip decompression (out of memory)", path_.string());
    }
  } catch (...) {  // no destructor runs for a throwing constructor
    ::close(fd_);
    throw;
  }
}

InputFile::~InputFile() {
  if (gzip_) inflateEnd(&z_);
  if (fd_ >= 0) ::close(fd_);
}

uint64_t InputFile::raw_offset() const { return raw_read_ - z_.avail_in; }

uint64_t InputFile::bytes_consumed() const { return raw_offset(); }

bool InputFile::read_raw() {
  ssize_t n;
  do n = ::read(fd_, raw_.data(), raw_.size());
  while (n < 0 && errno == EINTR);
  if (n < 0) fail("{}: read error: {}", path_.string(), std::strerror(errno));
  z_.next_in = reinterpret_cast<Bytef*>(raw_.data());
  z_.avail_in = static_cast<uInt>(n);
  raw_read_ += static_cast<uint64_t>(n);
  return n > 0;
}

size_t InputFile::decode(char* out, size_t cap) {
  if (!gzip_) {
    if (z_.avail_in == 0 && !read_raw()) return 0;
    const size_t n = std::min<size_t>(cap, z_.avail_in);
    std::memcpy(out, z_.next_in, n);
    z_.next_in += n;
    z_.avail_in -= static_cast<uInt>(n);
    return n;
  }
  z_.next_out = reinterpret_cast<Bytef*>(out);
  z_.avail_out = static_cast<uInt>(cap);
  while (z_.avail_out > 0) {
    if (member_ended_) {
      // Between members: zero padding is allowed (as gzip and Python accept it); anything
      // else must start another member.
      for (;;) {
        while (z_.avail_in > 0 && *z_.next_in == 0) ++z_.next_in, --z_.avail_in;
        if (z_.avail_in > 0 || !read_raw()) break;
      }
      if (z_.avail_in == 0) break;  // the end of the file
      if (*z_.next_in != 0x1f)
        fail("{}: trailing garbage after the gzip data at byte {} (damaged file?)", path_.string(), raw_offset());
      if (inflateReset(&z_) != Z_OK) fail("{}: gzip: cannot reset the decompressor", path_.string());
      member_ended_ = false;
    }
    if (z_.avail_in == 0 && !read_raw())
      fail("{}: corrupt or truncated gzip data: the file ends inside a gzip stream", path_.string());
    const int r = inflate(&z_, Z_NO_FLUSH);
    if (r == Z_STREAM_END) {
      member_ended_ = true;
    } else if (r == Z_DATA_ERROR || r == Z_NEED_DICT) {
      fail("{}: corrupt gzip data near byte {}: {}", path_.string(), raw_offset(), z_.msg ? z_.msg : "invalid data");
    } else if (r == Z_MEM_ERROR) {
      fail("{}: gzip: out of memory", path_.string());
    } else if (r != Z_OK && !(r == Z_BUF_ERROR && z_.avail_in == 0)) {
      fail("{}: gzip: decompression failed ({})", path_.string(), r);
    }
  }
  return cap - z_.avail_out;
}

bool InputFile::fill() {
  if (eof_) return false;
  if (pos_ > 0) {
    buf_.erase(0, pos_);
    pos_ = 0;
  }
  const size_t old = buf_.size();
  buf_.resize(old + kReadChunk);
  const size_t n = decode(buf_.data() + old, kReadChunk);
  buf_.resize(old + n);
  if (!started_ && buf_.size() >= 3) {
    started_ = true;
    if (buf_.compare(0, 3, "\xEF\xBB\xBF") == 0) buf_.erase(0, 3);  // a byte order mark is not text
  }
  if (n == 0) {
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
    if (scanned > kMaxLineBytes)
      fail("{}:{}: a line longer than {} MiB (retain-pack's limit per record: split the document)", path_.string(),
           line_ + 1, kMaxLineBytes >> 20);
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
      if (buf_.size() - pos_ > kMaxFileDocumentBytes)
        fail("{}: a text document longer than {} MiB (retain-pack's limit for --txt-mode file: split the file, or "
             "use --txt-mode line)",
             path_.string(), kMaxFileDocumentBytes >> 20);
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
