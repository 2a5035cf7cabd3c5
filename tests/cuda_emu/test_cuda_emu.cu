// The CUDA emulator (kernels/cuda/emu) against independent references: ldmatrix + mma.sync on
// tiles in shared memory equal a plain float64 matrix product (the canonical pairing that the
// attention kernels use, so the two PTX layouts must agree with each other and with row-major
// storage); shuffles, votes and block reductions against their definitions; cp.async lands
// only at its wait; and the faults it must catch — a barrier some threads skip, a collective
// some lanes skip, bad launches, copies outside device allocations — stop with one message.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/wgmma.cuh"
#include "tests/cuda/cuda_test.h"

namespace {

using bf16 = __nv_bfloat16;

#define EXPECT_CUDA_OK(call) EXPECT_EQ((call), cudaSuccess)

// D (16×8, fp32) = A (16×16, row-major bf16) · B (16×8, stored as B^T: 8 rows of 16 k, the
// "col" operand, i.e. like K rows in Q·K^T), through shared memory with ldmatrix.x4.
__global__ void mma_tile_kernel(const bf16* a, const bf16* bt, const float* c, float* d) {
  __shared__ __align__(16) bf16 sa[16][16];
  __shared__ __align__(16) bf16 sb[8][16];
  const int lane = threadIdx.x;
  for (int x = lane; x < 256; x += 32) sa[x / 16][x % 16] = a[x];
  for (int x = lane; x < 128; x += 32) sb[x / 16][x % 16] = bt[x];
  __syncthreads();
  // A: matrices 0..3 = (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
  uint32_t fa[4];
  const int m = lane / 8, r = lane % 8;
  retain::cuda::ptx::ldmatrix_x4(fa, &sa[(m % 2) * 8 + r][(m / 2) * 8]);
  // B^T rows n = 0..7: matrices (n, k 0-7), (n, k 8-15); x4 loads them twice (lanes 16-31 repeat).
  uint32_t fb[4];
  retain::cuda::ptx::ldmatrix_x4(fb, &sb[r][(m % 2) * 8]);
  const int g = lane / 4, q = lane % 4;
  float acc[4] = {c[g * 8 + 2 * q], c[g * 8 + 2 * q + 1], c[(g + 8) * 8 + 2 * q], c[(g + 8) * 8 + 2 * q + 1]};
  retain::cuda::ptx::mma_bf16_16816(acc, fa, fb[0], fb[1]);
  d[g * 8 + 2 * q] = acc[0];
  d[g * 8 + 2 * q + 1] = acc[1];
  d[(g + 8) * 8 + 2 * q] = acc[2];
  d[(g + 8) * 8 + 2 * q + 1] = acc[3];
}

// The same product with B stored row-major (k × n, like V in P·V), loaded with ldmatrix.trans.
__global__ void mma_tile_trans_kernel(const bf16* a, const bf16* b, float* d) {
  __shared__ __align__(16) bf16 sa[16][16];
  __shared__ __align__(16) bf16 sb[16][8];
  const int lane = threadIdx.x;
  for (int x = lane; x < 256; x += 32) sa[x / 16][x % 16] = a[x];
  for (int x = lane; x < 128; x += 32) sb[x / 8][x % 8] = b[x];
  __syncthreads();
  uint32_t fa[4], fb[4];
  const int m = lane / 8, r = lane % 8;
  retain::cuda::ptx::ldmatrix_x4(fa, &sa[(m % 2) * 8 + r][(m / 2) * 8]);
  retain::cuda::ptx::ldmatrix_x4_trans(fb, &sb[(m % 2) * 8 + r][0]);  // k rows 0-7, then 8-15
  float acc[4] = {0, 0, 0, 0};
  retain::cuda::ptx::mma_bf16_16816(acc, fa, fb[0], fb[1]);
  const int g = lane / 4, q = lane % 4;
  d[g * 8 + 2 * q] = acc[0];
  d[g * 8 + 2 * q + 1] = acc[1];
  d[(g + 8) * 8 + 2 * q] = acc[2];
  d[(g + 8) * 8 + 2 * q + 1] = acc[3];
}

template <class T>
T* device_copy(const std::vector<T>& v) {
  T* p = nullptr;
  EXPECT_CUDA_OK(cudaMalloc(&p, v.size() * sizeof(T)));
  EXPECT_CUDA_OK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}
template <class T>
std::vector<T> host_copy(const T* p, size_t n) {
  std::vector<T> v(n);
  EXPECT_CUDA_OK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

std::vector<bf16> random_bf16(size_t n, std::mt19937& rng, std::vector<double>& exact) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<bf16> v(n);
  exact.resize(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = __float2bfloat16(d(rng));
    exact[i] = static_cast<double>(__bfloat162float(v[i]));
  }
  return v;
}

TEST(CudaEmu, LdmatrixAndMmaGiveTheMatrixProduct) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(7);
  std::vector<double> A, Bt, C(128);
  const std::vector<bf16> a = random_bf16(256, rng, A), bt = random_bf16(128, rng, Bt);
  std::vector<float> c(128);
  for (int i = 0; i < 128; ++i) c[i] = static_cast<float>(i % 7) - 3.0f, C[i] = c[i];
  bf16 *da = device_copy(a), *db = device_copy(bt);
  float *dc = device_copy(c), *dd = nullptr;
  EXPECT_CUDA_OK(cudaMalloc(&dd, 128 * sizeof(float)));
  mma_tile_kernel<<<1, 32>>>(da, db, dc, dd);
  EXPECT_CUDA_OK(cudaGetLastError());
  const std::vector<float> d = host_copy(dd, 128);
  for (int i = 0; i < 16; ++i)
    for (int n = 0; n < 8; ++n) {
      double want = C[i * 8 + n];
      for (int k = 0; k < 16; ++k) want += A[i * 16 + k] * Bt[n * 16 + k];
      EXPECT_NEAR(d[i * 8 + n], want, 1e-4 * (1 + std::abs(want))) << "D[" << i << "][" << n << "]";
    }
  // B row-major through ldmatrix.trans: the same product.
  std::vector<bf16> b(128);
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 8; ++n) b[k * 8 + n] = bt[n * 16 + k];
  bf16* db2 = device_copy(b);
  mma_tile_trans_kernel<<<1, 32>>>(da, db2, dd);
  EXPECT_CUDA_OK(cudaGetLastError());
  const std::vector<float> d2 = host_copy(dd, 128);
  for (int i = 0; i < 16; ++i)
    for (int n = 0; n < 8; ++n) {
      double want = 0;
      for (int k = 0; k < 16; ++k) want += A[i * 16 + k] * Bt[n * 16 + k];
      EXPECT_NEAR(d2[i * 8 + n], want, 1e-4 * (1 + std::abs(want))) << "D[" << i << "][" << n << "] (trans)";
    }
  for (void* p : {static_cast<void*>(da), static_cast<void*>(db), static_cast<void*>(db2), static_cast<void*>(dc),
                  static_cast<void*>(dd)})
    EXPECT_CUDA_OK(cudaFree(p));
}

