// A CPU stand-in for the part of cuBLASLt that kernels/cuda/gemm.cu uses, so that the GEMM
// wrapper runs on a machine with no GPU. "Device" pointers are host pointers and the work is
// done synchronously on the calling thread (the stream is ignored).
//
// Supported: D = alpha·op(A)·op(B) + beta·C, column-major, op ∈ {N, T}, A and B both F32 or both
// BF16, C and D F32, compute type 32F, scale type R_32F, alpha/beta host floats. The k-sum is
// accumulated in fp32 in increasing k order, so results are deterministic. Everything else is
// CUBLAS_STATUS_NOT_SUPPORTED rather than silently approximated.
#include <cublasLt.h>

#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#include "kernels/base/half.h"

struct cublasLtContext {};  // the emulation has no per-handle state

namespace {

// The fields kept in each opaque descriptor's data words. The descriptors are trivially
// copyable structs, so the fields go in and out with memcpy (no type punning).
struct Desc {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  int32_t trans_a, trans_b;  // cublasOperation_t, stored as the attribute's int32_t
};
struct Layout {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
};
struct Pref {
  uint64_t max_workspace;
  uint32_t min_alignment[4];  // A, B, C, D; recorded only: the CPU loops need no alignment
};

template <class Fields, class Opaque>
Fields load(const Opaque* o) {
  static_assert(std::is_trivially_copyable_v<Fields> && sizeof(Fields) <= sizeof(Opaque));
  Fields f;
  std::memcpy(&f, o, sizeof f);
  return f;
}
template <class Fields, class Opaque>
void store(Opaque* o, const Fields& f) {
  static_assert(std::is_trivially_copyable_v<Fields> && sizeof(Fields) <= sizeof(Opaque));
  std::memcpy(o, &f, sizeof f);
}

// Marks an algo filled in by our heuristic; a zeroed or foreign algo lacks it.
constexpr uint64_t kAlgoMagic = 0x43505545'6d754c74;  // "CPUEmuLt"

template <class Opaque>
cublasStatus_t create(Opaque** out) {
  if (!out) return CUBLAS_STATUS_INVALID_VALUE;
  *out = new (std::nothrow) Opaque{};
  return *out ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_ALLOC_FAILED;
}

// SetAttribute's check: the caller's buffer must be exactly the attribute's documented type.
template <class T>
cublasStatus_t read_attr(T& dst, const void* buf, size_t size) {
  if (!buf || size != sizeof(T)) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(&dst, buf, sizeof(T));
  return CUBLAS_STATUS_SUCCESS;
}

// A validated problem: shapes, ops and the four layouts.
struct Problem {
  uint64_t m, n, k;
  bool ta, tb;
  Layout a, b, c, d;
};

// The checks shared by the heuristic and the matmul: NOT_SUPPORTED for configurations this
// emulation does not implement, INVALID_VALUE for ones that are impossible.
cublasStatus_t validate(cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t adesc, cublasLtMatrixLayout_t bdesc,
                        cublasLtMatrixLayout_t cdesc, cublasLtMatrixLayout_t ddesc, Problem& p) {
  if (!desc || !adesc || !bdesc || !cdesc || !ddesc) return CUBLAS_STATUS_INVALID_VALUE;
  const Desc op = load<Desc>(desc);
  p.a = load<Layout>(adesc), p.b = load<Layout>(bdesc), p.c = load<Layout>(cdesc), p.d = load<Layout>(ddesc);
  if (op.compute != CUBLAS_COMPUTE_32F || op.scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  const auto n_or_t = [](int32_t t) { return t == CUBLAS_OP_N || t == CUBLAS_OP_T; };
  if (!n_or_t(op.trans_a) || !n_or_t(op.trans_b)) return CUBLAS_STATUS_NOT_SUPPORTED;
  const bool ab_ok = p.a.type == p.b.type && (p.a.type == CUDA_R_32F || p.a.type == CUDA_R_16BF);
  if (!ab_ok || p.c.type != CUDA_R_32F || p.d.type != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  for (const Layout* l : {&p.a, &p.b, &p.c, &p.d})  // column-major: columns must not overlap
    if (l->ld < 0 || static_cast<uint64_t>(l->ld) < l->rows) return CUBLAS_STATUS_INVALID_VALUE;
  p.ta = op.trans_a == CUBLAS_OP_T, p.tb = op.trans_b == CUBLAS_OP_T;
  // op(A) is m×k, op(B) is k×n; C and D are m×n.
  p.m = p.ta ? p.a.cols : p.a.rows;
  p.k = p.ta ? p.a.rows : p.a.cols;
  const uint64_t bk = p.tb ? p.b.cols : p.b.rows;
  p.n = p.tb ? p.b.rows : p.b.cols;
  if (bk != p.k || p.c.rows != p.m || p.c.cols != p.n || p.d.rows != p.m || p.d.cols != p.n)
    return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}

// Element (r, c) of a stored column-major matrix, widened to float. bf16 is the high half of
// an fp32, so widening is exact.
float element(const void* base, const Layout& l, uint64_t r, uint64_t c) {
  const uint64_t i = r + c * static_cast<uint64_t>(l.ld);
  if (l.type == CUDA_R_32F) return static_cast<const float*>(base)[i];
  uint16_t bits;
  std::memcpy(&bits, static_cast<const unsigned char*>(base) + i * sizeof bits, sizeof bits);
  return retain::bf16_to_f32(bits);
}

}  // namespace

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) { return create(handle); }

cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

const char* cublasLtGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";  // not an enumerator: a corrupted or foreign status
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
  if (const cublasStatus_t s = create(desc); s != CUBLAS_STATUS_SUCCESS) return s;
  // Unsupported compute/scale types are accepted here and refused where they would be used.
  store(*desc, Desc{compute, scale, CUBLAS_OP_N, CUBLAS_OP_N});
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  delete desc;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t size) {
  if (!desc) return CUBLAS_STATUS_INVALID_VALUE;
  Desc d = load<Desc>(desc);
  cublasStatus_t s = CUBLAS_STATUS_NOT_SUPPORTED;
  if (attr == CUBLASLT_MATMUL_DESC_TRANSA) s = read_attr(d.trans_a, buf, size);
  if (attr == CUBLASLT_MATMUL_DESC_TRANSB) s = read_attr(d.trans_b, buf, size);
  if (s == CUBLAS_STATUS_SUCCESS) store(desc, d);
  return s;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
  if (const cublasStatus_t s = create(layout); s != CUBLAS_STATUS_SUCCESS) return s;
  // ld is checked at use, as with the types: the descriptor only records the layout.
  store(*layout, Layout{type, rows, cols, ld});
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete layout;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  if (const cublasStatus_t s = create(pref); s != CUBLAS_STATUS_SUCCESS) return s;
  store(*pref, Pref{0, {256, 256, 256, 256}});  // the documented defaults
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete pref;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t size) {
  if (!pref) return CUBLAS_STATUS_INVALID_VALUE;
  Pref p = load<Pref>(pref);
  cublasStatus_t s = CUBLAS_STATUS_NOT_SUPPORTED;
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: s = read_attr(p.max_workspace, buf, size); break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES: s = read_attr(p.min_alignment[0], buf, size); break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES: s = read_attr(p.min_alignment[1], buf, size); break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES: s = read_attr(p.min_alignment[2], buf, size); break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: s = read_attr(p.min_alignment[3], buf, size); break;
    default: break;
  }
  if (s == CUBLAS_STATUS_SUCCESS) store(pref, p);
  return s;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t adesc, cublasLtMatrixLayout_t bdesc,
                                              cublasLtMatrixLayout_t cdesc, cublasLtMatrixLayout_t ddesc,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int* returned) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!returned) return CUBLAS_STATUS_INVALID_VALUE;
  *returned = 0;
  if (!pref || requested <= 0 || !results) return CUBLAS_STATUS_INVALID_VALUE;
  Problem p;
  if (const cublasStatus_t s = validate(desc, adesc, bdesc, cdesc, ddesc, p); s != CUBLAS_STATUS_SUCCESS) return s;
  // One algorithm, needing no workspace, so any MAX_WORKSPACE_BYTES (even 0) admits it.
  results[0] = cublasLtMatmulHeuristicResult_t{};
  results[0].algo.data[0] = kAlgoMagic;
  results[0].workspaceSize = 0;
  results[0].state = CUBLAS_STATUS_SUCCESS;
  results[0].wavesCount = 1.0f;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha_ptr,
                              const void* A, cublasLtMatrixLayout_t adesc, const void* B, cublasLtMatrixLayout_t bdesc,
                              const void* beta_ptr, const void* C, cublasLtMatrixLayout_t cdesc, void* D,
                              cublasLtMatrixLayout_t ddesc, const cublasLtMatmulAlgo_t* algo, void* /*workspace*/,
                              size_t /*workspace_bytes*/, cudaStream_t /*stream*/) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  Problem p;
  if (const cublasStatus_t s = validate(desc, adesc, bdesc, cdesc, ddesc, p); s != CUBLAS_STATUS_SUCCESS) return s;
  if (algo && algo->data[0] != kAlgoMagic) return CUBLAS_STATUS_INVALID_VALUE;  // null: "pick one", allowed
  if (!alpha_ptr || !beta_ptr) return CUBLAS_STATUS_INVALID_VALUE;
  const float alpha = *static_cast<const float*>(alpha_ptr), beta = *static_cast<const float*>(beta_ptr);
  if (p.m == 0 || p.n == 0) return CUBLAS_STATUS_SUCCESS;  // nothing to write
  if (!D || (p.k > 0 && (!A || !B)) || (beta != 0.0f && !C)) return CUBLAS_STATUS_INVALID_VALUE;
  // In place (C == D) is only meaningful with one layout for both.
  if (C == D && p.c.ld != p.d.ld) return CUBLAS_STATUS_INVALID_VALUE;

  try {
    // op(A) as m rows of k and op(B) as n columns of k, widened to float once, so that every
    // dot product below reads two contiguous runs whatever the transposes and leading dims.
    std::vector<float> a(p.m * p.k), b(p.n * p.k);
    for (uint64_t i = 0; i < p.m; ++i)
      for (uint64_t q = 0; q < p.k; ++q) a[i * p.k + q] = p.ta ? element(A, p.a, q, i) : element(A, p.a, i, q);
    for (uint64_t j = 0; j < p.n; ++j)
      for (uint64_t q = 0; q < p.k; ++q) b[j * p.k + q] = p.tb ? element(B, p.b, j, q) : element(B, p.b, q, j);

    const auto* c = static_cast<const float*>(C);
    auto* d = static_cast<float*>(D);
    for (uint64_t j = 0; j < p.n; ++j)
      for (uint64_t i = 0; i < p.m; ++i) {
        float acc = 0.0f;  // fp32 accumulation, as CUBLAS_COMPUTE_32F
        for (uint64_t q = 0; q < p.k; ++q) acc += a[i * p.k + q] * b[j * p.k + q];
        // beta == 0 must not read C (it may be uninitialised, even NaN). C(i,j) is read before
        // D(i,j) is written, so an exactly aliased C == D accumulates correctly.
        float out = alpha * acc;
        if (beta != 0.0f) out += beta * c[i + j * static_cast<uint64_t>(p.c.ld)];
        d[i + j * static_cast<uint64_t>(p.d.ld)] = out;
      }
  } catch (const std::bad_alloc&) {
    return CUBLAS_STATUS_ALLOC_FAILED;
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
