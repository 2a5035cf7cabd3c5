// GGUF v3 reader and writer (docs/formats.md, "GGUF adapter").
#include "data/formats/gguf.h"

#include <algorithm>
#include <bit>
#include <optional>
#include <cstring>
#include <set>

#include <fmt/format.h>

#include "kernels/base/atomic_file.h"

namespace retain::formats::gguf {

static_assert(std::endian::native == std::endian::little, "GGUF files here are little-endian");

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr uint32_t kVersion = 3;
constexpr uint32_t kMaxDims = 4;         // GGML_MAX_DIMS

std::optional<DType> dtype_of(uint32_t t) {
  switch (t) {
    case static_cast<uint32_t>(TensorType::F32): return DType::F32;
    case static_cast<uint32_t>(TensorType::F16): return DType::F16;
    case static_cast<uint32_t>(TensorType::BF16): return DType::BF16;
    default: return std::nullopt;
  }
}

TensorType tensor_type(DType d) {
  switch (d) {
    case DType::F32: return TensorType::F32;
    case DType::F16: return TensorType::F16;
    case DType::BF16: return TensorType::BF16;
    default: fail("GGUF: dtype {} is not written (F32, F16, BF16)", dtype_name(d));
  }
}

// ---- writing ----------------------------------------------------------------------------
struct Out {
  std::string b;
  template <typename T> void put(T x) { b.append(reinterpret_cast<const char*>(&x), sizeof(T)); }
  void str(const std::string& s) {
    put<uint64_t>(s.size());
    b += s;
  }
  void pad(uint32_t a) { b.append((a - b.size() % a) % a, '\0'); }
};

void put_scalar(Out& o, const Value& v) {
  switch (v.type) {
    case Type::U8: o.put<uint8_t>(static_cast<uint8_t>(std::get<uint64_t>(v.v))); break;
    case Type::U16: o.put<uint16_t>(static_cast<uint16_t>(std::get<uint64_t>(v.v))); break;
    case Type::U32: o.put<uint32_t>(static_cast<uint32_t>(std::get<uint64_t>(v.v))); break;
    case Type::U64: o.put<uint64_t>(std::get<uint64_t>(v.v)); break;
    case Type::I8: o.put<int8_t>(static_cast<int8_t>(std::get<int64_t>(v.v))); break;
    case Type::I16: o.put<int16_t>(static_cast<int16_t>(std::get<int64_t>(v.v))); break;
    case Type::I32: o.put<int32_t>(static_cast<int32_t>(std::get<int64_t>(v.v))); break;
    case Type::I64: o.put<int64_t>(std::get<int64_t>(v.v)); break;
    case Type::F32: o.put<float>(static_cast<float>(std::get<double>(v.v))); break;
    case Type::F64: o.put<double>(std::get<double>(v.v)); break;
    case Type::BOOL: o.put<uint8_t>(std::get<bool>(v.v) ? 1 : 0); break;
    case Type::STRING: o.str(std::get<std::string>(v.v)); break;
    case Type::ARRAY: {
      const Array& a = *std::get<std::shared_ptr<Array>>(v.v);
      const Type et = a.empty() ? Type::U8 : a.front().type;
      o.put<uint32_t>(static_cast<uint32_t>(et));
      o.put<uint64_t>(a.size());
      for (const Value& e : a) {
        RETAIN_CHECK(e.type == et && et != Type::ARRAY, "GGUF arrays hold one scalar type");
        put_scalar(o, e);
      }
      break;
    }
  }
}

// ---- reading ----------------------------------------------------------------------------
class In {
 public:
  In(const std::string& data, const std::string& path) : d_(data), path_(path) {}
  template <typename T> T get(const char* what) {
    need(sizeof(T), what);
    T x;
    std::memcpy(&x, d_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return x;
  }
  std::string str(const char* what) {
    const uint64_t n = get<uint64_t>(what);
    need(n, what);
    std::string s = d_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return s;
  }
  void need(uint64_t n, const char* what) const {
    if (n > d_.size() - pos_)
      fail("{}: {} at byte {} runs past the end of the file ({} bytes)", path_, what, pos_, d_.size());
  }
  size_t pos() const { return pos_; }
  size_t left() const { return d_.size() - pos_; }
  const std::string& path() const { return path_; }

 private:
  const std::string& d_;
  const std::string& path_;
  size_t pos_ = 0;
};

Value get_value(In& in, uint32_t type, int depth, const std::string& key) {
  const auto t = static_cast<Type>(type);
  switch (t) {
    case Type::U8: return {t, uint64_t{in.get<uint8_t>("a u8")}};
    case Type::U16: return {t, uint64_t{in.get<uint16_t>("a u16")}};
    case Type::U32: return {t, uint64_t{in.get<uint32_t>("a u32")}};
    case Type::U64: return {t, in.get<uint64_t>("a u64")};
    case Type::I8: return {t, int64_t{in.get<int8_t>("an i8")}};
    case Type::I16: return {t, int64_t{in.get<int16_t>("an i16")}};
    case Type::I32: return {t, int64_t{in.get<int32_t>("an i32")}};
    case Type::I64: return {t, in.get<int64_t>("an i64")};
    case Type::F32: return {t, double{in.get<float>("an f32")}};
    case Type::F64: return {t, in.get<double>("an f64")};
    case Type::BOOL: {
      const uint8_t b = in.get<uint8_t>("a bool");
      if (b > 1) fail("{}: metadata '{}': bool byte {} (0 or 1)", in.path(), printable(key), b);
      return {t, b == 1};
    }
    case Type::STRING: return {t, in.str("a string")};
    case Type::ARRAY: {
      if (depth > 0) fail("{}: metadata '{}': nested arrays are not read", in.path(), printable(key));
      const uint32_t et = in.get<uint32_t>("an array type");
      const uint64_t n = in.get<uint64_t>("an array length");
      // Every element takes at least one byte (a string at least 8): a length beyond the
      // rest of the file is damage, not an allocation to attempt.
      if (n > in.left()) fail("{}: metadata '{}': array of {} elements in {} bytes", in.path(), printable(key), n, in.left());
      auto a = std::make_shared<Array>();
      a->reserve(static_cast<size_t>(n));
      for (uint64_t i = 0; i < n; ++i) a->push_back(get_value(in, et, depth + 1, key));
      return {t, a};
    }
  }
  fail("{}: metadata '{}': unknown value type {}", in.path(), printable(key), type);
}

}  // namespace

std::string Value::to_string() const {
  return std::visit(
      [&](const auto& x) -> std::string {
        using X = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<X, std::string>) return fmt::format("\"{}\"", x);
        else if constexpr (std::is_same_v<X, bool>) return x ? "true" : "false";
        else if constexpr (std::is_same_v<X, std::shared_ptr<Array>>) {
          std::string s = "[";
          for (size_t i = 0; i < x->size(); ++i) s += (i ? ", " : "") + (*x)[i].to_string();
          return s + "]";
        } else {
          return fmt::format("{}", x);
        }
      },
      v);
}