// Per lane: its xor-2 partner's value, lane 5's value, the warp's any/all/ballot of (lane % 3 == 0),
// and per block the __syncthreads_or/and/count of (thread < 40) over 64 threads.
__global__ void collectives_kernel(int* out) {
  const int t = threadIdx.x, lane = t % 32;
  const float v = 10.0f * static_cast<float>(t);
  out[t * 8 + 0] = static_cast<int>(__shfl_xor_sync(0xffffffffu, v, 2));
  out[t * 8 + 1] = static_cast<int>(__shfl_sync(0xffffffffu, v, 5));
  out[t * 8 + 2] = __any_sync(0xffffffffu, lane == 31);
  out[t * 8 + 3] = __all_sync(0xffffffffu, lane % 3 == 0);
  out[t * 8 + 4] = static_cast<int>(__ballot_sync(0xffffffffu, lane % 3 == 0));
  out[t * 8 + 5] = __syncthreads_or(t == 63);
  out[t * 8 + 6] = __syncthreads_and(t < 40);
  out[t * 8 + 7] = __syncthreads_count(t < 40);
}

TEST(CudaEmu, ShufflesVotesAndBlockReductionsFollowTheirDefinitions) {
  SKIP_WITHOUT_GPU();
  int* d = nullptr;
  EXPECT_CUDA_OK(cudaMalloc(&d, 64 * 8 * sizeof(int)));
  collectives_kernel<<<1, 64>>>(d);
  EXPECT_CUDA_OK(cudaGetLastError());
  const std::vector<int> o = host_copy(d, 64 * 8);
  unsigned ballot = 0;
  for (int l = 0; l < 32; ++l) ballot |= (l % 3 == 0 ? 1u : 0u) << l;
  for (int t = 0; t < 64; ++t) {
    EXPECT_EQ(o[t * 8 + 0], 10 * (t ^ 2)) << t;
    EXPECT_EQ(o[t * 8 + 1], 10 * ((t / 32) * 32 + 5)) << t;
    EXPECT_EQ(o[t * 8 + 2], 1) << t;
    EXPECT_EQ(o[t * 8 + 3], 0) << t;
    EXPECT_EQ(static_cast<unsigned>(o[t * 8 + 4]), ballot) << t;
    EXPECT_EQ(o[t * 8 + 5], 1) << t;
    EXPECT_EQ(o[t * 8 + 6], 0) << t;
    EXPECT_EQ(o[t * 8 + 7], 40) << t;
  }
  EXPECT_CUDA_OK(cudaFree(d));
}

