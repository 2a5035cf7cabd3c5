#include "data/packer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>

#include "data/packed_writer.h"
#include "data/shuffle.h"
#include "kernels/base/atomic_file.h"
#include "kernels/base/error.h"

namespace retain::data {

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

// Tokenized documents on disk, in document-id order: per document its ids (int32) then its
// target mask (uint8), padded to 4 bytes. Read back through a read-only memory map, so the
// page cache, not the heap, holds the corpus. Removed when destroyed.
class SpillFile {
 public:
  explicit SpillFile(std::filesystem::path path) : path_(std::move(path)) {
    f_ = std::fopen(path_.c_str(), "wb");
    if (!f_) fail("{}: cannot create the temporary spill file: {}", path_.string(), std::strerror(errno));
    std::setvbuf(f_, nullptr, _IOFBF, 1 << 20);
  }
  ~SpillFile() {
    if (map_) ::munmap(map_, bytes_);
    if (f_) std::fclose(f_);
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
  SpillFile(const SpillFile&) = delete;
  SpillFile& operator=(const SpillFile&) = delete;

  void add(const Document& d) {
    offsets_.push_back(bytes_);
    lengths_.push_back(static_cast<int64_t>(d.ids.size()));
    write(d.ids.data(), d.ids.size() * sizeof(int32_t));
    write(d.target_mask.data(), d.target_mask.size());
    static const char zeros[4] = {};
    write(zeros, (4 - d.target_mask.size() % 4) % 4);
  }

  // Ends writing; documents become readable.
  void seal() {
    if (std::fflush(f_) != 0 || std::fclose(f_) != 0) {
      f_ = nullptr;
      fail("{}: writing the temporary spill file failed: {}", path_.string(), std::strerror(errno));
    }
    f_ = nullptr;
    if (bytes_ == 0) return;
    const int fd = ::open(path_.c_str(), O_RDONLY);
    if (fd < 0) fail("{}: cannot reopen the spill file: {}", path_.string(), std::strerror(errno));
    void* m = ::mmap(nullptr, bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    if (m == MAP_FAILED) fail("{}: cannot map the spill file: {}", path_.string(), std::strerror(errno));
    map_ = static_cast<char*>(m);
    ::madvise(map_, bytes_, MADV_SEQUENTIAL);
  }

  int64_t size() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t length(int64_t d) const { return lengths_[static_cast<size_t>(d)]; }
  const int32_t* ids(int64_t d) const { return reinterpret_cast<const int32_t*>(map_ + offsets_[static_cast<size_t>(d)]); }
  const uint8_t* mask(int64_t d) const {
    return reinterpret_cast<const uint8_t*>(map_ + offsets_[static_cast<size_t>(d)]) + 4 * length(d);
  }

 private:
  void write(const void* p, size_t n) {
    if (n == 0) return;
    if (std::fwrite(p, 1, n, f_) != n)
      fail("{}: writing the temporary spill file failed: {}", path_.string(), std::strerror(errno));
    bytes_ += n;
  }

  std::filesystem::path path_;
  std::FILE* f_ = nullptr;
  char* map_ = nullptr;
  uint64_t bytes_ = 0;
  std::vector<uint64_t> offsets_;
  std::vector<int64_t> lengths_;
};

void check_interrupt(const PackOptions& opt) {
  if (opt.interrupted && opt.interrupted->load()) fail("{}: interrupted; nothing written", opt.out.string());
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A run of consecutive records of one file, parsed by one worker.
struct Chunk {
  int64_t seq = 0;
  size_t file = 0;
  bool json = true;
  uint64_t bytes_read = 0;  // of all inputs, when the chunk was read (progress)
  std::vector<InputRecord> records;
  std::vector<ParsedRecord> results;
};

// Worker threads parse and tokenize chunks while the caller reads ahead; the caller takes the
// results back strictly in submission order, so nothing downstream depends on the thread count
// or on scheduling. At most `max_in_flight` chunks are queued or done-but-untaken (bounded
// memory). Destruction stops the workers after their current chunk.
class ParallelParser {
 public:
  ParallelParser(int threads, std::function<void(Chunk&)> work) : work_(std::move(work)) {
    try {
      for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { loop(); });
    } catch (const std::system_error& e) {  // the system refused a thread: stop the ones started
      const size_t started = workers_.size();
      stop_and_join();
      fail("cannot start {} tokenizer threads (the system refused the {}th: {}); use fewer --threads", threads,
           started + 1, e.what());
    }
  }
  ~ParallelParser() { stop_and_join(); }
  ParallelParser(const ParallelParser&) = delete;
  ParallelParser& operator=(const ParallelParser&) = delete;

  int64_t in_flight() const { return submitted_ - taken_; }
  void submit(std::unique_ptr<Chunk> c) {
    c->seq = submitted_++;
    {
      std::lock_guard<std::mutex> lock(m_);
      todo_.push_back(std::move(c));
    }
    work_cv_.notify_one();
  }
  // The next chunk in submission order: waits for it when `wait`, else null if not done yet.
  std::unique_ptr<Chunk> take(bool wait) {
    if (taken_ == submitted_) return nullptr;
    std::unique_lock<std::mutex> lock(m_);
    if (wait) done_cv_.wait(lock, [&] { return done_.count(taken_) > 0; });
    auto it = done_.find(taken_);
    if (it == done_.end()) return nullptr;
    std::unique_ptr<Chunk> c = std::move(it->second);
    done_.erase(it);
    ++taken_;
    return c;
  }

 private:
  void stop_and_join() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_)
      if (t.joinable()) t.join();
  }
  void loop() {
    for (;;) {
      std::unique_ptr<Chunk> c;
      {
        std::unique_lock<std::mutex> lock(m_);
        work_cv_.wait(lock, [&] { return stop_ || !todo_.empty(); });
        if (stop_) return;
        c = std::move(todo_.front());
        todo_.pop_front();
      }
      work_(*c);
      {
        std::lock_guard<std::mutex> lock(m_);
        const int64_t seq = c->seq;
        done_.emplace(seq, std::move(c));
      }
      done_cv_.notify_all();
    }
  }

