#include "data/formats/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <string_view>

#include <nlohmann/json.hpp>

#include "kernels/base/atomic_file.h"
#include "kernels/base/error.h"

namespace retain::formats {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// The reference implementation's limit; also keeps a corrupt length from making us
// parse (or allocate for) gigabytes of "header".
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Explicit little-endian (de)coding, whatever the host byte order.
uint64_t load_le64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

std::string store_le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

uint64_t get_u64(const json& v) { return v.get<uint64_t>(); }

[[noreturn]] void bad_entry(const std::string& path, const std::string& name, std::string_view what) {
  fail("{}: tensor '{}': {}", path, printable(name), what);
}

// Validates one header entry on its own (bounds against the data section included);
// the tiling of all entries together is checked by the caller.
SafetensorsEntry parse_entry(const std::string& path, const std::string& name, const json& v,
                             uint64_t data_size) {
  auto bad = [&](std::string_view what) { bad_entry(path, name, what); };
  if (!v.is_object()) bad("entry is not a JSON object");
  SafetensorsEntry e{name, DType::F32, {}, 0, 0};

  auto dt = v.find("dtype");
  if (dt == v.end() || !dt->is_string()) bad("missing or non-string 'dtype'");
  auto dtype = dtype_from_name(dt->get_ref<const std::string&>());
  if (!dtype) bad(fmt::format("unknown dtype '{}'", printable(dt->get_ref<const std::string&>())));
  e.dtype = *dtype;

  auto sh = v.find("shape");
  if (sh == v.end() || !sh->is_array()) bad("missing or non-array 'shape'");
  for (size_t i = 0; i < sh->size(); ++i) {
    const json& d = (*sh)[i];
    if (!d.is_number_integer()) bad(fmt::format("shape dimension {} is not an integer", i));
    if (!d.is_number_unsigned() && d.get<int64_t>() < 0) bad(fmt::format("shape dimension {} is negative", i));
    if (get_u64(d) > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      bad(fmt::format("shape dimension {} is too large for int64", i));
    e.shape.push_back(d.get<int64_t>());
  }
  // shape_numel is what Tensor uses, so whatever passes here also passes there.
  int64_t numel = 0;
  try {
    numel = shape_numel(e.shape);
  } catch (const Error& err) {
    bad(err.what());
  }
  uint64_t elem = dtype_size(e.dtype);
  if (static_cast<uint64_t>(numel) > std::numeric_limits<uint64_t>::max() / elem)
    bad(fmt::format("shape {} x {} bytes overflows", shape_str(e.shape), elem));
  uint64_t nbytes = static_cast<uint64_t>(numel) * elem;

  auto off = v.find("data_offsets");
  if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
      !(*off)[1].is_number_unsigned())
    bad("'data_offsets' must be an array of two non-negative integers");
  e.begin = get_u64((*off)[0]);
  e.end = get_u64((*off)[1]);
  if (e.begin > e.end) bad(fmt::format("data_offsets [{}, {}] has begin > end", e.begin, e.end));
  if (e.end > data_size)
    bad(fmt::format("data_offsets [{}, {}] end beyond the {}-byte data section", e.begin, e.end, data_size));
  if (e.end - e.begin != nbytes)
    bad(fmt::format("data_offsets [{}, {}] span {} bytes but {} {} needs {}", e.begin, e.end, e.end - e.begin,
                    dtype_name(e.dtype), shape_str(e.shape), nbytes));
  return e;
}

// Closes a file descriptor on every path out of open().
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

struct SafetensorsFile::Mapping {
  void* addr;
  size_t size;
  Mapping(void* a, size_t s) : addr(a), size(s) {}
  ~Mapping() { ::munmap(addr, size); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
};

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  Fd fd{open_regular_file(path)};  // a FIFO or device is refused before any blocking read
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) fail("{}: cannot stat: {}", path, std::strerror(errno));
  uint64_t size = static_cast<uint64_t>(st.st_size);
  // Also rules out mmap of an empty file, which fails.
  if (size < 8) fail("{}: file is {} bytes, too small for the 8-byte header length", path, size);
  void* addr = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.fd, 0);
  if (addr == MAP_FAILED) fail("{}: cannot mmap: {}", path, std::strerror(errno));

  SafetensorsFile f;
  f.path_ = path;
  f.map_ = std::make_shared<Mapping>(addr, size);
  const char* base = static_cast<const char*>(addr);

  uint64_t n = load_le64(base);
  if (n > size - 8) fail("{}: header length {} exceeds the {} bytes after the length field", path, n, size - 8);
  if (n > kMaxHeaderBytes) fail("{}: header length {} is over the {}-byte limit", path, n, kMaxHeaderBytes);
  if (n == 0 || base[8] != '{') fail("{}: header does not start with '{{'", path);
  f.data_ = base + 8 + n;
  uint64_t data_size = size - 8 - n;

  json header;
  try {
    header = json::parse(base + 8, base + 8 + n);
  } catch (const json::exception& e) {
    fail("{}: header is not valid JSON: {}", path, e.what());
  }
  if (!header.is_object()) fail("{}: header is not a JSON object", path);

  try {
    for (const auto& [key, v] : header.items()) {
      if (key == "__metadata__") {
        if (!v.is_object()) fail("{}: __metadata__ is not a JSON object", path);
        for (const auto& [mk, mv] : v.items()) {
          if (!mv.is_string()) fail("{}: __metadata__ value for '{}' is not a string", path, printable(mk));
          f.metadata_[mk] = mv.get<std::string>();
        }
        continue;
      }
      f.entries_.emplace(key, parse_entry(path, key, v, data_size));
    }
  } catch (const json::exception& e) {  // should be unreachable: every access is type-checked
    fail("{}: malformed header: {}", path, e.what());
  }

  // Entries sorted by offset must tile [0, data_size) exactly: no overlap (two tensors
  // aliasing), no gap and no trailing bytes (data nobody accounts for).
  std::vector<const SafetensorsEntry*> order;
  for (const auto& [name, e] : f.entries_) order.push_back(&e);
  std::sort(order.begin(), order.end(),
            [](auto* a, auto* b) { return std::pair(a->begin, a->end) < std::pair(b->begin, b->end); });
  uint64_t pos = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const SafetensorsEntry* e : order) {
    if (e->begin < pos)
      fail("{}: tensor '{}' [{}, {}) overlaps tensor '{}' [{}, {})", path, printable(e->name), e->begin, e->end,
           printable(prev->name), prev->begin, prev->end);
    if (e->begin > pos)
      fail("{}: gap of {} unused bytes at data offset {} before tensor '{}'", path, e->begin - pos, pos,
           printable(e->name));
    pos = e->end;
    prev = e;
  }
  if (pos != data_size) fail("{}: {} trailing bytes after the last tensor", path, data_size - pos);
  return f;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const auto& [name, e] : entries_) out.push_back(name);
  return out;
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) fail("{}: no tensor '{}'", path_, printable(name));
  return it->second;
}