// ---- wgmma (sm_90a) -----------------------------------------------------------------------

// D (64·G × N, fp32) = A (64·G × K) · B with G warpgroups sharing B, k16 step by step, as the
// attention kernels issue them: A row-major, B either N × K row-major (K-major, like K in Q·Kᵀ)
// or K × N row-major (MN-major, like V in P·V), copied into 128-byte-swizzled tiles
// (kernels/cuda/wgmma_layout.h) at 1,024-aligned starts, warpgroup g's A rows in a 64-row tile
// of its own; each k step's descriptor is the tile's plus the kernels' compile-time step
// (k_major_step / mn_major_step). A comes from shared memory (SS) or from registers in the
// mma.m16n8k16 fragment (RS), fenced as the kernels fence it. K = 64 is the kernels' 64-row
// MN-major tile (P·V, dS·K, Pᵀ·dO, dSᵀ·Q: LBO 8 KB between its 64-column panels); G = 2 is the
// forward's two-warpgroup CTA. The accumulators start as NaN: the first step's scale-d = 0 must
// ignore them. Operands are bf16 bit patterns (uint16_t), K a multiple of 64.
template <int N, int K, bool kTransB, bool kARegisters, int G>
__global__ void wgmma_product_kernel(const uint16_t* a, const uint16_t* b, float* d) {
  namespace wg = retain::cuda::wgmma;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t raw = wg::smem_address(smem);
  const uint32_t pad = ((raw + 1023u) & ~1023u) - raw;
  constexpr uint32_t kATile = 64u * K * 2u;  // a multiple of 1,024 bytes
  unsigned char* ta = smem + pad;
  unsigned char* tb = ta + G * kATile;
  const uint32_t sa = raw + pad, sb = sa + G * kATile;
  const int t = threadIdx.x;
  for (int x = t; x < 64 * G * K; x += 128 * G) {
    const int row = x / K, col = x % K;
    *reinterpret_cast<uint16_t*>(ta + (row / 64) * kATile + wg::tile_offset(64, row % 64, col)) = a[x];
  }
  for (int x = t; x < N * K; x += 128 * G) {
    const int row = kTransB ? x / N : x / K, col = kTransB ? x % N : x % K;
    *reinterpret_cast<uint16_t*>(tb + wg::tile_offset(kTransB ? K : N, row, col)) = b[x];
  }
  wg::fence_proxy_async();  // the stores above, visible to wgmma's reads
  __syncthreads();
  const int group = t / 128, warp = (t % 128) / 32, g = (t % 32) / 4, c = t % 4;
  const int row0 = 64 * group;
  // RS: every k step's A fragment loaded before the fence (wgmma reads registers written before it).
  uint32_t fa[K / 16][4];
  if constexpr (kARegisters) {
    const int rows[4] = {g, g + 8, g, g + 8}, cols[4] = {2 * c, 2 * c, 2 * c + 8, 2 * c + 8};
#pragma unroll
    for (int s = 0; s < K / 16; ++s)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int at = (row0 + 16 * warp + rows[r]) * K + 16 * s + cols[r];
        fa[s][r] = static_cast<uint32_t>(a[at]) | (static_cast<uint32_t>(a[at + 1]) << 16);
      }
  }
  const uint64_t desc_a = wg::k_major_desc(sa + static_cast<uint32_t>(group) * kATile, 64, 0, 0);
  const uint64_t desc_b = kTransB ? wg::mn_major_desc(sb, K, 0, 0) : wg::k_major_desc(sb, N, 0, 0);
  float acc[N / 2];
  for (float& v : acc) v = __int_as_float(0x7fc00000);  // NaN
  wg::fence_operand(acc);
  if constexpr (kARegisters) wg::fence_operand(fa);
  wg::fence();
