// torch.save zip archives through libzip (layout: docs/formats.md, "trimkv_weights.pth").
#include "data/formats/torch_file.h"

#include <bit>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>

#include <zip.h>

#include <fmt/format.h>

#include "data/formats/torch_pickle.h"
#include "kernels/base/atomic_file.h"

namespace retain::formats::torchfile {

static_assert(std::endian::native == std::endian::little, "torch archives hold little-endian values");

namespace {

constexpr uint64_t kMaxPickleBytes = 256ull << 20;  // a state dict's pickle is kilobytes
constexpr uint64_t kAlignment = 64;                 // torch's record alignment (.storage_alignment)
constexpr uint16_t kPaddingFieldId = 0x4246;        // "FB": torch's padding extra field

struct ZipCloser {
  void operator()(zip_t* z) const { zip_discard(z); }
};

std::string zip_message(zip_t* z) { return zip_strerror(z); }

// One whole record, its stored size checked against `expect` when given.
std::string read_record(zip_t* z, const std::string& path, const std::string& name, uint64_t cap,
                        std::optional<uint64_t> expect = std::nullopt) {
  const zip_int64_t idx = zip_name_locate(z, name.c_str(), ZIP_FL_ENC_RAW);
  if (idx < 0) fail("{}: no record '{}' in the archive", path, printable(name));
  zip_stat_t st;
  zip_stat_init(&st);
  if (zip_stat_index(z, static_cast<zip_uint64_t>(idx), 0, &st) != 0 || !(st.valid & ZIP_STAT_SIZE))
    fail("{}: record '{}': {}", path, printable(name), zip_message(z));
  if (expect && st.size != *expect)
    fail("{}: record '{}' holds {} bytes, expected {} (its storage's element count × element size)", path, printable(name),
         st.size, *expect);
  if (st.size > cap) fail("{}: record '{}' is {} bytes (more than {} allowed)", path, printable(name), st.size, cap);
  std::unique_ptr<zip_file_t, int (*)(zip_file_t*)> f(zip_fopen_index(z, static_cast<zip_uint64_t>(idx), 0),
                                                        zip_fclose);
  if (!f) fail("{}: record '{}': {}", path, printable(name), zip_message(z));
  std::string data(static_cast<size_t>(st.size), '\0');
  uint64_t got = 0;
  while (got < st.size) {
    const zip_int64_t n = zip_fread(f.get(), data.data() + got, st.size - got);
    if (n < 0) fail("{}: record '{}': {}", path, printable(name), zip_file_strerror(f.get()));
    if (n == 0) fail("{}: record '{}' ends after {} of {} bytes", path, printable(name), got, st.size);
    got += static_cast<uint64_t>(n);
  }
  return data;
}

// The tensor a record describes: a strided view into its storage, copied out contiguously.
Tensor gather(const TensorRecord& r, const std::string& storage, const std::string& path) {
  const Shape& shape = r.shape;
  for (int64_t s : shape)
    if (s < 0) fail("{}: tensor '{}' has a negative size {}", path, printable(r.name), shape_str(shape));
  Tensor out = Tensor::empty(shape, r.dtype);
  const int64_t n = out.numel();
  if (n == 0) return out;
  if (r.storage_offset < 0) fail("{}: tensor '{}' has a negative storage offset", path, printable(r.name));
  // The last element the view touches must lie inside the storage (no negative strides).
  int64_t last = r.storage_offset;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (r.stride[d] < 0) fail("{}: tensor '{}' has a negative stride", path, printable(r.name));
    if (shape[d] > 1 && r.stride[d] > (INT64_MAX - last) / (shape[d] - 1))
      fail("{}: tensor '{}': strides overflow", path, printable(r.name));
    last += (shape[d] - 1) * r.stride[d];
  }
  if (last >= r.storage_numel)
    fail("{}: tensor '{}' (size {}, offset {}) reaches element {} of a {}-element storage", path, printable(r.name),
         shape_str(shape), r.storage_offset, last, r.storage_numel);
  const size_t es = dtype_size(r.dtype);
  std::vector<int64_t> idx(shape.size(), 0);
  char* dst = static_cast<char*>(out.raw());
  for (int64_t e = 0; e < n; ++e) {
    int64_t src = r.storage_offset;
    for (size_t d = 0; d < shape.size(); ++d) src += idx[d] * r.stride[d];
    std::memcpy(dst + static_cast<size_t>(e) * es, storage.data() + static_cast<size_t>(src) * es, es);
    for (size_t d = shape.size(); d-- > 0;) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

}  // namespace

NamedTensors read_torch_file(const std::string& path) {
  require_regular_file(path);  // libzip opens by name: a FIFO would block it
  int code = 0;
  std::unique_ptr<zip_t, ZipCloser> z(zip_open(path.c_str(), ZIP_RDONLY | ZIP_CHECKCONS, &code));
  if (!z) {
    zip_error_t e;
    zip_error_init_with_code(&e, code);
    const std::string msg = zip_error_strerror(&e);
    zip_error_fini(&e);
    fail("{}: not a readable torch.save archive ({})", path, msg);
  }
  // The archive folder: the one holding data.pkl (torch names it after the file; any name is read).
  std::string prefix;
  const zip_int64_t entries = zip_get_num_entries(z.get(), 0);
  for (zip_int64_t i = 0; i < entries; ++i) {
    const char* name = zip_get_name(z.get(), static_cast<zip_uint64_t>(i), ZIP_FL_ENC_RAW);
    if (!name) fail("{}: entry {}: {}", path, i, zip_message(z.get()));
    const std::string_view s(name);
    const size_t slash = s.find('/');
    if (slash != std::string_view::npos && s.substr(slash) == "/data.pkl") {
      if (!prefix.empty()) fail("{}: two data.pkl records ('{}/…' and '{}')", path, printable(prefix), printable(s));
      prefix = std::string(s.substr(0, slash));
    }
  }
  if (prefix.empty()) fail("{}: no '<archive>/data.pkl' record (not a torch.save zip archive)", path);
  if (zip_name_locate(z.get(), (prefix + "/byteorder").c_str(), ZIP_FL_ENC_RAW) >= 0) {
    const std::string order = read_record(z.get(), path, prefix + "/byteorder", 16);
    if (order != "little") fail("{}: byteorder '{}' (only little-endian archives are read)", path, printable(order));
  }
  const std::string pkl = read_record(z.get(), path, prefix + "/data.pkl", kMaxPickleBytes);
  const std::vector<TensorRecord> records = parse_state_dict(pkl, path + ": " + printable(prefix) + "/data.pkl");

  // Each storage once (tied parameters share one), checked against every use of it.
  std::map<std::string, std::pair<TensorRecord, std::string>> storages;
  NamedTensors out;
  for (const TensorRecord& r : records) {
    auto it = storages.find(r.storage_key);
    if (it == storages.end()) {
      const uint64_t bytes = static_cast<uint64_t>(r.storage_numel) * dtype_size(r.dtype);
      std::string data = read_record(z.get(), path, prefix + "/data/" + r.storage_key, bytes, bytes);
      it = storages.emplace(r.storage_key, std::make_pair(r, std::move(data))).first;
    } else if (it->second.first.dtype != r.dtype || it->second.first.storage_numel != r.storage_numel) {
      fail("{}: storage '{}' is used with two dtypes or sizes ('{}' and '{}')", path, printable(r.storage_key),
           printable(it->second.first.name), printable(r.name));
    }
    out.emplace_back(r.name, gather(r, it->second.second, path));
  }
  return out;
}

void write_torch_file(const std::string& path, const NamedTensors& tensors) {
  // Records in torch's order, each data section 64-byte aligned by an "FB" padding field.
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : tensors) {
    RETAIN_CHECK(t.device() == Device::CPU, "write_torch_file: {} is not on the CPU", name);
    (void)storage_class(t.dtype());  // F32, BF16, F16, F64 only
    specs.push_back({name, t.dtype(), t.shape()});
  }
  const std::string stem = std::filesystem::path(path).stem().string();
  const std::string prefix = stem.empty() ? "archive" : stem;
  std::vector<std::pair<std::string, std::string>> records = {
      {prefix + "/data.pkl", write_state_dict(specs)},
      {prefix + "/.format_version", "1"},
      {prefix + "/.storage_alignment", std::to_string(kAlignment)},
      {prefix + "/byteorder", "little"},
  };
  for (size_t x = 0; x < tensors.size(); ++x) {
    const Tensor& t = tensors[x].second;
    records.emplace_back(prefix + "/data/" + std::to_string(x),
                         std::string(static_cast<const char*>(t.raw()), t.nbytes()));
  }
  records.emplace_back(prefix + "/version", "3\n");

