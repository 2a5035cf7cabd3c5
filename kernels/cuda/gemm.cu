// CUDA GEMM ops through cuBLASLt (CPU references kernels/cpu/ops.cpp, ops_backward.cpp) and the
// dtype cast kernel. Contracts in kernels/cuda/gemm_cuda.h. Not yet run on a GPU (none has been
// lent); tests/cuda/test_gemm_cuda.cpp is the GPU check.
//
// cuBLASLt is column-major and our tensors are row-major: a row-major [r, c] buffer is the
// column-major [c, r] matrix, its transpose. So each product is written for the transposes:
//   linear                 y[N,out]  = x·wᵀ   ⇔  yᵀ  = w·xᵀ   : m = out, n = N,   k = in
//   linear_backward_input  dx[N,in]  = dy·w   ⇔  dxᵀ = wᵀ·dyᵀ : m = in,  n = N,   k = out
//   linear_backward_weight dw[out,in] = dyᵀ·x ⇔  dwᵀ = xᵀ·dy  : m = in,  n = out, k = N
// and no operand is ever copied or transposed in memory.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>
#include <mutex>

#include "kernels/base/error.h"
#include "kernels/cuda/cast_rows.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/cublas_check.h"
#include "kernels/cuda/gemm_cuda.h"
#include "kernels/cuda/grid.cuh"
#include "kernels/cuda/memory.h"

namespace retain::cuda {

namespace {

using cast_rows::Type;

// Where every retain kernel, copy and allocation is queued (kernels/cuda/memory.cu), so the
// GEMMs are ordered after the work that produced their inputs without any event.
const cudaStream_t kStream = cudaStreamLegacy;

// cuBLASLt's scratch space: enough for the split-K and stream-K algorithms of Hopper-sized
// GEMMs (NVIDIA suggests 32 MiB there), allocated once per device.
constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;

// ---- the cast kernel ---------------------------------------------------------------------

// Types as template arguments, so the per-element switches of cast_rows.h fold away.
template <Type S, Type D> __global__ void cast_kernel(const void* src, void* dst, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride())
    cast_rows::cast_element(src, S, dst, D, i);
}

template <Type S, Type D> void launch_cast(const void* src, void* dst, int64_t n) {
  cast_kernel<S, D><<<elem_blocks(n), kElemThreads, 0,
                      kStream>>>(src, dst, n);
  CUDA_CHECK(cudaGetLastError());
}

template <Type S> void launch_cast_from(const void* src, Type d, void* dst, int64_t n) {
  switch (d) {
    case Type::F32: launch_cast<S, Type::F32>(src, dst, n); break;
    case Type::BF16: launch_cast<S, Type::BF16>(src, dst, n); break;
    case Type::F16: launch_cast<S, Type::F16>(src, dst, n); break;
  }
}

void launch_cast(const void* src, Type s, void* dst, Type d, int64_t n) {
  switch (s) {
    case Type::F32: launch_cast_from<Type::F32>(src, d, dst, n); break;
    case Type::BF16: launch_cast_from<Type::BF16>(src, d, dst, n); break;
    case Type::F16: launch_cast_from<Type::F16>(src, d, dst, n); break;
  }
}

Type cast_type(DType dt) {
  switch (dt) {
    case DType::F32: return Type::F32;
    case DType::BF16: return Type::BF16;
    case DType::F16: return Type::F16;
    default: fail("cast: dtype {} is not F32, BF16 or F16", dtype_name(dt));
  }
}

// ---- cuBLASLt state, one per device ------------------------------------------------------

// A matmul's descriptors and the algorithm the heuristic chose for them: built on first use of
// a (shape, transposes, dtype, leading dims, pointer alignments) and kept, so that a shape gets
// the same algorithm every call (bitwise repeatable) and the heuristic runs once.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};
using PlanKey = std::array<int64_t, 12>;

struct DeviceGemm {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;  // kLtWorkspaceBytes
  void* staging = nullptr;    // the last GEMM's activation converted to the weight's type; grows, never shrinks
  size_t staging_bytes = 0;
  std::map<PlanKey, Plan> plans;
};

// Per-device state behind one mutex held for a whole op: the staging buffer is shared by every
// BF16 GEMM on the device. Handles, workspaces and plans are never destroyed: they live as long
// as the process, and destroying them at exit would race the CUDA runtime's own teardown.
std::mutex g_mutex;
std::map<int, DeviceGemm>& g_devices() {
  static auto* devices = new std::map<int, DeviceGemm>;
  return *devices;
}

DeviceGemm& device_gemm() {  // g_mutex held
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  DeviceGemm& g = g_devices()[device];
  if (!g.handle) {
    CUBLAS_CHECK(cublasLtCreate(&g.handle));
    g.workspace = device_alloc(kLtWorkspaceBytes);
  }
  return g;
}

// `bytes` of staging space; the old buffer is freed in stream order, after the GEMMs already
// queued on it.
void* staging(DeviceGemm& g, size_t bytes) {
  if (bytes > g.staging_bytes) {
    device_free(g.staging);
    g.staging = nullptr;
    g.staging_bytes = 0;
    g.staging = device_alloc(bytes);
    g.staging_bytes = bytes;
  }
  return g.staging;
}

// The largest power of two ≤ 256 dividing the address: cuBLASLt's heuristic assumes 256 unless
// told, and a row view (Tensor::rows) may start anywhere.
uint32_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al >>= 1;
  return al;
}

struct Operand {
  const void* ptr;
  int64_t ld;  // column-major leading dimension of the stored matrix
  bool trans;
};

