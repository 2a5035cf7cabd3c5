// retain's tensor: a shape, a dtype, a device and a pointer that is either owned
// (an allocation held by a shared_ptr) or a view into memory someone else keeps alive
// (a memory-mapped checkpoint, a bigger tensor). Contiguous, row-major, no strides:
// every op in retain works on dense buffers, so we keep the type that small.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/base/error.h"

namespace retain {

// Every dtype a safetensors file may hold. Ops compute on F32; the others are storage.
enum class DType : uint8_t { BOOL, U8, I8, I16, U16, F16, BF16, I32, U32, F32, I64, U64, F64 };
enum class Device : uint8_t { CPU, CUDA };

using Shape = std::vector<int64_t>;

size_t dtype_size(DType dt);
std::string_view dtype_name(DType dt);  // the safetensors spelling: "BF16", "F32", ...
std::optional<DType> dtype_from_name(std::string_view name);
std::string_view device_name(Device d);
std::string shape_str(const Shape& s);  // "[2, 3]"
// Product of the dims; fails (retain::Error) on a negative dim or int64 overflow.
int64_t shape_numel(const Shape& s);

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<double>() { return DType::F64; }
template <> constexpr DType dtype_of<int32_t>() { return DType::I32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::I64; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::U8; }

class Tensor {
 public:
  Tensor() = default;

  // A fresh allocation (contents undefined / zeroed).
  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::CPU);
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::CPU);
  // A view of memory kept alive by `keepalive` (may be null if the caller guarantees lifetime).
  static Tensor view(void* data, const Shape& shape, DType dtype, std::shared_ptr<void> keepalive,
                     Device device = Device::CPU);
  // Convenience: a CPU tensor copied from a vector.
  template <typename T>
  static Tensor from_vector(const std::vector<T>& v, const Shape& shape) {
    Tensor t = empty(shape, dtype_of<T>());
    RETAIN_CHECK(static_cast<int64_t>(v.size()) == t.numel(), "from_vector: {} values for shape {}",
                 v.size(), shape_str(shape));
    std::copy(v.begin(), v.end(), t.data<T>());
    return t;
  }

  bool defined() const { return data_ != nullptr || numel() == 0; }
  const Shape& shape() const { return shape_; }
  int64_t ndim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t dim(int64_t i) const;  // negative i counts from the end
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  void* raw() { return data_; }
  const void* raw() const { return data_; }
  template <typename T> T* data() {
    check_dtype(dtype_of<T>());
    return static_cast<T*>(data_);
  }
  template <typename T> const T* data() const {
    check_dtype(dtype_of<T>());
    return static_cast<const T*>(data_);
  }

  // Same memory, new shape (numel must match).
  Tensor reshape(const Shape& shape) const;
  // Rows [begin, end) of dimension 0, as a view sharing this tensor's memory.
  Tensor rows(int64_t begin, int64_t end) const;
  // This tensor's bytes from `byte_offset` on, read as a `dtype` tensor of `shape` (a view
  // sharing its memory and device): how one flat buffer holds tensors of several dtypes. The
  // range must lie inside this tensor and the offset be a multiple of dtype's size.
  Tensor view_bytes(size_t byte_offset, const Shape& shape, DType dtype) const;
  // Deep copy to `device` (CPU<->CUDA needs a CUDA build).
  Tensor to(Device device) const;
  // This tensor if it is on `device` already (shared, no copy), else to(device).
  Tensor on(Device device) const { return device == device_ ? *this : to(device); }
  // Copies src's bytes into this tensor's memory, across devices when they differ. Same dtype
  // and numel (shapes may differ, as a reshape would allow).
  void copy_from(const Tensor& src);
  Tensor clone() const { return to(device_); }
  // Converted copy: any float dtype -> any float dtype, ints -> F32/F64, on CPU.
  Tensor to_dtype(DType dtype) const;

 private:
  void check_dtype(DType want) const;

  std::shared_ptr<void> owner_;
  void* data_ = nullptr;
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::F32;
  Device device_ = Device::CPU;
};

// Bytes held by live CPU tensors allocated with Tensor::empty/zeros (each rounded up to 64),
// and their high-water mark since the last reset: what the model's own buffers take on the
// CPU, the CPU counterpart of the CUDA pool's statistics (kernels/cuda/memory.h). Scratch
// that ops keep outside tensors is not counted. Thread-safe.
struct HostTensorMemory {
  size_t in_use = 0, peak = 0;
};
HostTensorMemory host_tensor_memory();
void reset_host_tensor_peak();  // peak = in_use

// True when this build includes CUDA kernels (nvcc was found at configure time).
bool cuda_built();
// Number of usable CUDA devices at run time (0 without a CUDA build, driver or GPU).
int cuda_device_count();

}  // namespace retain