const Value* File::find(const std::string& key) const {
  for (const auto& [k, v] : metadata)
    if (k == key) return &v;
  return nullptr;
}

void write_file(const std::string& path, const Metadata& metadata,
                const std::vector<std::pair<std::string, Tensor>>& tensors, uint32_t alignment) {
  RETAIN_CHECK(alignment > 0 && std::has_single_bit(alignment), "GGUF alignment {}", alignment);
  Metadata kv = metadata;
  bool has_alignment = false;
  for (const auto& [k, v] : kv) has_alignment = has_alignment || k == "general.alignment";
  // 32 is GGUF's default: only another alignment must be stated (a file read and written again
  // keeps its metadata as it was).
  if (!has_alignment && alignment != 32) kv.insert(kv.begin(), {"general.alignment", Value::u32(alignment)});

  Out o;
  o.put<uint32_t>(kMagic);
  o.put<uint32_t>(kVersion);
  o.put<uint64_t>(tensors.size());
  o.put<uint64_t>(kv.size());
  for (const auto& [k, v] : kv) {
    o.str(k);
    o.put<uint32_t>(static_cast<uint32_t>(v.type));
    put_scalar(o, v);
  }
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    RETAIN_CHECK(t.device() == Device::CPU && t.ndim() >= 1 && t.ndim() <= static_cast<int64_t>(kMaxDims),
                 "GGUF tensor {}", name);
    o.str(name);
    o.put<uint32_t>(static_cast<uint32_t>(t.ndim()));
    for (int64_t d = t.ndim(); d-- > 0;) o.put<uint64_t>(static_cast<uint64_t>(t.dim(d)));  // ne[0] innermost
    o.put<uint32_t>(static_cast<uint32_t>(tensor_type(t.dtype())));
    o.put<uint64_t>(offset);
    offset += (t.nbytes() + alignment - 1) / alignment * alignment;
  }
  o.pad(alignment);
  for (const auto& [name, t] : tensors) {
    o.b.append(static_cast<const char*>(t.raw()), t.nbytes());
    o.pad(alignment);
  }
  write_file_atomic(path, o.b);
}