const Plan& plan(DeviceGemm& g, int64_t m, int64_t n, int64_t k, const Operand& a, const Operand& b, bool bf16,
                 float* c, int64_t ldc) {
  const PlanKey key{m, n, k, a.trans, b.trans, bf16, a.ld, b.ld, ldc, alignment(a.ptr), alignment(b.ptr),
                    alignment(c)};
  if (auto it = g.plans.find(key); it != g.plans.end()) return it->second;
  Plan p;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = a.trans ? CUBLAS_OP_T : CUBLAS_OP_N, tb = b.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const cudaDataType_t ab = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
  // Layouts describe the stored matrices: op(A) is m×k, op(B) is k×n.
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, ab, a.trans ? u(k) : u(m), a.trans ? u(m) : u(k), a.ld));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, ab, b.trans ? u(n) : u(k), b.trans ? u(k) : u(n), b.ld));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_32F, u(m), u(n), ldc));

  cublasLtMatmulPreference_t pref = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t max_ws = kLtWorkspaceBytes;
  CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws)));
  const uint32_t al[4] = {static_cast<uint32_t>(key[9]), static_cast<uint32_t>(key[10]),
                          static_cast<uint32_t>(key[11]), static_cast<uint32_t>(key[11])};
  const cublasLtMatmulPreferenceAttributes_t al_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, al_attr[i], &al[i], sizeof(al[i])));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(g.handle, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
  CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
  if (status != CUBLAS_STATUS_SUCCESS || found == 0 || result.state != CUBLAS_STATUS_SUCCESS)
    fail("cuBLASLt has no algorithm for a {} GEMM m {} n {} k {} (op A {}, op B {}, ld {} {} {}): {}",
         bf16 ? "BF16" : "F32", m, n, k, a.trans ? "T" : "N", b.trans ? "T" : "N", a.ld, b.ld, ldc,
         cublasLtGetStatusString(status != CUBLAS_STATUS_SUCCESS ? status : result.state));
  p.algo = result.algo;
  return g.plans.emplace(key, p).first->second;
}

// C[m,n] (column-major, ldc) = op(A)·op(B) (+ C when accumulate), fp32 accumulation.
void matmul(DeviceGemm& g, int64_t m, int64_t n, int64_t k, const Operand& a, const Operand& b, bool bf16, float* c,
            int64_t ldc, bool accumulate) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // an empty sum: C = 0, or C unchanged
    if (!accumulate)
      CUDA_CHECK(cudaMemsetAsync(c, 0, static_cast<size_t>(m) * static_cast<size_t>(n) * sizeof(float), kStream));
    return;
  }
  const Plan& p = plan(g, m, n, k, a, b, bf16, c, ldc);
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;  // beta 0: C is not read
  CUBLAS_CHECK(cublasLtMatmul(g.handle, p.desc, &alpha, a.ptr, p.a, b.ptr, p.b, &beta, c, p.c, c, p.c, &p.algo,
                              g.workspace, kLtWorkspaceBytes, kStream));
}

// The activation operand in the weight's type (both GEMM operands must share one): as it is
// when the types agree; otherwise converted into the staging buffer (an F32 activation rounded
// to bf16 for BF16 weights, a BF16 one widened exactly for F32 weights).
const void* activation(DeviceGemm& g, const Tensor& t, bool bf16) {
  const DType want = bf16 ? DType::BF16 : DType::F32;
  if (t.dtype() == want || t.numel() == 0) return t.raw();
  void* dst = staging(g, static_cast<size_t>(t.numel()) * dtype_size(want));
  launch_cast(t.raw(), cast_type(t.dtype()), dst, cast_type(want), t.numel());
  return dst;
}

}  // namespace

void linear(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate) {
  const int64_t N = x.dim(0), in = x.dim(1), out = w.dim(0);
  const bool bf16 = w.dtype() == DType::BF16;
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceGemm& g = device_gemm();
  if (N == 0 || out == 0) return;
  matmul(g, out, N, in, {w.raw(), in, true}, {activation(g, x, bf16), in, false}, bf16, static_cast<float*>(y.raw()),
         out, accumulate);
}

void linear_backward_input(const Tensor& dy, const Tensor& w, Tensor& dx, bool accumulate) {
  const int64_t N = dy.dim(0), out = w.dim(0), in = w.dim(1);
  const bool bf16 = w.dtype() == DType::BF16;
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceGemm& g = device_gemm();
  if (N == 0 || in == 0) return;
  matmul(g, in, N, out, {w.raw(), in, false}, {activation(g, dy, bf16), out, false}, bf16,
         static_cast<float*>(dx.raw()), in, accumulate);
}

void linear_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, bool accumulate) {
  const int64_t N = dy.dim(0), out = dy.dim(1), in = x.dim(1);
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceGemm& g = device_gemm();
  matmul(g, in, out, N, {x.raw(), in, false}, {dy.raw(), out, true}, false, static_cast<float*>(dw.raw()), in,
         accumulate);
}

void cast(const Tensor& src, Tensor& dst) {
  const int64_t n = src.numel();
  if (n == 0) return;
  if (src.dtype() == dst.dtype()) {  // a copy keeps NaN payloads, which a round trip through F32 would not
    if (src.raw() != dst.raw())
      CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), src.nbytes(), cudaMemcpyDeviceToDevice, kStream));
    return;
  }
  launch_cast(src.raw(), cast_type(src.dtype()), dst.raw(), cast_type(dst.dtype()), n);
}

}  // namespace retain::cuda
