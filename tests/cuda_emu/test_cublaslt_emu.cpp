// Checks the CPU cuBLASLt shim (cublaslt_emu.cpp) against an independent float64 reference,
// driving it with the same call sequence as kernels/cuda/gemm.cu, and checks its error paths.
#include <cublasLt.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Round-to-nearest-even fp32 → bf16, written independently of the shim (which only widens).
uint16_t to_bf16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
float from_bf16(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

// A stored column-major matrix of rows×cols with leading dimension ld, in the operand type.
// `value` holds the (bf16-rounded when bf16) values as float for the reference.
struct Matrix {
  uint64_t rows, cols;
  int64_t ld;
  bool bf16;
  std::vector<float> value;
  std::vector<float> f32;
  std::vector<uint16_t> h16;
  const void* data() const { return bf16 ? static_cast<const void*>(h16.data()) : f32.data(); }
  double at(uint64_t r, uint64_t c) const { return value[r + c * static_cast<uint64_t>(ld)]; }
};

Matrix random_matrix(std::mt19937& rng, uint64_t rows, uint64_t cols, int64_t ld, bool bf16) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  Matrix m{rows, cols, ld, bf16, {}, {}, {}};
  const size_t size = static_cast<size_t>(ld) * cols;
  m.value.assign(size, kNaN);  // padding rows are NaN: reading them would poison the result
  for (uint64_t c = 0; c < cols; ++c)
    for (uint64_t r = 0; r < rows; ++r) {
      const float x = dist(rng);
      m.value[r + c * ld] = bf16 ? from_bf16(to_bf16(x)) : x;
    }
  if (bf16)
    for (float v : m.value) m.h16.push_back(to_bf16(v));
  else
    m.f32 = m.value;
  return m;
}

// The descriptors and algorithm for one GEMM, built exactly as gemm.cu's plan() builds them.
struct Plan {
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  cublasStatus_t heuristic = CUBLAS_STATUS_INTERNAL_ERROR;
  int found = -1;

  struct Types {
    cudaDataType_t a = CUDA_R_32F, b = CUDA_R_32F, c = CUDA_R_32F, d = CUDA_R_32F;
    cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
    cudaDataType_t scale = CUDA_R_32F;
    int32_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  };

  // Layouts of the stored matrices: A is rows_a×cols_a, etc.
  Plan(const Types& t, uint64_t ra, uint64_t ca, int64_t lda, uint64_t rb, uint64_t cb, int64_t ldb, uint64_t rc,
       uint64_t cc, int64_t ldc, uint64_t rd, uint64_t cd, int64_t ldd) {
    EXPECT_EQ(cublasLtCreate(&handle), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatmulDescCreate(&desc, t.compute, t.scale), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t.ta, sizeof(t.ta)),
              CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &t.tb, sizeof(t.tb)),
              CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatrixLayoutCreate(&a, t.a, ra, ca, lda), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatrixLayoutCreate(&b, t.b, rb, cb, ldb), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatrixLayoutCreate(&c, t.c, rc, cc, ldc), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatrixLayoutCreate(&d, t.d, rd, cd, ldd), CUBLAS_STATUS_SUCCESS);

    cublasLtMatmulPreference_t pref = nullptr;
    EXPECT_EQ(cublasLtMatmulPreferenceCreate(&pref), CUBLAS_STATUS_SUCCESS);
    const uint64_t max_ws = uint64_t{32} << 20;
    EXPECT_EQ(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws,
                                                   sizeof(max_ws)),
              CUBLAS_STATUS_SUCCESS);
    const uint32_t al[4] = {16, 4, 256, 256};
    const cublasLtMatmulPreferenceAttributes_t al_attr[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; ++i)
      EXPECT_EQ(cublasLtMatmulPreferenceSetAttribute(pref, al_attr[i], &al[i], sizeof(al[i])), CUBLAS_STATUS_SUCCESS);
    cublasLtMatmulHeuristicResult_t result{};
    heuristic = cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, c, d, pref, 1, &result, &found);
    EXPECT_EQ(cublasLtMatmulPreferenceDestroy(pref), CUBLAS_STATUS_SUCCESS);
    if (heuristic == CUBLAS_STATUS_SUCCESS && found == 1) {
      EXPECT_EQ(result.state, CUBLAS_STATUS_SUCCESS);
      EXPECT_EQ(result.workspaceSize, 0u);
      EXPECT_EQ(result.wavesCount, 1.0f);
    }
    algo = result.algo;
  }
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    EXPECT_EQ(cublasLtMatrixLayoutDestroy(a), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatrixLayoutDestroy(b), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatrixLayoutDestroy(c), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatrixLayoutDestroy(d), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatmulDescDestroy(desc), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtDestroy(handle), CUBLAS_STATUS_SUCCESS);
  }

  cublasStatus_t run(float alpha, const void* A, const void* B, float beta, const void* C, void* D,
                     const cublasLtMatmulAlgo_t* with_algo) const {
    static char workspace[64];
    return cublasLtMatmul(handle, desc, &alpha, A, a, B, b, &beta, C, c, D, d, with_algo, workspace,
                          sizeof(workspace), nullptr);
  }
  cublasStatus_t run(float alpha, const void* A, const void* B, float beta, const void* C, void* D) const {
    return run(alpha, A, B, beta, C, D, &algo);
  }
};