File read_file(const std::string& path) {
  const std::string data = retain::read_file(path);
  In in(data, path);
  if (data.size() < 4 || in.get<uint32_t>("the magic") != kMagic) fail("{}: not a GGUF file (no 'GGUF' magic)", path);
  const uint32_t version = in.get<uint32_t>("the version");
  if (version != kVersion) fail("{}: GGUF version {} (version 3 is read)", path, version);
  const uint64_t n_tensors = in.get<uint64_t>("the tensor count");
  const uint64_t n_kv = in.get<uint64_t>("the metadata count");
  // A key–value pair takes ≥ 13 bytes, a tensor info ≥ 28: counts beyond that are damage.
  if (n_kv > data.size() / 13 || n_tensors > data.size() / 28)
    fail("{}: {} metadata entries and {} tensors cannot fit in {} bytes", path, n_kv, n_tensors, data.size());

  File f;
  std::set<std::string> keys;
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = in.str("a metadata key");
    if (!keys.insert(key).second) fail("{}: metadata key '{}' appears twice", path, printable(key));
    const uint32_t type = in.get<uint32_t>("a metadata type");
    Value v = get_value(in, type, 0, key);
    f.metadata.emplace_back(std::move(key), std::move(v));
  }
  if (const Value* a = f.find("general.alignment")) {
    if (a->type != Type::U32) fail("{}: general.alignment is not a u32", path);
    const uint64_t al = std::get<uint64_t>(a->v);
    if (al == 0 || !std::has_single_bit(al) || al > 65536)
      fail("{}: general.alignment {} is not a power of two ≤ 65536", path, al);
    f.alignment = static_cast<uint32_t>(al);
  }
  struct Info {
    std::string name;
    Shape shape;
    DType dtype;
    uint64_t offset, bytes;
  };
  std::vector<Info> infos;
  std::set<std::string> names;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    Info t;
    t.name = in.str("a tensor name");
    if (!names.insert(t.name).second) fail("{}: tensor '{}' appears twice", path, printable(t.name));
    const uint32_t nd = in.get<uint32_t>("a tensor's dimension count");
    if (nd == 0 || nd > kMaxDims) fail("{}: tensor '{}' has {} dimensions (1 to {})", path, printable(t.name), nd, kMaxDims);
    std::vector<uint64_t> ne(nd);
    for (uint32_t d = 0; d < nd; ++d) {
      ne[d] = in.get<uint64_t>("a tensor dimension");
      if (ne[d] > (uint64_t{1} << 40)) fail("{}: tensor '{}' dimension {} is {}", path, printable(t.name), d, ne[d]);
    }
    for (uint32_t d = nd; d-- > 0;) t.shape.push_back(static_cast<int64_t>(ne[d]));
    const uint32_t type = in.get<uint32_t>("a tensor type");
    const auto dt = dtype_of(type);
    if (!dt) fail("{}: tensor '{}' has ggml type {} (F32 = 0, F16 = 1 and BF16 = 30 are read)", path, printable(t.name), type);
    t.dtype = *dt;
    t.offset = in.get<uint64_t>("a tensor offset");
    if (t.offset % f.alignment) fail("{}: tensor '{}' offset {} is not a multiple of {}", path, printable(t.name), t.offset, f.alignment);
    t.bytes = static_cast<uint64_t>(shape_numel(t.shape)) * dtype_size(t.dtype);
    infos.push_back(std::move(t));
  }
  const uint64_t data_start = (in.pos() + f.alignment - 1) / f.alignment * f.alignment;
  if (data_start > data.size() && n_tensors > 0) fail("{}: the tensor data section is missing", path);
  // Tensors must lie inside the data section and not overlap.
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (const Info& t : infos) {
    if (data_start > data.size() || t.offset > data.size() - data_start ||
        t.bytes > data.size() - data_start - t.offset)
      fail("{}: tensor '{}' ({} bytes at data offset {}) runs past the end of the file", path, printable(t.name), t.bytes,
           t.offset);
    spans.emplace_back(t.offset, t.offset + t.bytes);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t s = 1; s < spans.size(); ++s)
    if (spans[s].first < spans[s - 1].second) fail("{}: two tensors overlap at data offset {}", path, spans[s].first);
  for (const Info& t : infos) {
    Tensor x = Tensor::empty(t.shape, t.dtype);
    std::memcpy(x.raw(), data.data() + data_start + t.offset, static_cast<size_t>(t.bytes));
    f.tensors.emplace_back(t.name, std::move(x));
  }
  return f;
}

}  // namespace retain::formats::gguf