#pragma unroll
  for (int s = 0; s < K / 16; ++s) {
    const uint64_t step_b = kTransB ? wg::mn_major_step(K, 16 * s, 0) : wg::k_major_step(N, 0, 16 * s);
    if constexpr (kARegisters)
      wg::mma_rs<kTransB>(acc, fa[s], desc_b + step_b, s > 0);
    else
      wg::mma_ss<kTransB>(acc, desc_a + wg::k_major_step(64, 0, 16 * s), desc_b + step_b, s > 0);
  }
  wg::commit_group();
  wg::wait_group<0>();
  wg::fence_operand(acc);
  if constexpr (kARegisters) wg::fence_operand(fa);
  for (int i = 0; i < N / 2; ++i) {
    const int row = row0 + 16 * warp + g + 8 * ((i % 4) / 2), col = 8 * (i / 4) + 2 * c + i % 2;
    d[row * N + col] = acc[i];
  }
}

// Small integers (|x| ≤ 8) are exact in bf16 and every product and sum of K ≤ 128 of them is
// exact in fp32, so the result must equal the float64 product whatever order the hardware sums in.
template <int N, int K, bool kTransB, bool kARegisters, int G = 1>
void check_wgmma_product(const char* what) {
  constexpr int M = 64 * G;
  std::mt19937 rng(N + 2 * kTransB + 4 * kARegisters + 8 * K + 16 * G);
  std::uniform_int_distribution<int> v(-8, 8);
  std::vector<uint16_t> a(M * K), b(static_cast<size_t>(N) * K);
  std::vector<double> A(a.size()), B(b.size());
  auto draw = [&](std::vector<uint16_t>& bits, std::vector<double>& exact) {
    for (size_t i = 0; i < bits.size(); ++i) {
      const float x = static_cast<float>(v(rng));
      const bf16 h = __float2bfloat16(x);
      std::memcpy(&bits[i], &h, 2);
      exact[i] = x;
    }
  };
  draw(a, A);
  draw(b, B);
  uint16_t *da = device_copy(a), *db = device_copy(b);
  float* dd = nullptr;
  ASSERT_EQ(cudaMalloc(&dd, M * N * sizeof(float)), cudaSuccess);
  const int smem = (M + N) * K * 2 + 1024;
  auto kernel = wgmma_product_kernel<N, K, kTransB, kARegisters, G>;
  ASSERT_EQ(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), cudaSuccess);
  kernel<<<1, 128 * G, smem>>>(da, db, dd);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess) << what;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
  const std::vector<float> d = host_copy(dd, M * N);
  int wrong = 0;
  for (int i = 0; i < M; ++i)
    for (int n = 0; n < N; ++n) {
      double want = 0;
      for (int k = 0; k < K; ++k) want += A[i * K + k] * (kTransB ? B[k * N + n] : B[n * K + k]);
      if (d[i * N + n] != want && ++wrong <= 5)
        ADD_FAILURE() << what << ": D[" << i << "][" << n << "] = " << d[i * N + n] << ", want " << want;
    }
  EXPECT_EQ(wrong, 0) << what;
  for (void* p : {static_cast<void*>(da), static_cast<void*>(db), static_cast<void*>(dd)}) EXPECT_CUDA_OK(cudaFree(p));
}

// 1 where the code the device loaded for this file has sm_90a's features (wgmma), else 0.
__global__ void sm90a_probe_kernel(int* has) {
#if defined(RETAIN_CUDA_EMU) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *has = 1;
#else
  *has = 0;
#endif
}

