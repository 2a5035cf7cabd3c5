// CUDA side of the fused chunked KL + NTP loss (kernels/loss.h): its chunk loop (GEMMs through
// ops::linear*) and row kernels; the CPU reference is kernels/cpu/loss.cpp. The per-row math lives in
// kernels/cuda/loss_rows.h, shared with the CPU loss and with a host emulation test
// (tests/cuda/test_loss_rows.cpp); this file adds indexing, shared memory, barriers and
// launches. Not yet run on a GPU (none has been lent); tests/cuda/test_loss_cuda.cpp is the GPU
// check.
//
// gather / scatter: grid-stride over the chunk's c·D elements, int64 indices.
// kl_ntp_rows: one block of kLossThreads per row (rows grid-stride beyond the grid cap), three
// passes over the row's logits: maxima, float64 sums, and (optionally) the gradient written
// over the student logits. The exponentials are recomputed in the third pass rather than kept:
// storing them would add two [c, V] writes to a kernel bound by memory traffic, and the same
// device computes the same exp bit for bit. Each row's KL and NTP go to its own slots of a
// device array; no atomics, no host synchronisation.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/grid.cuh"
#include "kernels/cuda/loss_cuda.h"
#include "kernels/cuda/loss_rows.h"
#include "kernels/ops.h"

namespace retain::cuda {

namespace {

using namespace loss_rows;

constexpr int64_t kMaxRowBlocks = 1 << 20;


__global__ void gather_kernel(const float* src, const int32_t* pos, int64_t D, int64_t n, float* dst) {
  for (int64_t i = first_index(); i < n; i += grid_stride())
    dst[i] = src[static_cast<int64_t>(pos[i / D]) * D + i % D];
}

__global__ void scatter_kernel(const float* src, const int32_t* pos, int64_t D, int64_t n, float* dst) {
  for (int64_t i = first_index(); i < n; i += grid_stride())
    dst[static_cast<int64_t>(pos[i / D]) * D + i % D] = src[i];
}

__global__ void __launch_bounds__(kLossThreads)
    kl_ntp_rows_kernel(const float* teacher, float* student, const int32_t* targets, int64_t rows, int64_t V,
                       GradScales scales, bool gradient, double* kl_out, double* ntp_out) {
  __shared__ RowMax maxes[kLossThreads];
  __shared__ RowSums sums[kLossThreads];
  const int tid = threadIdx.x;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* t = teacher + r * V;
    float* s = student + r * V;
    const int64_t y = targets[r];
    // Only thread 0 needs s_y; it reads it before the first barrier, and nothing overwrites s
    // before the second.
    const double target_logit = tid == 0 ? static_cast<double>(s[y]) : 0.0;

    maxes[tid] = row_max_partial(t, s, V, tid);
    __syncthreads();
    for (int st = kLossThreads / 2; st > 0; st >>= 1) {
      if (tid < st) fold_max(maxes, tid, st);
      __syncthreads();
    }
    const double mt = maxes[0].t, ms = maxes[0].s;

    sums[tid] = row_sums_partial(t, s, V, mt, ms, tid);
    __syncthreads();
    for (int st = kLossThreads / 2; st > 0; st >>= 1) {
      if (tid < st) fold_sums(sums, tid, st);
      __syncthreads();
    }
    const RowSums total = sums[0];
    // Every thread forms the row's losses (the reverse KL's gradient reads its log_ratio); thread
    // 0 alone has s_y, so only its NTP is stored.
    const RowLoss loss = row_loss(total, mt, ms, target_logit, scales.reverse);
    if (tid == 0) {
      kl_out[r] = loss.kl;
      ntp_out[r] = loss.ntp;
    }
    if (gradient) {
      const double inv_zt = 1.0 / total.zt, inv_zs = 1.0 / total.zs;
      for (int64_t v = tid; v < V; v += kLossThreads)
        s[v] = gradient_at(t[v], s[v], mt, ms, inv_zt, inv_zs, v == y, scales, loss.log_ratio);
    }
    __syncthreads();  // every thread has read maxes[0] and sums[0] before the next row rewrites them
  }
}

void check_list(const Tensor& list, int64_t begin, int64_t c, const char* op) {
  RETAIN_CHECK(list.dtype() == DType::I32 && list.ndim() == 2 && list.dim(0) == 2 && begin >= 0 &&
                   begin + c <= list.dim(1),
               "{}: list {} {} for rows [{}, {})", op, dtype_name(list.dtype()), shape_str(list.shape()), begin,
               begin + c);
}

void check_rows(const Tensor& rows, const Tensor& full, const char* op) {
  RETAIN_CHECK(rows.dtype() == DType::F32 && full.dtype() == DType::F32 && rows.ndim() == 2 && full.ndim() == 2 &&
                   rows.dim(1) == full.dim(1),
               "{}: rows {} {} for {} {}", op, dtype_name(rows.dtype()), shape_str(rows.shape()),
               dtype_name(full.dtype()), shape_str(full.shape()));
}

}  // namespace

void gather_loss_rows(const Tensor& src, const Tensor& list, int64_t begin, Tensor& dst) {
  check_rows(dst, src, "gather_loss_rows");
  const int64_t c = dst.dim(0), D = dst.dim(1), n = c * D;
  check_list(list, begin, c, "gather_loss_rows");
  if (n == 0) return;
  gather_kernel<<<elem_blocks(n), kElemThreads>>>(static_cast<const float*>(src.raw()),
                                                  static_cast<const int32_t*>(list.raw()) + begin, D, n,
                                                  static_cast<float*>(dst.raw()));
  CUDA_CHECK(cudaGetLastError());
}