  std::function<void(Chunk&)> work_;
  std::mutex m_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::unique_ptr<Chunk>> todo_;
  std::map<int64_t, std::unique_ptr<Chunk>> done_;
  bool stop_ = false;
  int64_t submitted_ = 0, taken_ = 0;  // touched by the caller only
  std::vector<std::thread> workers_;
};

// Phase 1: every input, in order, tokenized on opt.threads workers; documents spilled in input
// order, so document ids (their spill index) do not depend on the thread count.
void tokenize_inputs(const Tokenizer& tok, const PackOptions& opt, SpillFile& spill, PackSummary& sum,
                     Clock::time_point t0) {
  uint64_t total_bytes = 0;
  for (const auto& p : opt.inputs) {
    std::error_code ec;
    if (std::filesystem::exists(p, ec) && !std::filesystem::is_directory(p, ec))
      require_regular_file(p.string());  // a FIFO or device: one line naming it, before any work
    const auto n = std::filesystem::file_size(p, ec);
    if (ec) fail("{}: cannot open: {}", p.string(), ec.message());
    (void)resolve_format(p, opt.format);  // a bad name fails before any work
    total_bytes += n;
  }
  DocumentOptions dopt;
  dopt.targets = opt.targets;
  dopt.eos_id = opt.eos_id;
  dopt.vocab_size = tok.vocab_size();
  const ChatTokens chat = ChatTokens::of(tok);

  ParallelParser parser(opt.threads, [&](Chunk& c) {
    c.results.resize(c.records.size());
    for (size_t i = 0; i < c.records.size(); ++i) {
      try {
        c.results[i] = c.json ? parse_json_record(c.records[i].text, tok, chat, dopt)
                              : parse_text_record(c.records[i].text, tok, dopt);
      } catch (const std::bad_alloc&) {
        c.results[i].status = ParsedRecord::Status::error;
        c.results[i].error = fmt::format("out of memory while tokenizing this record of {} bytes", c.records[i].text.size());
      } catch (const std::exception& e) {
        c.results[i].status = ParsedRecord::Status::error;
        c.results[i].error = e.what();
      }
      c.records[i].text = std::string();  // free the text early
    }
  });

  int warnings = 0;
  double last_report = -1;
  auto consume = [&](Chunk& c) {
    const fs::path& file = opt.inputs[c.file];
    for (size_t i = 0; i < c.results.size(); ++i) {
      ParsedRecord& r = c.results[i];
      const auto where = [&] {
        return opt.txt_mode == TxtMode::file && !c.json ? file.string()
                                                        : fmt::format("{}:{}", file.string(), c.records[i].line);
      };
      switch (r.status) {
        case ParsedRecord::Status::document:
          if (sum.documents >= INT32_MAX) fail("{}: more than {} documents; doc ids are int32", where(), INT32_MAX);
          spill.add(r.doc);
          ++sum.documents;
          sum.tokens += static_cast<int64_t>(r.doc.ids.size());
          break;
        case ParsedRecord::Status::blank: ++sum.blank_lines; break;
        case ParsedRecord::Status::empty: ++sum.empty_documents; break;
        case ParsedRecord::Status::invalid_utf8:
        case ParsedRecord::Status::error: {
          const std::string msg = r.status == ParsedRecord::Status::error ? r.error : "invalid UTF-8";
          if (!opt.skip_bad) fail("{}: {}", where(), msg);
          if (r.status == ParsedRecord::Status::invalid_utf8) ++sum.invalid_utf8;
          else ++sum.bad_records;
          if (opt.warn && warnings < 20)
            opt.warn(fmt::format("{}: {} (skipped{})", where(), msg, ++warnings == 20 ? "; no more warnings" : ""));
          break;
        }
      }
    }
    const double now = seconds_since(t0);
    if (opt.progress && now - last_report >= 0.1) {
      last_report = now;
      PackProgress p;
      // Bytes read run ahead of the records parsed: only the report after the last chunk says 100%.
      p.total = total_bytes;
      p.done = std::min(c.bytes_read, total_bytes > 0 ? total_bytes - 1 : 0);
      p.documents = sum.documents;
      p.tokens = sum.tokens;
      p.seconds = now;
      opt.progress(p);
    }
    check_interrupt(opt);
  };

  // Chunks of up to 256 KiB or 64 records: small enough to balance the workers, big enough that
  // the queue is not the bottleneck.
  constexpr size_t kChunkBytes = 256u << 10, kChunkRecords = 64;
  const int64_t max_in_flight = 8 * static_cast<int64_t>(opt.threads) + 8;
  uint64_t bytes_before_file = 0;
  for (size_t fi = 0; fi < opt.inputs.size(); ++fi) {
    InputFile in(opt.inputs[fi], opt.format, opt.txt_mode);
    bool more = true;
    while (more) {
      auto c = std::make_unique<Chunk>();
      c->file = fi;
      c->json = in.is_json();
      size_t bytes = 0;
      while (bytes < kChunkBytes && c->records.size() < kChunkRecords) {
        InputRecord r;
        if (!in.next(r)) {
          more = false;
          break;
        }
        bytes += r.text.size();
        c->records.push_back(std::move(r));
      }
      c->bytes_read = bytes_before_file + in.bytes_consumed();
      if (!c->records.empty()) parser.submit(std::move(c));
      while (auto done = parser.take(parser.in_flight() >= max_in_flight)) consume(*done);
    }
    bytes_before_file += in.size_bytes();
  }
  while (auto done = parser.take(true)) consume(*done);
  if (opt.progress) {  // the last chunk's report may have been rate-limited away: end at 100%
    PackProgress p;
    p.done = p.total = total_bytes;
    p.documents = sum.documents;
    p.tokens = sum.tokens;
    p.seconds = seconds_since(t0);
    opt.progress(p);
  }
}

// Accumulates rows and hands them to the writer in blocks of about 32 MiB.
class RowSink {
 public:
  RowSink(PackedWriter& w, int64_t seq_len, int32_t pad_id)
      : w_(w), S_(seq_len), pad_id_(pad_id),
        block_(std::max<int64_t>(1, std::min<int64_t>(1024, (32 << 20) / (9 * seq_len)))) {
    ids_.resize(static_cast<size_t>(block_ * S_));
    docs_.resize(ids_.size());
    mask_.resize(ids_.size());
  }
  // Copies n tokens of document `doc` into the current row at column `col`.
  void put(int64_t col, int32_t doc, const int32_t* ids, const uint8_t* mask, int64_t n) {
    const size_t at = static_cast<size_t>(row_ * S_ + col);
    std::memcpy(&ids_[at], ids, static_cast<size_t>(n) * 4);
    std::memcpy(&mask_[at], mask, static_cast<size_t>(n));
    std::fill_n(&docs_[at], n, doc);
  }
  // Pads the current row from `col`, then moves to the next row. Returns the padding count.
  int64_t end_row(int64_t col) {
    const size_t at = static_cast<size_t>(row_ * S_ + col);
    const auto n = static_cast<size_t>(S_ - col);
    std::fill_n(&ids_[at], n, pad_id_);
    std::fill_n(&docs_[at], n, -1);
    std::fill_n(&mask_[at], n, uint8_t{0});
    if (++row_ == block_) flush();
    return S_ - col;
  }
  void flush() {
    w_.append(ids_.data(), docs_.data(), mask_.data(), row_);
    row_ = 0;
  }

