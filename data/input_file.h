// Reading corpus files record by record: JSON lines, or plain text (one document per line or
// per file). gzip is recognised by its magic bytes (zlib reads other files unchanged), so
// `corpus.jsonl.gz` and a gzip stream named `corpus.jsonl` both work.
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
  // read error or a truncated/corrupt gzip stream.
  bool next(InputRecord& record);

  bool is_json() const { return format_ == InputFormat::jsonl; }
  const std::filesystem::path& path() const { return path_; }
  uint64_t size_bytes() const { return size_; }
  // Bytes of the file consumed so far (compressed bytes for gzip): progress and ETA.
  uint64_t bytes_consumed() const;

 private:
  bool fill();  // reads more into buf_; false at the end
  bool next_line(std::string& out);

  std::filesystem::path path_;
  InputFormat format_;
  TxtMode txt_mode_;
  gzFile gz_ = nullptr;
  uint64_t size_ = 0;
  std::string buf_;
  size_t pos_ = 0;
  bool eof_ = false;
  int64_t line_ = 0;
};

}  // namespace retain::data
