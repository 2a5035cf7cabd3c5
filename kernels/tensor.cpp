#include "kernels/tensor.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "kernels/base/half.h"
#include "kernels/cuda/memory.h"

namespace retain {

namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::BOOL, "BOOL", 1}, {DType::U8, "U8", 1},     {DType::I8, "I8", 1},
    {DType::I16, "I16", 2},   {DType::U16, "U16", 2},   {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2}, {DType::I32, "I32", 4},   {DType::U32, "U32", 4},
    {DType::F32, "F32", 4},   {DType::I64, "I64", 8},   {DType::U64, "U64", 8},
    {DType::F64, "F64", 8},
};

const DTypeInfo& info(DType dt) {
  for (const auto& i : kDTypes)
    if (i.dtype == dt) return i;
  fail("unknown dtype {}", static_cast<int>(dt));
}

constexpr size_t kAlign = 64;  // cache line; also what AVX-512 loads like

std::atomic<size_t> g_host_in_use{0}, g_host_peak{0};

std::shared_ptr<void> allocate(size_t bytes, Device device) {
  if (device == Device::CUDA) return {cuda::device_alloc(bytes), cuda::device_free};
  const size_t rounded = std::max(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  void* p = std::aligned_alloc(kAlign, rounded);
  if (!p) fail("out of memory allocating {} bytes", bytes);
  const size_t now = g_host_in_use.fetch_add(rounded, std::memory_order_relaxed) + rounded;
  size_t peak = g_host_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_host_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  return {p, [rounded](void* q) {
            g_host_in_use.fetch_sub(rounded, std::memory_order_relaxed);
            std::free(q);
          }};
}

// Reads n elements of any numeric dtype as double (used by to_dtype's slow path).
double element_as_double(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::BOOL:
    case DType::U8: return static_cast<const uint8_t*>(p)[i];
    case DType::I8: return static_cast<const int8_t*>(p)[i];
    case DType::I16: return static_cast<const int16_t*>(p)[i];
    case DType::U16: return static_cast<const uint16_t*>(p)[i];
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::I32: return static_cast<const int32_t*>(p)[i];
    case DType::U32: return static_cast<const uint32_t*>(p)[i];
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::I64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::U64: return static_cast<double>(static_cast<const uint64_t*>(p)[i]);
    case DType::F64: return static_cast<const double*>(p)[i];
  }
  return 0;
}

void store_from_double(void* p, DType dt, int64_t i, double v) {
  switch (dt) {
    case DType::F16: static_cast<uint16_t*>(p)[i] = f32_to_f16(static_cast<float>(v)); return;
    case DType::BF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(static_cast<float>(v)); return;
    case DType::F32: static_cast<float*>(p)[i] = static_cast<float>(v); return;
    case DType::F64: static_cast<double*>(p)[i] = v; return;
    case DType::I32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); return;
    case DType::I64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); return;
    default: fail("to_dtype: conversion to {} is not supported", dtype_name(dt));
  }
}

}  // namespace

size_t dtype_size(DType dt) { return info(dt).size; }
std::string_view dtype_name(DType dt) { return info(dt).name; }

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& i : kDTypes)
    if (i.name == name) return i.dtype;
  return std::nullopt;
}

std::string_view device_name(Device d) { return d == Device::CPU ? "cpu" : "cuda"; }

std::string shape_str(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    if (d < 0) fail("shape {} has a negative dimension", shape_str(s));
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d)
      fail("shape {} has more elements than fit in int64", shape_str(s));
    n *= d;
  }
  return n;
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  Tensor t;
  t.shape_ = shape;
  t.numel_ = shape_numel(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  t.owner_ = allocate(t.nbytes(), device);
  t.data_ = t.owner_.get();
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  if (device == Device::CUDA)
    cuda::memset_device(t.data_, 0, t.nbytes());
  else
    std::memset(t.data_, 0, t.nbytes());
  return t;
}