// Why this device cannot run this file's wgmma code, or empty where it can (the emulator can):
// an sm_90 GPU, and sm_90a code for it in the build (plain 90 compiles wgmma to traps).
std::string no_wgmma_reason() {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return "no device properties";
  if (p.major != 9 || p.minor != 0) return "wgmma runs on sm_90 (H100/H200) only";
  int* flag = nullptr;
  int has = 0;
  if (cudaMalloc(&flag, sizeof(int)) != cudaSuccess) return "cudaMalloc failed";
  sm90a_probe_kernel<<<1, 1>>>(flag);
  const bool ran = cudaMemcpy(&has, flag, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(flag);
  if (!ran) return "the sm_90a probe kernel did not run";
  return has == 1 ? "" : "this build has no sm_90a code (CMAKE_CUDA_ARCHITECTURES without 90a)";
}

TEST(CudaEmu, WgmmaGivesTheMatrixProductInEveryOperandLayout) {
  SKIP_WITHOUT_GPU();
  if (const std::string why = no_wgmma_reason(); !why.empty()) GTEST_SKIP() << why;
  check_wgmma_product<64, 128, false, false>("m64n64k16 SS, B K-major");
  check_wgmma_product<64, 128, true, false>("m64n64k16 SS, B MN-major");
  check_wgmma_product<64, 128, false, true>("m64n64k16 RS, B K-major");
  check_wgmma_product<64, 128, true, true>("m64n64k16 RS, B MN-major");
  check_wgmma_product<128, 128, false, false>("m64n128k16 SS, B K-major");
  check_wgmma_product<128, 128, true, false>("m64n128k16 SS, B MN-major");
  check_wgmma_product<128, 128, false, true>("m64n128k16 RS, B K-major");
  check_wgmma_product<128, 128, true, true>("m64n128k16 RS, B MN-major");
}

// The shapes the attention kernels issue: a 64-row B tile read MN-major (P·V, dS·K, Pᵀ·dO, dSᵀ·Q
// with K = kBlock = 64; at N = 128 its two 64-column panels are 8 KB apart: LBO 8 KB) and a
// 64-deep K-major product, and the forward's CTA of two warpgroups sharing one B tile (Q·Kᵀ with
// Q in registers, then P·V at d = 128).
TEST(CudaEmu, WgmmaGivesTheMatrixProductInTheKernelsTiles) {
  SKIP_WITHOUT_GPU();
  if (const std::string why = no_wgmma_reason(); !why.empty()) GTEST_SKIP() << why;
  check_wgmma_product<64, 64, true, true>("m64n64k16 RS, 64-row B MN-major (P·V at d = 64)");
  check_wgmma_product<128, 64, true, true>("m64n128k16 RS, 64-row B MN-major, LBO 8 KB (P·V at d = 128)");
  check_wgmma_product<128, 64, true, false>("m64n128k16 SS, 64-row B MN-major, LBO 8 KB");
  check_wgmma_product<64, 64, false, false>("m64n64k16 SS, K = 64 K-major");
  check_wgmma_product<64, 128, false, true, 2>("two warpgroups, m64n64k16 RS, B K-major (Q·Kᵀ at d = 128)");
  check_wgmma_product<128, 64, true, true, 2>("two warpgroups, m64n128k16 RS, 64-row B MN-major (P·V at d = 128)");
}

#if defined(RETAIN_CUDA_EMU)  // the emulator's own guarantees and fault messages

// Thread 0 reads the tile before and after cp.async.wait_group: the copy lands at the wait.
__global__ void cp_async_kernel(const float* src, float* out) {
  __shared__ __align__(16) float tile[4];
  if (threadIdx.x != 0) return;
  for (float& x : tile) x = -1.0f;
  retain::cuda::ptx::cp_async_16(tile, src, true);
  retain::cuda::ptx::cp_async_commit();
  out[0] = tile[0];
  retain::cuda::ptx::cp_async_wait<0>();
  out[1] = tile[0];
  retain::cuda::ptx::cp_async_16(tile, src, false);  // zero-fill
  retain::cuda::ptx::cp_async_commit();
  retain::cuda::ptx::cp_async_wait<0>();
  out[2] = tile[3];
}

TEST(CudaEmu, CpAsyncLandsAtItsWait) {
  SKIP_WITHOUT_GPU();
  float* src = device_copy(std::vector<float>{5, 6, 7, 8});
  float* out = nullptr;
  EXPECT_CUDA_OK(cudaMalloc(&out, 3 * sizeof(float)));
  cp_async_kernel<<<1, 32>>>(src, out);
  const std::vector<float> o = host_copy(out, 3);
  EXPECT_EQ(o[0], -1.0f);
  EXPECT_EQ(o[1], 5.0f);
  EXPECT_EQ(o[2], 0.0f);
}

// A racy kernel: warp 1 reads what warp 0 writes with no barrier between. Its result depends
// on the order the emulator runs threads in — which is how RETAIN_CUDA_EMU_SCHEDULE=reverse
// (or shuffle) exposes a missing __syncthreads.
__global__ void racy_kernel(int* out) {
  __shared__ int s;
  if (threadIdx.x == 0) s = 1;
  if (threadIdx.x == 32) *out = s;
}

TEST(CudaEmu, ScheduleOrderExposesAMissingBarrier) {
  SKIP_WITHOUT_GPU();
  int* out = nullptr;
  EXPECT_CUDA_OK(cudaMalloc(&out, sizeof(int)));
  EXPECT_CUDA_OK(cudaMemset(out, 0, sizeof(int)));
  racy_kernel<<<1, 64>>>(out);
  const int got = host_copy(out, 1)[0];
  const char* s = std::getenv("RETAIN_CUDA_EMU_SCHEDULE");
  if (!s || std::string(s) == "forward") {
    EXPECT_EQ(got, 1) << "forward: thread 0 runs first";
  } else if (std::string(s) == "reverse") {
    EXPECT_NE(got, 1) << "reverse: thread 32 reads before thread 0 writes";
  }
}

// Warp 0 waits at the barrier while half of warp 1 waits at a shuffle its other half never
// reaches (those lanes return): nothing can move.
__global__ void divergent_barrier_kernel(float* out) {
  if (threadIdx.x < 32)
    __syncthreads();
  else if (threadIdx.x < 48)
    out[threadIdx.x - 32] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}
__global__ void divergent_shuffle_kernel(float* out) {
  if (threadIdx.x % 32 < 16) out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}
__global__ void misaligned_ldmatrix_kernel(const bf16* p) {
  __shared__ __align__(16) bf16 tile[8 * 16 + 1];
  uint32_t r[4];
  retain::cuda::ptx::ldmatrix_x4(r, &tile[1 + (threadIdx.x % 8) * 16]);
  (void)p;
}
__global__ void early_return_kernel() {
  if (threadIdx.x >= 32) return;
  __syncthreads();
}
__global__ void noop_kernel(int) {}

TEST(CudaEmuDeathTest, StuckBlocksAndMisalignedAddressesStopWithOneMessage) {
  SKIP_WITHOUT_GPU();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  float* out = nullptr;
  ASSERT_EQ(cudaMalloc(&out, 32 * sizeof(float)), cudaSuccess);
  EXPECT_DEATH(divergent_barrier_kernel<<<1, 64>>>(out),
               "kernel divergent_barrier_kernel block \\(0, 0, 0\\) cannot go on: 32 threads wait at __syncthreads, "
               "16 at a warp collective");
  EXPECT_DEATH(divergent_shuffle_kernel<<<1, 32>>>(out), "cannot go on: 0 threads wait at __syncthreads, 16 at a warp");
  EXPECT_DEATH(misaligned_ldmatrix_kernel<<<1, 32>>>(nullptr), "ldmatrix: a row address is not 16-byte aligned");
  EXPECT_DEATH(early_return_kernel<<<1, 64>>>(), "threads returned before a __syncthreads that the block's other");
}

// wgmma misuse the emulator stops at: a product without a fence since the last wait, a thread
// returning with products no wait retired, an operand layout it does not emulate, and smem
// addresses outside dynamic shared memory.
enum class WgmmaMisuse { no_fence, no_wait, unswizzled, static_shared };
__global__ void wgmma_misuse_kernel(WgmmaMisuse m) {
  namespace wg = retain::cuda::wgmma;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ unsigned char fixed[16];
  const uint32_t raw = wg::smem_address(smem), tile = (raw + 1023u) & ~1023u;
  float acc[32] = {};
  uint64_t desc = wg::k_major_desc(tile, 64, 0, 0);
  if (m == WgmmaMisuse::unswizzled) desc &= ~(uint64_t{3} << 62);
  if (m == WgmmaMisuse::static_shared) (void)wg::smem_address(fixed);
  if (m != WgmmaMisuse::no_fence) wg::fence();
  wg::mma_ss<false>(acc, desc, desc, false);
  wg::commit_group();
  if (m != WgmmaMisuse::no_wait) wg::wait_group<0>();
}

TEST(CudaEmuDeathTest, WgmmaMisuseStopsWithOneMessage) {
  SKIP_WITHOUT_GPU();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const int smem = 64 * 64 * 2 + 1024;
  EXPECT_DEATH(wgmma_misuse_kernel<<<1, 128, smem>>>(WgmmaMisuse::no_fence), "wgmma.mma_async without a wgmma.fence");
  EXPECT_DEATH(wgmma_misuse_kernel<<<1, 128, smem>>>(WgmmaMisuse::no_wait),
               "returned with wgmma.mma_async products no wgmma.wait_group retired");
  EXPECT_DEATH(wgmma_misuse_kernel<<<1, 128, smem>>>(WgmmaMisuse::unswizzled), "only the 128-byte swizzle");
  EXPECT_DEATH(wgmma_misuse_kernel<<<1, 128, smem>>>(WgmmaMisuse::static_shared),
               "outside the block's dynamic shared memory");
  EXPECT_DEATH(wgmma_misuse_kernel<<<1, 64, smem>>>(WgmmaMisuse::no_wait), "not whole warpgroups of 128 threads");
}

TEST(CudaEmu, BadLaunchesAndCopiesAreTheRuntimesErrors) {
  SKIP_WITHOUT_GPU();
  noop_kernel<<<1, 1025>>>(0);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "cudaGetLastError clears the error";
  noop_kernel<<<dim3(1, 65536), 32>>>(0);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  noop_kernel<<<1, 32, 64 * 1024>>>(0);  // past 48 KB without the opt-in
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_CUDA_OK(cudaFuncSetAttribute(noop_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
  noop_kernel<<<1, 32, 64 * 1024>>>(0);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);

  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 16 * sizeof(float)), cudaSuccess);
  std::vector<float> h(32, 1.0f);
  EXPECT_EQ(cudaMemcpy(d, h.data(), 17 * sizeof(float), cudaMemcpyHostToDevice), cudaErrorInvalidValue)
      << "past the allocation's end";
  EXPECT_EQ(cudaMemcpy(h.data(), h.data() + 16, 4, cudaMemcpyHostToDevice), cudaErrorInvalidValue)
      << "a host pointer as the device side";
  EXPECT_EQ(cudaMemcpy(d, d + 8, 4, cudaMemcpyHostToDevice), cudaErrorInvalidValue) << "device memory as the host side";
  EXPECT_EQ(cudaMemset(h.data(), 0, 4), cudaErrorInvalidValue);
  EXPECT_CUDA_OK(cudaMemcpy(d + 8, d, 8 * sizeof(float), cudaMemcpyDeviceToDevice));
  EXPECT_CUDA_OK(cudaFree(d));
  EXPECT_EQ(cudaFree(d), cudaErrorInvalidValue) << "a second free";
  cudaGetLastError();
}

#if defined(__SANITIZE_ADDRESS__)
// In an AddressSanitizer build (launch/test-emu.sh --asan) device allocations are exact, so a
// kernel writing one element past its buffer is reported like any heap overflow.
__global__ void overrun_kernel(float* d, int n) { d[n + threadIdx.x] = 1.0f; }

TEST(CudaEmuDeathTest, AddressSanitizerSeesAKernelOverrun) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 16 * sizeof(float)), cudaSuccess);
  EXPECT_DEATH(overrun_kernel<<<1, 1>>>(d, 16), "heap-buffer-overflow");
}
#endif

#endif  // RETAIN_CUDA_EMU

}  // namespace