Tensor SafetensorsFile::tensor(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  const char* p = data_ + e.begin;
  if (reinterpret_cast<uintptr_t>(p) % dtype_size(e.dtype) == 0)
    return Tensor::view(const_cast<char*>(p), e.shape, e.dtype, map_);
  // Typed access to misaligned data is undefined behaviour; pay for a copy instead.
  Tensor t = Tensor::empty(e.shape, e.dtype);
  std::memcpy(t.raw(), p, e.end - e.begin);
  return t;
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__") fail("{}: '__metadata__' cannot be a tensor name", path);
    if (!seen.insert(name).second) fail("{}: duplicate tensor name '{}'", path, printable(name));
    if (t.device() != Device::CPU)
      fail("{}: tensor '{}' is on {}; only CPU tensors can be written", path, printable(name), device_name(t.device()));
    if (t.numel() != shape_numel(t.shape()) || (t.raw() == nullptr && t.nbytes() != 0))
      fail("{}: tensor '{}' is undefined", path, printable(name));
    header[name] = {{"dtype", dtype_name(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;

  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {  // names or metadata that are not valid UTF-8
    fail("{}: cannot encode header: {}", path, e.what());
  }
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');  // so the data section starts 8-aligned

  AtomicFile out(path);
  out.write(store_le64(text.size()));
  out.write(text);
  for (const auto& [name, t] : tensors) out.write(t.raw(), t.nbytes());
  out.commit();
}

void write_safetensors_rows(const std::string& path, const std::string& name, DType dtype, const Shape& shape,
                            int64_t chunk_rows, const std::function<void(int64_t, int64_t, Tensor&)>& fill,
                            const std::map<std::string, std::string>& metadata) {
  RETAIN_CHECK(!shape.empty() && chunk_rows > 0, "{}: write_safetensors_rows: shape {} chunk {}", path,
               shape_str(shape), chunk_rows);
  if (name == "__metadata__") fail("{}: '__metadata__' cannot be a tensor name", path);
  const int64_t rows = shape[0];
  const uint64_t bytes = static_cast<uint64_t>(shape_numel(shape)) * dtype_size(dtype);
  json header = json::object();
  header[name] = {{"dtype", dtype_name(dtype)}, {"shape", shape}, {"data_offsets", {uint64_t{0}, bytes}}};
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    fail("{}: cannot encode header: {}", path, e.what());
  }
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');

  AtomicFile out(path);
  out.write(store_le64(text.size()));
  out.write(text);
  Shape chunk_shape = shape;
  for (int64_t begin = 0; begin < rows; begin += chunk_rows) {
    const int64_t end = std::min(rows, begin + chunk_rows);
    chunk_shape[0] = end - begin;
    Tensor chunk = Tensor::empty(chunk_shape, dtype);
    fill(begin, end, chunk);
    out.write(chunk.raw(), chunk.nbytes());
  }
  out.commit();
}

SafetensorsSet SafetensorsSet::open_dir(const std::string& dir) {
  SafetensorsSet set;
  set.dir_ = dir;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail("{}: not a directory", dir);
  const std::string index = (fs::path(dir) / "model.safetensors.index.json").string();
  const std::string single = (fs::path(dir) / "model.safetensors").string();

  if (!fs::exists(index, ec)) {
    if (!fs::exists(single, ec)) fail("{}: neither model.safetensors.index.json nor model.safetensors found", dir);
    set.files_.push_back(SafetensorsFile::open(single));
    for (const std::string& name : set.files_[0].names()) set.owner_[name] = 0;
    return set;
  }

  json j;
  try {
    j = json::parse(read_file(index));
  } catch (const json::exception& e) {
    fail("{}: not valid JSON: {}", index, e.what());
  }
  auto wm = j.is_object() ? j.find("weight_map") : j.end();
  if (!j.is_object() || wm == j.end() || !wm->is_object()) fail("{}: no 'weight_map' object", index);

  std::map<std::string, std::string> listed;  // tensor -> shard file name
  std::map<std::string, size_t> shards;       // shard file name -> index into files_
  for (const auto& [name, shard] : wm->items()) {
    if (!shard.is_string()) fail("{}: weight_map entry for '{}' is not a string", index, printable(name));
    const std::string& s = shard.get_ref<const std::string&>();
    // Shards must be plain file names inside the directory: an index must not make us
    // read files elsewhere.
    if (s.empty() || s == "." || s.find_first_of(std::string_view("/\\\0", 3)) != std::string::npos ||
        s.find("..") != std::string::npos)
      fail("{}: shard name '{}' for tensor '{}' is not a plain file name", index, printable(s), printable(name));
    listed[name] = s;
    shards.emplace(s, 0);
  }
  for (auto& [s, i] : shards) {
    std::string p = (fs::path(dir) / s).string();
    if (!fs::exists(p, ec)) fail("{}: shard {} does not exist", index, printable(p));
    i = set.files_.size();
    set.files_.push_back(SafetensorsFile::open(p));
  }
  for (const auto& [name, s] : listed) {
    size_t i = shards.at(s);
    if (!set.files_[i].contains(name))
      fail("{}: tensor '{}' is listed in weight_map but missing from {}", index, printable(name), set.files_[i].path());
    set.owner_[name] = i;
  }
  for (size_t i = 0; i < set.files_.size(); ++i)
    for (const std::string& name : set.files_[i].names()) {
      auto it = set.owner_.find(name);
      if (it == set.owner_.end())
        fail("{}: tensor '{}' in {} is not listed in weight_map", index, printable(name), set.files_[i].path());
      if (it->second != i)
        fail("{}: tensor '{}' is in two shards: {} and {}", index, printable(name), set.files_[it->second].path(),
             set.files_[i].path());
    }
  return set;
}

std::vector<std::string> SafetensorsSet::names() const {
  std::vector<std::string> out;
  for (const auto& [name, i] : owner_) out.push_back(name);
  return out;
}

const std::map<std::string, std::string>& SafetensorsSet::metadata() const {
  static const std::map<std::string, std::string> kEmpty;
  return files_.empty() ? kEmpty : files_[0].metadata();
}

const SafetensorsFile& SafetensorsSet::file(const std::string& name) const {
  auto it = owner_.find(name);
  if (it == owner_.end()) fail("{}: no tensor '{}'", dir_, printable(name));
  return files_[it->second];
}

}  // namespace retain::formats
