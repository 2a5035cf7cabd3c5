// GGUF version 3 files (the llama.cpp / ggml container; byte layout in docs/formats.md,
// "GGUF adapter"): a header, typed key–value metadata, tensor infos, then the tensor data,
// every tensor aligned to general.alignment (32 unless the file says otherwise).
// Little-endian only. Written atomically; read fully validated (every count, string,
// offset and size checked against the file), F32/F16/BF16 tensors.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "kernels/tensor.h"

namespace retain::formats::gguf {

// GGUF value types (gguf_type in ggml).
enum class Type : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7, STRING = 8,
  ARRAY = 9, U64 = 10, I64 = 11, F64 = 12
};

struct Value;
using Array = std::vector<Value>;
// One metadata value: its GGUF type and a C++ value (integers of any width are kept in
// int64/uint64; an array holds its elements).
struct Value {
  Type type = Type::U32;
  std::variant<uint64_t, int64_t, double, bool, std::string, std::shared_ptr<Array>> v;

  static Value u32(uint32_t x) { return {Type::U32, uint64_t{x}}; }
  static Value i64(int64_t x) { return {Type::I64, x}; }
  static Value f32(float x) { return {Type::F32, double{x}}; }
  static Value f64(double x) { return {Type::F64, x}; }
  static Value str(std::string s) { return {Type::STRING, std::move(s)}; }
  std::string to_string() const;  // for messages and dumps: 42, 1.5, "text", [1, 2]
};

using Metadata = std::vector<std::pair<std::string, Value>>;

// ggml tensor types read and written here.
enum class TensorType : uint32_t { F32 = 0, F16 = 1, BF16 = 30 };

struct File {
  uint32_t alignment = 32;
  Metadata metadata;                                 // in file order
  std::vector<std::pair<std::string, Tensor>> tensors;  // row-major, torch-order shape (ne reversed)
  const Value* find(const std::string& key) const;   // nullptr when absent
};

// Writes tensors (CPU, F32/F16/BF16) in the given order; a tensor of torch shape [a, b] is
// stored with ne = [b, a] (ne[0] innermost). An alignment other than GGUF's default 32 must
// be stated: general.alignment is then written first unless the metadata holds it. Atomic.
void write_file(const std::string& path, const Metadata& metadata,
                const std::vector<std::pair<std::string, Tensor>>& tensors, uint32_t alignment = 32);

// Reads and validates a whole file; any problem is one retain::Error "<path>: ...".
File read_file(const std::string& path);

}  // namespace retain::formats::gguf