 private:
  PackedWriter& w_;
  int64_t S_;
  int32_t pad_id_;
  int64_t block_, row_ = 0;
  std::vector<int32_t> ids_, docs_;
  std::vector<uint8_t> mask_;
};

void report_pack(const PackOptions& opt, const PackSummary& sum, int64_t rows, int64_t total_rows,
                 Clock::time_point t0) {
  if (!opt.progress) return;
  PackProgress p;
  p.phase = "pack";
  p.done = static_cast<uint64_t>(rows);
  p.total = static_cast<uint64_t>(total_rows);
  p.documents = sum.documents;
  p.tokens = sum.tokens;
  p.seconds = seconds_since(t0);
  opt.progress(p);
}

// concat: documents in order, cut at every S tokens; a cut document continues (same doc id) at
// the start of the next sequence; the last sequence is padded.
void pack_concat(const SpillFile& spill, const std::vector<int64_t>& order, const PackOptions& opt, RowSink& sink,
                 PackSummary& sum, Clock::time_point t0) {
  const int64_t S = opt.seq_len;
  const int64_t total_rows = (sum.tokens + S - 1) / S;
  int64_t col = 0, rows = 0;
  for (const int64_t d : order) {
    const int64_t len = spill.length(d);
    const int32_t* ids = spill.ids(d);
    const uint8_t* mask = spill.mask(d);
    if (col + len > S) ++sum.split_documents;
    for (int64_t done = 0; done < len;) {
      const int64_t n = std::min(len - done, S - col);
      sink.put(col, static_cast<int32_t>(d), ids + done, mask + done, n);
      done += n;
      col += n;
      if (col == S) {
        sink.end_row(col);
        col = 0;
        if (++rows % 256 == 0) {
          check_interrupt(opt);
          report_pack(opt, sum, rows, total_rows, t0);
        }
      }
    }
  }
  if (col > 0) {
    sum.padding_tokens += sink.end_row(col);
    ++rows;
  }
  sum.sequences = rows;
}

// bfd: pieces (a document longer than S is cut into S-token pieces and a remainder; any other
// document is one piece) sorted by length, longest first, ties in document order (the seeded
// shuffle or input order); each goes into the open sequence with the least room that fits it
// (lowest sequence index among equals), or a new one. Sequences are written in creation order.
void pack_bfd(const SpillFile& spill, const std::vector<int64_t>& order, const PackOptions& opt, RowSink& sink,
              PackSummary& sum, Clock::time_point t0) {
  const int64_t S = opt.seq_len;
  struct Piece {
    int64_t len, rank, doc, offset;
  };
  std::vector<Piece> pieces;
  pieces.reserve(order.size());
  for (size_t r = 0; r < order.size(); ++r) {
    const int64_t d = order[r];
    const int64_t len = spill.length(d);
    if (len > S) ++sum.split_documents;
    for (int64_t off = 0; off < len; off += S)
      pieces.push_back({std::min(S, len - off), static_cast<int64_t>(r), d, off});
  }
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
    if (a.len != b.len) return a.len > b.len;
    if (a.rank != b.rank) return a.rank < b.rank;
    return a.offset < b.offset;
  });
  std::vector<int64_t> bin_of(pieces.size());
  std::vector<int64_t> bin_size;  // pieces per bin
  std::set<std::pair<int64_t, int64_t>> open;  // (room left, bin)
  for (size_t i = 0; i < pieces.size(); ++i) {
    const int64_t len = pieces[i].len;
    auto it = open.lower_bound({len, INT64_MIN});
    int64_t bin, room;
    if (it == open.end()) {
      bin = static_cast<int64_t>(bin_size.size());
      bin_size.push_back(0);
      room = S - len;
    } else {
      bin = it->second;
      room = it->first - len;
      open.erase(it);
    }
    if (room > 0) open.insert({room, bin});
    bin_of[i] = bin;
    ++bin_size[static_cast<size_t>(bin)];
  }
  check_interrupt(opt);
  // Group pieces by bin, keeping their placement order (a counting sort).
  std::vector<int64_t> start(bin_size.size() + 1, 0);
  for (size_t b = 0; b < bin_size.size(); ++b) start[b + 1] = start[b] + bin_size[b];
  std::vector<int64_t> by_bin(pieces.size());
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (size_t i = 0; i < pieces.size(); ++i) by_bin[static_cast<size_t>(next[static_cast<size_t>(bin_of[i])]++)] = static_cast<int64_t>(i);
  }
  const auto total_rows = static_cast<int64_t>(bin_size.size());
  for (int64_t b = 0; b < total_rows; ++b) {
    int64_t col = 0;
    for (int64_t k = start[static_cast<size_t>(b)]; k < start[static_cast<size_t>(b) + 1]; ++k) {
      const Piece& p = pieces[static_cast<size_t>(by_bin[static_cast<size_t>(k)])];
      sink.put(col, static_cast<int32_t>(p.doc), spill.ids(p.doc) + p.offset, spill.mask(p.doc) + p.offset, p.len);
      col += p.len;
    }
    sum.padding_tokens += sink.end_row(col);
    if ((b + 1) % 256 == 0) {
      check_interrupt(opt);
      report_pack(opt, sum, b + 1, total_rows, t0);
    }
  }
  sum.sequences = total_rows;
}

}  // namespace