Tensor Tensor::view(void* data, const Shape& shape, DType dtype, std::shared_ptr<void> keepalive,
                    Device device) {
  Tensor t;
  t.shape_ = shape;
  t.numel_ = shape_numel(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  t.owner_ = std::move(keepalive);
  t.data_ = data;
  return t;
}

int64_t Tensor::dim(int64_t i) const {
  int64_t n = ndim();
  if (i < 0) i += n;
  RETAIN_CHECK(i >= 0 && i < n, "dim {} of a {}-d tensor", i, n);
  return shape_[static_cast<size_t>(i)];
}

void Tensor::check_dtype(DType want) const {
  RETAIN_CHECK(dtype_ == want, "tensor of dtype {} accessed as {}", dtype_name(dtype_), dtype_name(want));
}

Tensor Tensor::reshape(const Shape& shape) const {
  RETAIN_CHECK(shape_numel(shape) == numel_, "reshape {} -> {}", shape_str(shape_), shape_str(shape));
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::rows(int64_t begin, int64_t end) const {
  RETAIN_CHECK(ndim() >= 1 && 0 <= begin && begin <= end && end <= shape_[0], "rows({}, {}) of {}",
               begin, end, shape_str(shape_));
  Tensor t = *this;
  t.shape_[0] = end - begin;
  t.numel_ = shape_numel(t.shape_);
  size_t row_bytes = shape_[0] == 0 ? 0 : nbytes() / static_cast<size_t>(shape_[0]);
  t.data_ = static_cast<char*>(data_) + static_cast<size_t>(begin) * row_bytes;
  return t;
}

Tensor Tensor::view_bytes(size_t byte_offset, const Shape& shape, DType dtype) const {
  const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  RETAIN_CHECK(byte_offset <= nbytes() && bytes <= nbytes() - byte_offset && byte_offset % dtype_size(dtype) == 0,
               "view_bytes: {} {} at byte {} of a {}-byte tensor", dtype_name(dtype), shape_str(shape), byte_offset,
               nbytes());
  Tensor t = *this;
  t.shape_ = shape;
  t.numel_ = shape_numel(shape);
  t.dtype_ = dtype;
  t.data_ = static_cast<char*>(data_) + byte_offset;
  return t;
}

Tensor Tensor::to(Device device) const {
  Tensor t = empty(shape_, dtype_, device);
  t.copy_from(*this);
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  RETAIN_CHECK(src.dtype_ == dtype_ && src.numel_ == numel_, "copy_from: {} {} into {} {}", dtype_name(src.dtype_),
               shape_str(src.shape_), dtype_name(dtype_), shape_str(shape_));
  const size_t n = nbytes();
  if (n == 0) return;  // memcpy of null pointers is undefined even for no bytes
  if (src.device_ == Device::CPU && device_ == Device::CPU)
    std::memcpy(data_, src.data_, n);
  else if (src.device_ == Device::CPU)
    cuda::copy_to_device(data_, src.data_, n);
  else if (device_ == Device::CPU)
    cuda::copy_to_host(data_, src.data_, n);
  else
    cuda::copy_device_to_device(data_, src.data_, n);
}

Tensor Tensor::to_dtype(DType dtype) const {
  RETAIN_CHECK(device_ == Device::CPU, "to_dtype needs a CPU tensor");
  Tensor t = empty(shape_, dtype, Device::CPU);
  if (dtype == dtype_) {
    std::memcpy(t.data_, data_, nbytes());
  } else if (dtype == DType::F32 && dtype_ == DType::BF16) {  // the hot path: checkpoint weights
    const uint16_t* src = static_cast<const uint16_t*>(data_);
    float* dst = static_cast<float*>(t.data_);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < numel_; ++i) dst[i] = bf16_to_f32(src[i]);
  } else {
    for (int64_t i = 0; i < numel_; ++i) store_from_double(t.data_, dtype, i, element_as_double(data_, dtype_, i));
  }
  return t;
}

bool cuda_built() { return cuda::built(); }
int cuda_device_count() { return cuda::device_count(); }

HostTensorMemory host_tensor_memory() {
  return {g_host_in_use.load(std::memory_order_relaxed), g_host_peak.load(std::memory_order_relaxed)};
}

void reset_host_tensor_peak() { g_host_peak.store(g_host_in_use.load(std::memory_order_relaxed)); }

}  // namespace retain
