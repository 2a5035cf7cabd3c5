// CUDA Qwen3 row-wise and elementwise ops (CPU references kernels/cpu/ops.cpp, rope.cpp,
// ops_backward.cpp). The per-element and per-row math lives in kernels/cuda/ops_rows.h, shared
// with a CPU emulation test (tests/cuda/test_ops_rows.cpp); this file adds indexing, shared
// memory, barriers and launches. Not yet run on a GPU (none has been lent);
// tests/cuda/test_ops_cuda.cpp is the GPU check.
//
// Elementwise (embedding, swiglu fwd/bwd, add_inplace, concat_columns/split_columns_add, rope
// fwd/bwd): grid-stride loops, one
// element (rope: one (token, pair) for every head) per thread step, int64 indices.
// RMSNorm fwd/bwd: one block of kRowThreads per row (per-head q/k norm is the same op on
// [T·H, d]); strided float32 partials, a fixed pairwise tree in shared memory, then each thread
// writes the elements it read, so out may alias x (forward) and dx may alias dy (backward).
// Plain loads and stores; vectorised (float4) access is left for when a profile asks for it.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/base/error.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/grid.cuh"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/cuda/ops_rows.h"

namespace retain::cuda {

namespace {

using namespace ops_rows;

#define RETAIN_LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

template <typename T> T* ptr(Tensor& t) { return static_cast<T*>(t.raw()); }
template <typename T> const T* ptr(const Tensor& t) { return static_cast<const T*>(t.raw()); }


// ---- embedding ---------------------------------------------------------------------------

// The first token index with an id outside [0, V) (atomicMin: the smallest, whatever the order).
__global__ void first_bad_id_kernel(const int32_t* ids, int64_t T, int64_t V, unsigned long long* first) {
  for (int64_t t = first_index(); t < T; t += grid_stride())
    if (bad_id(ids, t, V)) atomicMin(first, static_cast<unsigned long long>(t));
}

__global__ void embedding_kernel(const void* table, TableType type, const int32_t* ids, int64_t D, int64_t n,
                                 float* out) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = embedding_element(table, type, ids, D, i);
}

// ---- RMSNorm -----------------------------------------------------------------------------

// Every thread of the block ends with the row's totals (the tree's slot 0).
__device__ __forceinline__ RowPartials block_totals(RowPartials mine, RowPartials* slots) {
  const int tid = threadIdx.x;
  slots[tid] = mine;
  __syncthreads();
  for (int s = kRowThreads / 2; s > 0; s >>= 1) {
    if (tid < s) fold_pair(slots, tid, s);
    __syncthreads();
  }
  const RowPartials total = slots[0];
  __syncthreads();  // slots are reused by the next row
  return total;
}

__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_kernel(const float* x, const float* w, float eps, int64_t rows, int64_t D, float* out) {
  __shared__ RowPartials slots[kRowThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * D;
    const RowPartials total = block_totals(row_partials(xr, w, nullptr, D, threadIdx.x), slots);
    const float inv = rms_inverse(total.ss, D, eps);
    float* orow = out + r * D;  // may be xr: each thread rewrites only the elements it read
    for (int64_t j = threadIdx.x; j < D; j += kRowThreads) orow[j] = rmsnorm_element(xr[j], w[j], inv);
  }
}

__global__ void __launch_bounds__(kRowThreads) rmsnorm_backward_kernel(const float* x, const float* w, float eps,
                                                                       const float* dy, int64_t rows, int64_t D,
                                                                       bool accumulate, float* dx) {
  __shared__ RowPartials slots[kRowThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * D;
    const float* gr = dy + r * D;
    const RowPartials total = block_totals(row_partials(xr, w, gr, D, threadIdx.x), slots);
    const float inv = rms_inverse(total.ss, D, eps);
    const float c = rmsnorm_backward_coef(total.dot, inv, D);
    float* orow = dx + r * D;  // may be gr: each thread rewrites only the elements it read
    for (int64_t j = threadIdx.x; j < D; j += kRowThreads) {
      const float g = rmsnorm_backward_element(xr[j], w[j], gr[j], inv, c);
      orow[j] = accumulate ? orow[j] + g : g;  // as add_inplace would add it
    }
  }
}

// ---- RoPE, SwiGLU, add -------------------------------------------------------------------

__global__ void rope_kernel(float* x, const int32_t* positions, const float* inv_freq, float attention_factor,
                            float sign, int64_t heads, int64_t d, int64_t pairs) {
  for (int64_t i = first_index(); i < pairs; i += grid_stride())
    rope_pair(x, positions, inv_freq, attention_factor, sign, heads, d, i);
}

__global__ void swiglu_kernel(const float* g, const float* u, int64_t n, float* out) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = swiglu_element(g[i], u[i]);
}

