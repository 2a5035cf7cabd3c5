// Reading corpus files record by record: JSON lines, or plain text (one document per line or
// per file). gzip is recognised by its magic bytes (other files are read unchanged), so
// `corpus.jsonl.gz` and a gzip stream named `corpus.jsonl` both work. A gzip file may hold
// several members (as `cat a.gz b.gz` makes) and zero padding after them; anything else after
// a member (a damaged next member, garbage) is an error, never silently dropped data. A UTF-8
// byte order mark at the very start of the decoded file is not part of the text.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>

#include <zlib.h>

namespace retain::data {

enum class InputFormat { automatic, jsonl, txt };  // automatic: by the name, less any ".gz"
enum class TxtMode { file, line };                 // a .txt file is one document, or one per line

// Resolves InputFormat::automatic: .jsonl/.json/.ndjson -> jsonl, .txt -> txt, else an error.
InputFormat resolve_format(const std::filesystem::path& path, InputFormat requested);

struct InputRecord {
  std::string text;  // one JSON line, one text line (without its newline), or a whole file
  int64_t line = 0;  // 1-based line number of the record in its file
};

class InputFile {
 public:
  InputFile(std::filesystem::path path, InputFormat format, TxtMode txt_mode);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  // The next record, false at the end of the file. Throws retain::Error naming the file on a
  // read error, a truncated/corrupt gzip stream or trailing garbage after it, and on a record
  // above the limits below (checked while reading, so a 4 MB gzip of 4 GiB without a newline
  // stops at the limit, not at the end of memory).
  bool next(InputRecord& record);

  // The longest JSON line or text line (64 MiB: a whole book is ~1 MiB, a training sequence
  // far less), and the longest text file read as one document (--txt-mode file).
  static constexpr size_t kMaxLineBytes = size_t{64} << 20;
  static constexpr size_t kMaxFileDocumentBytes = size_t{1} << 30;

  bool is_json() const { return format_ == InputFormat::jsonl; }
  const std::filesystem::path& path() const { return path_; }
  uint64_t size_bytes() const { return size_; }
  // Bytes of the file consumed so far (compressed bytes for gzip): progress and ETA.
  uint64_t bytes_consumed() const;

 private:
  bool fill();  // reads more into buf_; false at the end
  bool next_line(std::string& out);
  bool read_raw();                      // refills raw_ from the file; false at its end
  size_t decode(char* out, size_t cap);  // up to cap bytes of the (gunzipped) file; 0 at its end
  uint64_t raw_offset() const;          // bytes of the file consumed

  std::filesystem::path path_;
  InputFormat format_;
  TxtMode txt_mode_;
  int fd_ = -1;
  bool gzip_ = false;
  bool member_ended_ = false;  // gzip: between members
  z_stream z_{};               // gzip state; its next_in/avail_in also track raw_ for plain files
  std::string raw_;            // bytes read from the file, not yet consumed
  uint64_t raw_read_ = 0;      // bytes read from the file so far
  uint64_t size_ = 0;
  std::string buf_;
  size_t pos_ = 0;
  bool eof_ = false;
  bool started_ = false;  // the first decoded bytes were checked for a byte order mark
  int64_t line_ = 0;
};

}  // namespace retain::data