  zip_error_t err;
  zip_error_init(&err);
  zip_source_t* mem = zip_source_buffer_create(nullptr, 0, 0, &err);
  if (!mem) fail("{}: libzip: {}", path, zip_error_strerror(&err));
  zip_source_keep(mem);
  std::unique_ptr<zip_source_t, void (*)(zip_source_t*)> mem_owner(mem, zip_source_free);
  std::unique_ptr<zip_t, ZipCloser> z(zip_open_from_source(mem, ZIP_TRUNCATE, &err));
  if (!z) fail("{}: libzip: {}", path, zip_error_strerror(&err));

  // A local header is 30 bytes + name + extra fields; the data follows it. libzip writes the
  // records in the order added, with no other local extra fields and no data descriptors
  // (the source is seekable), so every offset is known here; checked after writing.
  uint64_t offset = 0;
  std::vector<uint64_t> header_offsets, data_offsets;
  for (const auto& [name, data] : records) {
    const uint64_t header = 30 + name.size() + 4;
    const uint64_t pad = (kAlignment - (offset + header) % kAlignment) % kAlignment;
    const std::string padding(pad, 'Z');
    zip_source_t* src = zip_source_buffer(z.get(), data.data(), data.size(), 0);
    if (!src) fail("{}: libzip: {}", path, zip_message(z.get()));
    const zip_int64_t idx = zip_file_add(z.get(), name.c_str(), src, ZIP_FL_ENC_RAW);
    if (idx < 0) {
      zip_source_free(src);
      fail("{}: libzip: {}", path, zip_message(z.get()));
    }
    const auto i = static_cast<zip_uint64_t>(idx);
    if (zip_set_file_compression(z.get(), i, ZIP_CM_STORE, 0) != 0 ||
        zip_file_set_dostime(z.get(), i, 0, 0, 0) != 0 ||
        zip_file_extra_field_set(z.get(), i, kPaddingFieldId, ZIP_EXTRA_FIELD_NEW,
                                 reinterpret_cast<const zip_uint8_t*>(padding.data()),
                                 static_cast<zip_uint16_t>(pad), ZIP_FL_LOCAL) != 0)
      fail("{}: libzip: {}", path, zip_message(z.get()));
    header_offsets.push_back(offset);
    data_offsets.push_back(offset + header + pad);
    offset += header + pad + data.size();
  }
  if (zip_close(z.get()) != 0) fail("{}: libzip: {}", path, zip_message(z.get()));
  (void)z.release();  // zip_close freed it