__global__ void swiglu_backward_kernel(const float* g, const float* u, const float* o, int64_t n, float* dg,
                                       float* du) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const SwigluGrad r = swiglu_backward_element(g[i], u[i], o[i]);  // all reads before the writes
    dg[i] = r.dgate;
    du[i] = r.dup;
  }
}

template <typename T>
__global__ void add_kernel(T* x, const T* y, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) x[i] += y[i];
}

template <typename T>
__global__ void fill_kernel(T* x, T value, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) x[i] = value;
}

__global__ void scale_to_f32_kernel(const double* src, double scale, float* dst, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) dst[i] = static_cast<float>(scale * src[i]);
}

// One element of the joined [T, A + B] per thread step: copied out of (concat) or added into
// (split) the part it belongs to.
__global__ void concat_columns_kernel(const float* a, const float* b, float* out, int64_t A, int64_t B, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const int64_t t = i / (A + B), j = i % (A + B);
    out[i] = j < A ? a[t * A + j] : b[t * B + (j - A)];
  }
}

__global__ void split_columns_add_kernel(const float* src, float* a, float* b, int64_t A, int64_t B, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const int64_t t = i / (A + B), j = i % (A + B);
    if (j < A) a[t * A + j] += src[i];
    else b[t * B + (j - A)] += src[i];
  }
}

// One block per row up to the grid limit, then rows grid-stride.
unsigned row_blocks(int64_t rows) {
  constexpr int64_t kMaxRowBlocks = 1 << 20;
  return static_cast<unsigned>(rows < kMaxRowBlocks ? rows : kMaxRowBlocks);
}

void rope_launch(Tensor& x, const Tensor& positions, const Tensor& inv_freq, float attention_factor, float sign) {
  const int64_t T = x.dim(0), heads = x.dim(1), d = x.dim(2), pairs = T * (d / 2);
  if (pairs == 0 || heads == 0) return;
  rope_kernel<<<elem_blocks(pairs), kElemThreads>>>(ptr<float>(x), ptr<int32_t>(positions), ptr<float>(inv_freq),
                                                    attention_factor, sign, heads, d, pairs);
  RETAIN_LAUNCH_CHECK();
}

}  // namespace

void embedding(const Tensor& table, const Tensor& ids, Tensor& out) {
  const int64_t T = ids.dim(0), V = table.dim(0), D = table.dim(1);
  TableType type = TableType::F32;
  switch (table.dtype()) {
    case DType::F32: break;
    case DType::BF16: type = TableType::BF16; break;
    case DType::F16: type = TableType::F16; break;
    default: fail("embedding: table dtype {} is not a float type", dtype_name(table.dtype()));
  }
  if (T == 0) return;
  // The ids are checked before anything is written, as on the CPU: one value copied back.
  Tensor first = Tensor::empty({1}, DType::I64, Device::CUDA);
  const unsigned long long none = ~0ull;
  CUDA_CHECK(cudaMemcpy(first.raw(), &none, sizeof(none), cudaMemcpyHostToDevice));
  first_bad_id_kernel<<<elem_blocks(T), kElemThreads>>>(ptr<int32_t>(ids), T, V,
                                                        static_cast<unsigned long long*>(first.raw()));
  RETAIN_LAUNCH_CHECK();
  unsigned long long bad = 0;
  CUDA_CHECK(cudaMemcpy(&bad, first.raw(), sizeof(bad), cudaMemcpyDeviceToHost));
  if (bad != none) {
    int32_t id = 0;
    CUDA_CHECK(cudaMemcpy(&id, ptr<int32_t>(ids) + bad, sizeof(id), cudaMemcpyDeviceToHost));
    fail("embedding: token id {} at position {} is outside [0, {})", id, bad, V);
  }
  const int64_t n = T * D;
  if (n == 0) return;
  embedding_kernel<<<elem_blocks(n), kElemThreads>>>(table.raw(), type, ptr<int32_t>(ids), D, n, ptr<float>(out));
  RETAIN_LAUNCH_CHECK();
}