// How C and D are laid out and which alpha/beta are used.
enum class Output {
  kOverwriteAliased,   // gemm.cu's plain GEMM: C == D, beta 0, C holding NaN
  kAccumulateAliased,  // gemm.cu's accumulate: C == D, beta 1
  kSeparateScaled,     // alpha -0.75, beta 0.5, C and D distinct buffers with distinct ld
  kSeparateNaN,        // alpha 2.5, beta 0, C (distinct from D) all NaN
};

struct Case {
  uint64_t m, n, k;
  bool ta, tb, bf16;
  Output out;
};

std::string describe(const Case& c) {
  return "m " + std::to_string(c.m) + " n " + std::to_string(c.n) + " k " + std::to_string(c.k) +
         (c.ta ? " T" : " N") + (c.tb ? "T" : "N") + (c.bf16 ? " bf16" : " f32") + " output " +
         std::to_string(static_cast<int>(c.out));
}

void check_case(const Case& tc, std::mt19937& rng) {
  SCOPED_TRACE(describe(tc));
  std::uniform_int_distribution<int64_t> pad(1, 5);
  // Stored shapes: op(A) m×k, op(B) k×n.
  const uint64_t ra = tc.ta ? tc.k : tc.m, ca = tc.ta ? tc.m : tc.k;
  const uint64_t rb = tc.tb ? tc.n : tc.k, cb = tc.tb ? tc.k : tc.n;
  const Matrix A = random_matrix(rng, ra, ca, static_cast<int64_t>(ra) + pad(rng), tc.bf16);
  const Matrix B = random_matrix(rng, rb, cb, static_cast<int64_t>(rb) + pad(rng), tc.bf16);

  const bool aliased = tc.out == Output::kOverwriteAliased || tc.out == Output::kAccumulateAliased;
  const int64_t ldc = static_cast<int64_t>(tc.m) + pad(rng);
  const int64_t ldd = aliased ? ldc : ldc + pad(rng);  // distinct from ldc when separate
  float alpha = 1.0f, beta = 0.0f;
  if (tc.out == Output::kAccumulateAliased) beta = 1.0f;
  if (tc.out == Output::kSeparateScaled) alpha = -0.75f, beta = 0.5f;
  if (tc.out == Output::kSeparateNaN) alpha = 2.5f;

  // C: random values where beta reads them, NaN where it must not; padding always NaN.
  Matrix C = random_matrix(rng, tc.m, tc.n, ldc, false);
  if (beta == 0.0f) std::fill(C.f32.begin(), C.f32.end(), kNaN);
  const std::vector<float> c_before = C.f32;
  constexpr float kSentinel = -12345.0f;  // D's padding must keep it
  std::vector<float> d_separate(static_cast<size_t>(ldd) * tc.n, kSentinel);
  float* D = aliased ? C.f32.data() : d_separate.data();

  const Plan plan({.a = tc.bf16 ? CUDA_R_16BF : CUDA_R_32F,
                   .b = tc.bf16 ? CUDA_R_16BF : CUDA_R_32F,
                   .ta = tc.ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                   .tb = tc.tb ? CUBLAS_OP_T : CUBLAS_OP_N},
                  ra, ca, A.ld, rb, cb, B.ld, tc.m, tc.n, ldc, tc.m, tc.n, ldd);
  ASSERT_EQ(plan.heuristic, CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(plan.found, 1);
  ASSERT_EQ(plan.run(alpha, A.data(), B.data(), beta, C.f32.data(), D), CUBLAS_STATUS_SUCCESS);

  int bad = 0;
  for (uint64_t j = 0; j < tc.n; ++j)
    for (uint64_t i = 0; i < tc.m; ++i) {
      double sum = 0.0, mag = 0.0;
      for (uint64_t q = 0; q < tc.k; ++q) {
        const double x = tc.ta ? A.at(q, i) : A.at(i, q), y = tc.tb ? B.at(j, q) : B.at(q, j);
        sum += x * y;
        mag += std::fabs(x * y);
      }
      const double c = beta != 0.0f ? static_cast<double>(c_before[i + j * ldc]) : 0.0;
      const double want = alpha * sum + beta * c;
      const double tol = 1e-5 * (std::fabs(alpha) * mag + std::fabs(beta * c)) + 1e-30;
      const float got = D[i + j * ldd];
      if (!(std::fabs(got - want) <= tol) && bad++ < 5)  // NaN fails this too
        ADD_FAILURE() << "D(" << i << ", " << j << ") = " << got << ", want " << want << " ± " << tol;
    }
  EXPECT_EQ(bad, 0);
  int touched = 0;
  for (uint64_t j = 0; j < tc.n; ++j)  // D's padding rows are untouched
    for (uint64_t i = tc.m; i < static_cast<uint64_t>(ldd); ++i) {
      const float v = D[i + j * ldd];
      if (!(aliased ? std::isnan(v) : v == kSentinel) && touched++ < 5)
        ADD_FAILURE() << "padding D(" << i << ", " << j << ") = " << v;
    }
  EXPECT_EQ(touched, 0);
  if (!aliased) {  // a distinct C is input only
    for (size_t i = 0; i < c_before.size(); ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(C.f32[i]), std::bit_cast<uint32_t>(c_before[i])) << "C[" << i << "]";
  }
}

TEST(CublasLtEmu, MatchesFloat64Reference) {
  std::mt19937 rng(20240611);
  std::vector<std::array<uint64_t, 3>> shapes = {{1, 1, 1},   {37, 64, 129}, {129, 37, 64}, {64, 129, 37},
                                                 {1, 37, 64}, {64, 1, 129},  {37, 129, 1}, {129, 129, 129}};
  std::uniform_int_distribution<uint64_t> dim(1, 140);
  for (int i = 0; i < 6; ++i) shapes.push_back({dim(rng), dim(rng), dim(rng)});
  int cases = 0;
  for (const auto& [m, n, k] : shapes)
    for (int t = 0; t < 4; ++t)
      for (bool bf16 : {false, true})
        for (Output out : {Output::kOverwriteAliased, Output::kAccumulateAliased, Output::kSeparateScaled,
                           Output::kSeparateNaN}) {
          check_case({m, n, k, (t & 1) != 0, (t & 2) != 0, bf16, out}, rng);
          ++cases;
          if (HasFatalFailure()) return;
        }
  EXPECT_EQ(cases, 14 * 4 * 2 * 4);
}

// The transposes really change the result: a non-square A against its transpose.
TEST(CublasLtEmu, TransposeSelectsTheStoredMatrix) {
  const float a[6] = {1, 2, 3, 4, 5, 6};  // column-major 2×3: rows (1 3 5), (2 4 6)
  const float b[3] = {1, 10, 100};        // 3×1
  float d[2] = {0, 0};
  {
    const Plan plan({}, 2, 3, 2, 3, 1, 3, 2, 1, 2, 2, 1, 2);
    ASSERT_EQ(plan.run(1.0f, a, b, 0.0f, d, d), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(d[0], 531.0f);
    EXPECT_EQ(d[1], 642.0f);
  }
  {  // the same buffer read as 3×2 (ld 3) and transposed: op(A) = rows (1 2 3), (4 5 6)
    const Plan plan({.ta = CUBLAS_OP_T}, 3, 2, 3, 3, 1, 3, 2, 1, 2, 2, 1, 2);
    ASSERT_EQ(plan.run(1.0f, a, b, 0.0f, d, d), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(d[0], 321.0f);
    EXPECT_EQ(d[1], 654.0f);
  }
}

// Heuristic and matmul both report `want`; the heuristic then returns no algorithm.
void expect_rejected(const Plan& plan, cublasStatus_t want) {
  EXPECT_EQ(plan.heuristic, want);
  EXPECT_EQ(plan.found, 0);
  cublasLtMatmulAlgo_t algo{};
  algo.data[0] = 0x43505545'6d754c74;  // the shim's magic, so only the configuration is judged
  const std::vector<float> buf(1024, 0.0f);
  std::vector<float> out(1024, 0.0f);
  EXPECT_EQ(plan.run(1.0f, buf.data(), buf.data(), 0.0f, out.data(), out.data(), &algo), want);
  EXPECT_EQ(plan.run(1.0f, buf.data(), buf.data(), 0.0f, out.data(), out.data(), nullptr), want);
}

// Stored A ra×ca (lda), B rb×cb (ldb), C and D rc×cc / rd×cd (ldc / ldd), F32, op N·N: the
// heuristic and the matmul must both refuse it as INVALID_VALUE.
void expect_invalid(const char* what, uint64_t ra, uint64_t ca, int64_t lda, uint64_t rb, uint64_t cb, int64_t ldb,
                    uint64_t rc, uint64_t cc, int64_t ldc, uint64_t rd, uint64_t cd, int64_t ldd) {
  SCOPED_TRACE(what);
  expect_rejected(Plan({}, ra, ca, lda, rb, cb, ldb, rc, cc, ldc, rd, cd, ldd), CUBLAS_STATUS_INVALID_VALUE);
}

TEST(CublasLtEmu, MismatchedShapesAreInvalid) {
  // A 4×3, B 3×5 → C, D 4×5 is fine; each case below breaks one dimension.
  const Plan ok({}, 4, 3, 4, 3, 5, 3, 4, 5, 4, 4, 5, 4);
  EXPECT_EQ(ok.heuristic, CUBLAS_STATUS_SUCCESS);
  expect_invalid("k", 4, 3, 4, 4, 5, 4, 4, 5, 4, 4, 5, 4);
  expect_invalid("C rows", 4, 3, 4, 3, 5, 3, 5, 5, 5, 4, 5, 4);
  expect_invalid("C cols", 4, 3, 4, 3, 5, 3, 4, 6, 4, 4, 5, 4);
  expect_invalid("D rows", 4, 3, 4, 3, 5, 3, 4, 5, 4, 3, 5, 4);
  expect_invalid("D cols", 4, 3, 4, 3, 5, 3, 4, 5, 4, 4, 4, 4);
  // A stored 3×4 is the right A only if transposed; with op N it is 3×4 against B 3×5.
  expect_invalid("A needs a transpose", 3, 4, 3, 3, 5, 3, 4, 5, 4, 4, 5, 4);
}

TEST(CublasLtEmu, LeadingDimensionBelowRowsIsInvalid) {
  expect_invalid("lda", 4, 3, 3, 3, 5, 3, 4, 5, 4, 4, 5, 4);
  expect_invalid("ldb", 4, 3, 4, 3, 5, 2, 4, 5, 4, 4, 5, 4);
  expect_invalid("ldc", 4, 3, 4, 3, 5, 3, 4, 5, 3, 4, 5, 4);
  expect_invalid("ldd negative", 4, 3, 4, 3, 5, 3, 4, 5, 4, 4, 5, -1);
}

TEST(CublasLtEmu, UnsupportedTypesAndOps) {
  const auto rejected = [](const Plan::Types& t, const char* what) {
    SCOPED_TRACE(what);
    expect_rejected(Plan(t, 4, 3, 4, 3, 5, 3, 4, 5, 4, 4, 5, 4), CUBLAS_STATUS_NOT_SUPPORTED);
  };
  rejected({.a = CUDA_R_16F, .b = CUDA_R_16F}, "F16 A and B");
  rejected({.a = CUDA_R_16BF, .b = CUDA_R_32F}, "BF16 A, F32 B");
  rejected({.a = CUDA_R_32F, .b = CUDA_R_16BF}, "F32 A, BF16 B");
  rejected({.a = CUDA_R_64F, .b = CUDA_R_64F}, "F64 A and B");
  rejected({.c = CUDA_R_16BF, .d = CUDA_R_16BF}, "BF16 C and D");
  rejected({.d = CUDA_R_16BF}, "BF16 D");
  rejected({.compute = CUBLAS_COMPUTE_16F}, "compute 16F");
  rejected({.compute = CUBLAS_COMPUTE_32F_FAST_TF32}, "compute TF32");
  rejected({.scale = CUDA_R_64F}, "scale F64");
  rejected({.ta = CUBLAS_OP_C}, "op C on A");
  rejected({.tb = 7}, "op 7 on B");
}

TEST(CublasLtEmu, AlgoWithoutMagicIsInvalid) {
  const Plan plan({}, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2);
  ASSERT_EQ(plan.heuristic, CUBLAS_STATUS_SUCCESS);
  const float a[4] = {1, 2, 3, 4};
  float d[4] = {};
  const cublasLtMatmulAlgo_t zero{};
  EXPECT_EQ(plan.run(1.0f, a, a, 0.0f, d, d, &zero), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(d[0], 0.0f);  // nothing written
  EXPECT_EQ(plan.run(1.0f, a, a, 0.0f, d, d, nullptr), CUBLAS_STATUS_SUCCESS);  // null: the library picks
  EXPECT_EQ(d[0], 7.0f);
  EXPECT_EQ(plan.run(1.0f, a, a, 0.0f, d, d), CUBLAS_STATUS_SUCCESS);
}

TEST(CublasLtEmu, NullArguments) {
  cublasLtHandle_t none = nullptr;
  EXPECT_EQ(cublasLtCreate(nullptr), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasLtDestroy(nullptr), CUBLAS_STATUS_NOT_INITIALIZED);
  EXPECT_EQ(cublasLtMatmulDescCreate(nullptr, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasLtMatrixLayoutCreate(nullptr, CUDA_R_32F, 1, 1, 1), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasLtMatmulPreferenceCreate(nullptr), CUBLAS_STATUS_INVALID_VALUE);

  const Plan plan({}, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2);
  const float one = 1.0f, a[4] = {1, 2, 3, 4};
  float d[4] = {};
  EXPECT_EQ(cublasLtMatmul(none, plan.desc, &one, a, plan.a, a, plan.b, &one, d, plan.c, d, plan.d, &plan.algo,
                           nullptr, 0, nullptr),
            CUBLAS_STATUS_NOT_INITIALIZED);
  EXPECT_EQ(cublasLtMatmul(plan.handle, nullptr, &one, a, plan.a, a, plan.b, &one, d, plan.c, d, plan.d, &plan.algo,
                           nullptr, 0, nullptr),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasLtMatmul(plan.handle, plan.desc, nullptr, a, plan.a, a, plan.b, &one, d, plan.c, d, plan.d,
                           &plan.algo, nullptr, 0, nullptr),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(plan.run(1.0f, nullptr, a, 0.0f, d, d), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(plan.run(1.0f, a, a, 1.0f, nullptr, d), CUBLAS_STATUS_INVALID_VALUE);  // beta ≠ 0 reads C
  EXPECT_EQ(plan.run(1.0f, a, a, 0.0f, nullptr, d), CUBLAS_STATUS_SUCCESS);        // beta 0 does not

  cublasLtMatmulPreference_t pref = nullptr;
  ASSERT_EQ(cublasLtMatmulPreferenceCreate(&pref), CUBLAS_STATUS_SUCCESS);
  cublasLtMatmulHeuristicResult_t result{};
  int found = -1;
  EXPECT_EQ(cublasLtMatmulAlgoGetHeuristic(none, plan.desc, plan.a, plan.b, plan.c, plan.d, pref, 1, &result, &found),
            CUBLAS_STATUS_NOT_INITIALIZED);
  EXPECT_EQ(cublasLtMatmulAlgoGetHeuristic(plan.handle, plan.desc, plan.a, plan.b, plan.c, plan.d, pref, 0, &result,
                                           &found),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(found, 0);
  EXPECT_EQ(cublasLtMatmulAlgoGetHeuristic(plan.handle, plan.desc, nullptr, plan.b, plan.c, plan.d, pref, 1, &result,
                                           &found),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasLtMatmulPreferenceDestroy(pref), CUBLAS_STATUS_SUCCESS);
}

TEST(CublasLtEmu, InPlaceNeedsOneLayout) {
  // C == D with different leading dimensions cannot be an in-place update.
  const Plan plan({}, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3);
  ASSERT_EQ(plan.heuristic, CUBLAS_STATUS_SUCCESS);
  const float a[4] = {1, 2, 3, 4};
  float c[6] = {}, d[6] = {};
  EXPECT_EQ(plan.run(1.0f, a, a, 1.0f, c, c), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(plan.run(1.0f, a, a, 1.0f, c, d), CUBLAS_STATUS_SUCCESS);
}

TEST(CublasLtEmu, AttributeSizesAndKinds) {
  cublasLtMatmulDesc_t desc = nullptr;
  ASSERT_EQ(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
  const int32_t op = CUBLAS_OP_T;
  const int64_t op64 = CUBLAS_OP_T;
  EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op, sizeof(op)), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op64, sizeof(op64)),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, nullptr, sizeof(op)),
            CUBLAS_STATUS_INVALID_VALUE);
  const int32_t epilogue = CUBLASLT_EPILOGUE_RELU;
  EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)),
            CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(cublasLtMatmulDescSetAttribute(nullptr, CUBLASLT_MATMUL_DESC_TRANSA, &op, sizeof(op)),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasLtMatmulDescDestroy(desc), CUBLAS_STATUS_SUCCESS);

  cublasLtMatmulPreference_t pref = nullptr;
  ASSERT_EQ(cublasLtMatmulPreferenceCreate(&pref), CUBLAS_STATUS_SUCCESS);
  const uint64_t ws = 1 << 20;
  const uint32_t ws32 = 1 << 20, al = 16;
  const uint64_t al64 = 16;
  EXPECT_EQ(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws32, sizeof(ws32)),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al, sizeof(al)),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al64, sizeof(al64)),
            CUBLAS_STATUS_INVALID_VALUE);
  const uint32_t mode = CUBLASLT_SEARCH_BEST_FIT;
  EXPECT_EQ(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_SEARCH_MODE, &mode, sizeof(mode)),
            CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(cublasLtMatmulPreferenceDestroy(pref), CUBLAS_STATUS_SUCCESS);
}

TEST(CublasLtEmu, StatusStrings) {
  EXPECT_STREQ(cublasLtGetStatusString(CUBLAS_STATUS_SUCCESS), "CUBLAS_STATUS_SUCCESS");
  EXPECT_STREQ(cublasLtGetStatusString(CUBLAS_STATUS_NOT_INITIALIZED), "CUBLAS_STATUS_NOT_INITIALIZED");
  EXPECT_STREQ(cublasLtGetStatusString(CUBLAS_STATUS_ALLOC_FAILED), "CUBLAS_STATUS_ALLOC_FAILED");
  EXPECT_STREQ(cublasLtGetStatusString(CUBLAS_STATUS_INVALID_VALUE), "CUBLAS_STATUS_INVALID_VALUE");
  EXPECT_STREQ(cublasLtGetStatusString(CUBLAS_STATUS_ARCH_MISMATCH), "CUBLAS_STATUS_ARCH_MISMATCH");
  EXPECT_STREQ(cublasLtGetStatusString(CUBLAS_STATUS_MAPPING_ERROR), "CUBLAS_STATUS_MAPPING_ERROR");
  EXPECT_STREQ(cublasLtGetStatusString(CUBLAS_STATUS_EXECUTION_FAILED), "CUBLAS_STATUS_EXECUTION_FAILED");
  EXPECT_STREQ(cublasLtGetStatusString(CUBLAS_STATUS_INTERNAL_ERROR), "CUBLAS_STATUS_INTERNAL_ERROR");
  EXPECT_STREQ(cublasLtGetStatusString(CUBLAS_STATUS_NOT_SUPPORTED), "CUBLAS_STATUS_NOT_SUPPORTED");
  EXPECT_STREQ(cublasLtGetStatusString(CUBLAS_STATUS_LICENSE_ERROR), "CUBLAS_STATUS_LICENSE_ERROR");
  EXPECT_NE(cublasLtGetStatusString(static_cast<cublasStatus_t>(12345)), nullptr);
}

}  // namespace