void scatter_loss_rows(const Tensor& src, const Tensor& list, int64_t begin, Tensor& dst) {
  check_rows(src, dst, "scatter_loss_rows");
  const int64_t c = src.dim(0), D = src.dim(1), n = c * D;
  check_list(list, begin, c, "scatter_loss_rows");
  if (n == 0) return;
  scatter_kernel<<<elem_blocks(n), kElemThreads>>>(static_cast<const float*>(src.raw()),
                                                   static_cast<const int32_t*>(list.raw()) + begin, D, n,
                                                   static_cast<float*>(dst.raw()));
  CUDA_CHECK(cudaGetLastError());
}

void kl_ntp_rows(const Tensor& teacher_logits, Tensor& student_logits, const Tensor& list, int64_t begin,
                 double kl_scale, double ntp_scale, bool gradient, Tensor& row_losses, ops::KlDirection kl) {
  RETAIN_CHECK(teacher_logits.dtype() == DType::F32 && teacher_logits.ndim() == 2 &&
                   student_logits.dtype() == DType::F32 && student_logits.shape() == teacher_logits.shape(),
               "kl_ntp_rows: teacher {} {} student {} {}", dtype_name(teacher_logits.dtype()),
               shape_str(teacher_logits.shape()), dtype_name(student_logits.dtype()),
               shape_str(student_logits.shape()));
  const int64_t c = teacher_logits.dim(0), V = teacher_logits.dim(1), P = list.dim(1);
  check_list(list, begin, c, "kl_ntp_rows");
  RETAIN_CHECK(row_losses.dtype() == DType::F64 && row_losses.shape() == Shape({2, P}),
               "kl_ntp_rows: row_losses {} {} for {} positions", dtype_name(row_losses.dtype()),
               shape_str(row_losses.shape()), P);
  RETAIN_CHECK(V > 0, "kl_ntp_rows: empty vocabulary");
  if (c == 0) return;
  const unsigned blocks = static_cast<unsigned>(c < kMaxRowBlocks ? c : kMaxRowBlocks);
  double* out = static_cast<double*>(row_losses.raw());
  kl_ntp_rows_kernel<<<blocks, kLossThreads>>>(
      static_cast<const float*>(teacher_logits.raw()), static_cast<float*>(student_logits.raw()),
      static_cast<const int32_t*>(list.raw()) + P + begin, c, V, grad_scales(kl_scale, ntp_scale, kl == ops::KlDirection::reverse), gradient,
      out + begin, out + P + begin);
  CUDA_CHECK(cudaGetLastError());
}

// The chunk loop of ops::kl_ntp_chunked on the device (kernels/loss.cpp describes the steps): no
// [T, V] buffer and no host synchronisation until the one copy of the per-row losses at the end.
ops::QualitySums kl_ntp_chunked(const Tensor& teacher_hidden, const Tensor& student_hidden, const Tensor& lm_head,
                                const ops::LossPositions& lp, int64_t chunk, double kl_scale, double ntp_scale,
                                Tensor* d_student_hidden, ops::KlDirection direction) {
  const int64_t D = teacher_hidden.dim(1), V = lm_head.dim(0), P = static_cast<int64_t>(lp.pos.size());
  RETAIN_CHECK(teacher_hidden.dim(0) <= std::numeric_limits<int32_t>::max(),
               "kl_ntp_chunked: {} tokens do not fit the device's int32 positions", teacher_hidden.dim(0));
  // One upload per call: the positions, then their targets.
  std::vector<int32_t> host(static_cast<size_t>(2 * P));
  for (int64_t i = 0; i < P; ++i) {
    host[static_cast<size_t>(i)] = static_cast<int32_t>(lp.pos[static_cast<size_t>(i)]);
    host[static_cast<size_t>(P + i)] = lp.target[static_cast<size_t>(i)];
  }
  const Tensor list = Tensor::from_vector(host, {2, P}).to(Device::CUDA);

  const int64_t C = std::min(chunk, P);
  Tensor th = Tensor::empty({C, D}, DType::F32, Device::CUDA), sh = Tensor::empty({C, D}, DType::F32, Device::CUDA);
  Tensor lt = Tensor::empty({C, V}, DType::F32, Device::CUDA), ls = Tensor::empty({C, V}, DType::F32, Device::CUDA);
  Tensor dh = d_student_hidden ? Tensor::empty({C, D}, DType::F32, Device::CUDA) : Tensor();
  Tensor row_losses = Tensor::empty({2, P}, DType::F64, Device::CUDA);
  for (int64_t s0 = 0; s0 < P; s0 += C) {
    const int64_t c = std::min(C, P - s0);
    Tensor thc = th.rows(0, c), shc = sh.rows(0, c), ltc = lt.rows(0, c), lsc = ls.rows(0, c);
    gather_loss_rows(teacher_hidden, list, s0, thc);
    gather_loss_rows(student_hidden, list, s0, shc);
    ops::linear(thc, lm_head, ltc);
    ops::linear(shc, lm_head, lsc);
    kl_ntp_rows(ltc, lsc, list, s0, kl_scale, ntp_scale, d_student_hidden != nullptr, row_losses, direction);
    if (!d_student_hidden) continue;
    Tensor dhc = dh.rows(0, c);
    ops::linear_backward_input(lsc, lm_head, dhc);
    scatter_loss_rows(dhc, list, s0, *d_student_hidden);
  }

  // The one device→host copy; the rows summed in position order, as on the CPU.
  const Tensor losses = row_losses.to(Device::CPU);
  const double* kl = losses.data<double>();
  ops::QualitySums sums;
  sums.positions = P;
  for (int64_t i = 0; i < P; ++i) {
    sums.kl += kl[i];
    sums.ntp += kl[P + i];
  }
  return sums;
}

}  // namespace retain::cuda