void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor& out) {
  const int64_t D = w.dim(0), rows = D == 0 ? 0 : x.numel() / D;
  if (rows == 0) return;
  rmsnorm_kernel<<<row_blocks(rows), kRowThreads>>>(ptr<float>(x), ptr<float>(w), eps, rows, D, ptr<float>(out));
  RETAIN_LAUNCH_CHECK();
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, float eps, const Tensor& dy, Tensor& dx, bool accumulate) {
  const int64_t D = w.dim(0), rows = D == 0 ? 0 : x.numel() / D;
  if (rows == 0) return;
  rmsnorm_backward_kernel<<<row_blocks(rows), kRowThreads>>>(ptr<float>(x), ptr<float>(w), eps, ptr<float>(dy),
                                                             rows, D, accumulate, ptr<float>(dx));
  RETAIN_LAUNCH_CHECK();
}

void rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, float attention_factor) {
  rope_launch(x, positions, inv_freq, attention_factor, 1.0f);
}

void rope_backward(Tensor& dx, const Tensor& positions, const Tensor& inv_freq, float attention_factor) {
  rope_launch(dx, positions, inv_freq, attention_factor, -1.0f);  // the forward's c, negated s
}

void swiglu(const Tensor& gate, const Tensor& up, Tensor& out) {
  const int64_t n = gate.numel();
  if (n == 0) return;
  swiglu_kernel<<<elem_blocks(n), kElemThreads>>>(ptr<float>(gate), ptr<float>(up), n, ptr<float>(out));
  RETAIN_LAUNCH_CHECK();
}

void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate, Tensor& dup) {
  const int64_t n = gate.numel();
  if (n == 0) return;
  swiglu_backward_kernel<<<elem_blocks(n), kElemThreads>>>(ptr<float>(gate), ptr<float>(up), ptr<float>(dout), n,
                                                           ptr<float>(dgate), ptr<float>(dup));
  RETAIN_LAUNCH_CHECK();
}

void add_inplace(Tensor& x, const Tensor& y) {
  const int64_t n = x.numel();
  if (n == 0) return;
  if (x.dtype() == DType::F64)
    add_kernel<double><<<elem_blocks(n), kElemThreads>>>(ptr<double>(x), ptr<double>(y), n);
  else
    add_kernel<float><<<elem_blocks(n), kElemThreads>>>(ptr<float>(x), ptr<float>(y), n);
  RETAIN_LAUNCH_CHECK();
}

void fill(Tensor& x, double value) {
  const int64_t n = x.numel();
  if (n == 0) return;
  if (x.dtype() == DType::F64)
    fill_kernel<double><<<elem_blocks(n), kElemThreads>>>(ptr<double>(x), value, n);
  else
    fill_kernel<float><<<elem_blocks(n), kElemThreads>>>(ptr<float>(x), static_cast<float>(value), n);
  RETAIN_LAUNCH_CHECK();
}

void scale_to_f32(const Tensor& src, double scale, Tensor& dst) {
  const int64_t n = src.numel();
  if (n == 0) return;
  scale_to_f32_kernel<<<elem_blocks(n), kElemThreads>>>(ptr<double>(src), scale, ptr<float>(dst), n);
  RETAIN_LAUNCH_CHECK();
}

void concat_columns(const Tensor& a, const Tensor& b, Tensor& out) {
  const int64_t n = out.numel();
  if (n == 0) return;
  concat_columns_kernel<<<elem_blocks(n), kElemThreads>>>(ptr<float>(a), ptr<float>(b), ptr<float>(out), a.dim(1),
                                                          b.dim(1), n);
  RETAIN_LAUNCH_CHECK();
}

void split_columns_add(const Tensor& src, Tensor& da, Tensor& db) {
  const int64_t n = src.numel();
  if (n == 0) return;
  split_columns_add_kernel<<<elem_blocks(n), kElemThreads>>>(ptr<float>(src), ptr<float>(da), ptr<float>(db),
                                                             da.dim(1), db.dim(1), n);
  RETAIN_LAUNCH_CHECK();
}

}  // namespace retain::cuda