int32_t resolve_separator(const Tokenizer& tok, const std::string& eos_token, const std::optional<ModelEos>& model_eos) {
  if (!eos_token.empty()) {
    auto id = tok.token_to_id(eos_token);
    if (!id) fail("{}: --eos-token '{}' is not a token of this tokenizer", tok.file().string(), eos_token);
    return *id;
  }
  if (auto id = tok.token_to_id("<|endoftext|>")) return *id;
  if (model_eos) {
    if (!model_eos->id) fail("{}: has no eos_token_id; give --eos-token", model_eos->source);
    if (*model_eos->id < 0 || *model_eos->id >= tok.vocab_size())
      fail("{}: eos_token_id {} is outside the tokenizer's vocabulary [0, {})", model_eos->source, *model_eos->id,
           tok.vocab_size());
    return static_cast<int32_t>(*model_eos->id);
  }
  fail("{}: has no <|endoftext|> token; give --eos-token TOKEN or --model DIR (its eos_token_id)",
       tok.file().string());
}

PackSummary pack(const Tokenizer& tok, const PackOptions& opt) {
  if (opt.seq_len < 2) fail("--seq-len must be at least 2, got {}", opt.seq_len);
  if (opt.inputs.empty()) fail("no input files given");
  if (opt.eos_id < 0 || opt.eos_id >= tok.vocab_size())
    fail("separator id {} is outside the vocabulary [0, {})", opt.eos_id, tok.vocab_size());
  const auto t0 = Clock::now();
  PackSummary sum;
  // The output replaces no file the run reads (the rename at the end would destroy it).
  std::error_code ec;
  if (std::filesystem::exists(opt.out, ec)) {
    auto same = [&](const std::filesystem::path& p) {
      std::error_code e;
      return std::filesystem::equivalent(opt.out, p, e);
    };
    for (const auto& in : opt.inputs)
      if (same(in)) fail("{}: is also an input ({}); writing it would destroy the input", opt.out.string(), in.string());
    if (same(tok.file())) fail("{}: is the tokenizer file; writing it would destroy it", opt.out.string());
  }
  // The writer first: an unwritable output fails before the tokenization work.
  PackedWriter writer(opt.out, opt.seq_len, opt.compression_level);
  std::filesystem::path spill_path = opt.out;
  spill_path += ".spill." + std::to_string(::getpid());
  SpillFile spill(spill_path);
  tokenize_inputs(tok, opt, spill, sum, t0);
  spill.seal();
  sum.tokenize_seconds = seconds_since(t0);
  if (sum.documents == 0) fail("{}: the inputs hold no documents; nothing written", opt.out.string());

  const std::vector<int64_t> order = opt.order == DocOrder::shuffle
                                         ? seeded_permutation(sum.documents, opt.seed)
                                         : [&] {
                                             std::vector<int64_t> v(static_cast<size_t>(sum.documents));
                                             std::iota(v.begin(), v.end(), int64_t{0});
                                             return v;
                                           }();
  RowSink sink(writer, opt.seq_len, opt.eos_id);
  if (opt.packing == Packing::concat) pack_concat(spill, order, opt, sink, sum, t0);
  else pack_bfd(spill, order, opt, sink, sum, t0);
  sink.flush();
  report_pack(opt, sum, sum.sequences, sum.sequences, t0);
  check_interrupt(opt);

  PackedAttributes a;
  a.seq_len = opt.seq_len;
  a.vocab_size = tok.vocab_size();
  a.eos_token_id = opt.eos_id;
  a.pad_token_id = opt.eos_id;
  a.tokenizer_sha256 = tok.sha256();
  a.packing = opt.packing == Packing::concat ? "concat" : "bfd";
  a.order = opt.order == DocOrder::shuffle ? "shuffle" : "input";
  a.targets = opt.targets == Targets::all ? "all" : "assistant";
  a.seed = opt.seed;
  a.num_documents = sum.documents;
  a.num_tokens = sum.tokens;
  a.padding_tokens = sum.padding_tokens;
  a.split_documents = sum.split_documents;
  a.created_by = opt.created_by;
  writer.commit(a);
  sum.total_seconds = seconds_since(t0);
  return sum;
}

}  // namespace retain::data