  std::string bytes;
  if (zip_source_open(mem) != 0 || zip_source_seek(mem, 0, SEEK_END) != 0)
    fail("{}: libzip: reading the archive back failed", path);
  const zip_int64_t size = zip_source_tell(mem);
  if (size < 0 || zip_source_seek(mem, 0, SEEK_SET) != 0) fail("{}: libzip: reading the archive back failed", path);
  bytes.resize(static_cast<size_t>(size));
  if (zip_source_read(mem, bytes.data(), static_cast<zip_uint64_t>(size)) != size)
    fail("{}: libzip: reading the archive back failed", path);
  zip_source_close(mem);

  for (size_t r = 0; r < records.size(); ++r) {  // the layout promised above
    const uint64_t at = data_offsets[r], h = header_offsets[r];
    const std::string& name = records[r].first;
    const bool ok = at % kAlignment == 0 && at + records[r].second.size() <= bytes.size() &&
                    bytes.compare(h, 4, "PK\x03\x04") == 0 && bytes.compare(h + 30, name.size(), name) == 0 &&
                    std::memcmp(bytes.data() + at, records[r].second.data(), records[r].second.size()) == 0;
    RETAIN_CHECK(ok, "{}: libzip did not place record '{}' at byte {}", path, records[r].first, at);
  }
  write_file_atomic(path, bytes);
}

}  // namespace retain::formats::torchfile
