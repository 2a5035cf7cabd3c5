// safetensors checkpoints: read (mmap, zero-copy, fully validated) and write (atomic).
//
// Format: an 8-byte little-endian u64 N, then N bytes of JSON header, then the data
// section. Each header key except "__metadata__" maps to
//   {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}
// with offsets relative to the data section. A file is accepted only if every entry is
// well formed and the entries, sorted by begin, tile the data section exactly (no gaps,
// overlaps or trailing bytes) -- the same rule as the reference Rust implementation --
// so that after open() every tensor() read is known to be in bounds.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/tensor.h"

namespace retain::formats {

struct SafetensorsEntry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;  // byte offsets relative to the data section
};

class SafetensorsFile {
 public:
  // Maps the file read-only (MAP_PRIVATE) and validates it; throws retain::Error "<path>: ...".
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  const SafetensorsEntry& entry(const std::string& name) const;  // throws "<path>: no tensor '<name>'"
  // A zero-copy view into the mapping (which it keeps alive). The mapping is read-only:
  // writing through the view faults, so clone() before modifying. Data that is not
  // aligned to its dtype size comes back as an owned, aligned copy instead.
  Tensor tensor(const std::string& name) const;

 private:
  struct Mapping;
  std::string path_;
  std::shared_ptr<Mapping> map_;
  const char* data_ = nullptr;  // start of the data section inside the mapping
  std::map<std::string, std::string> metadata_;
  std::map<std::string, SafetensorsEntry> entries_;
};

// Writes atomically (AtomicFile): the file appears complete or not at all. CPU tensors
// only; data is laid out contiguously in the order given and the header is padded with
// spaces so that 8 + N is a multiple of 8. "__metadata__" is written only if non-empty.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// A checkpoint directory holding either model.safetensors.index.json + shards (preferred
// when present) or a single model.safetensors.
// One tensor `name` [rows, ...] written `chunk_rows` rows at a time, never held whole (the
// logits of a long sequence: 128K × 151,936 F32 is 80 GB): fill(begin, end, rows) writes rows
// [begin, end) into `rows`, a CPU tensor of that many rows. Atomic like write_safetensors.
void write_safetensors_rows(const std::string& path, const std::string& name, DType dtype, const Shape& shape,
                            int64_t chunk_rows, const std::function<void(int64_t, int64_t, Tensor&)>& fill,
                            const std::map<std::string, std::string>& metadata = {});

class SafetensorsSet {
 public:
  static SafetensorsSet open_dir(const std::string& dir);

  const std::string& dir() const { return dir_; }
  std::vector<std::string> names() const;  // sorted, over all shards
  bool contains(const std::string& name) const { return owner_.count(name) != 0; }
  const SafetensorsEntry& entry(const std::string& name) const { return file(name).entry(name); }
  Tensor tensor(const std::string& name) const { return file(name).tensor(name); }
  const std::string& file_of(const std::string& name) const { return file(name).path(); }
  // The first shard's (in file-name order) or the only file's __metadata__.
  const std::map<std::string, std::string>& metadata() const;

 private:
  const SafetensorsFile& file(const std::string& name) const;  // throws "<dir>: no tensor '<name>'"
  std::string dir_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> owner_;  // tensor name -> index into files_
};

}  // namespace retain::formats
