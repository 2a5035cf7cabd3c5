// Force-included first into every kernels/cuda/*.cu when it is compiled by the host compiler
// for the CUDA emulator (kernels/cuda/emu/README.md; the sources themselves are rewritten only
// where C++ cannot read CUDA: `<<<…>>>` launches and `extern __shared__` arrays). It gives the
// CUDA built-ins and device intrinsics the kernels use their emulated meaning.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cuda/emu/emu.h"

// ---- qualifiers ---------------------------------------------------------------------------
// One block runs at a time, so a function-local static is exactly one block's shared array.
#undef __shared__
#define __shared__ static
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __restrict__
#define __restrict__ __restrict

// ---- built-in variables -------------------------------------------------------------------
#define threadIdx (::retain::cuda_emu::position().thread)
#define blockIdx (::retain::cuda_emu::position().block)
#define blockDim (::retain::cuda_emu::position().block_dim)
#define gridDim (::retain::cuda_emu::position().grid_dim)
inline constexpr int warpSize = 32;

// ---- synchronization and warp collectives -------------------------------------------------
inline void __syncthreads() { ::retain::cuda_emu::syncthreads(); }
inline int __syncthreads_or(int p) { return ::retain::cuda_emu::syncthreads_or(p); }
inline int __syncthreads_and(int p) { return ::retain::cuda_emu::syncthreads_and(p); }
inline int __syncthreads_count(int p) { return ::retain::cuda_emu::syncthreads_count(p); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::retain::cuda_emu::syncwarp(mask); }
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return ::retain::cuda_emu::shuffle(true, mask, v, lane_mask, width);
}
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  return ::retain::cuda_emu::shuffle(false, mask, v, src_lane, width);
}
inline int __any_sync(unsigned mask, int p) { return ::retain::cuda_emu::any(mask, p); }
inline int __all_sync(unsigned mask, int p) { return ::retain::cuda_emu::all(mask, p); }
inline unsigned __ballot_sync(unsigned mask, int p) { return ::retain::cuda_emu::ballot(mask, p); }
inline void __threadfence() {}
inline void __threadfence_block() {}

// ---- atomics: blocks and threads take turns on one host thread, so a plain update is atomic
template <class T>
inline T emu_atomic_update(T* p, T v, T (*f)(T, T)) {
  const T old = *p;
  *p = f(old, v);
  return old;
}
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
  return emu_atomic_update<unsigned long long>(p, v, [](unsigned long long a, unsigned long long b) { return std::min(a, b); });
}
inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
  return emu_atomic_update<unsigned long long>(p, v, [](unsigned long long a, unsigned long long b) { return std::max(a, b); });
}
inline int atomicMin(int* p, int v) {
  return emu_atomic_update<int>(p, v, [](int a, int b) { return std::min(a, b); });
}
inline int atomicMax(int* p, int v) {
  return emu_atomic_update<int>(p, v, [](int a, int b) { return std::max(a, b); });
}
template <class T>
inline T atomicAdd(T* p, T v) {
  return emu_atomic_update<T>(p, v, [](T a, T b) { return a + b; });
}

// ---- arithmetic intrinsics ----------------------------------------------------------------
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }
using std::max;
using std::min;
inline int64_t max(int64_t a, int32_t b) { return std::max<int64_t>(a, b); }
inline int64_t max(int32_t a, int64_t b) { return std::max<int64_t>(a, b); }
inline int64_t min(int64_t a, int32_t b) { return std::min<int64_t>(a, b); }
inline int64_t min(int32_t a, int64_t b) { return std::min<int64_t>(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }

// The generic → shared address conversion only feeds inline PTX, which kernels/cuda/mma.cuh
// replaces with the emulator's calls; the pointer's bits stand in for the address.
inline size_t __cvta_generic_to_shared(const void* p) { return reinterpret_cast<size_t>(p); }

// The runtime's typed overload, which cuda_runtime.h declares for nvcc only.
template <class T>
inline cudaError_t cudaFuncSetAttribute(T* entry, cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(entry), attr, value);
}
