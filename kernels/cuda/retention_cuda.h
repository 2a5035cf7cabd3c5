// CUDA entry points of the retention ops (kernels/retention.h dispatches to them for CUDA
// tensors after checking shapes, dtypes, devices and log_beta values). Compiled only in CUDA
// builds: kernels/CMakeLists.txt defines RETAIN_CUDA_KERNELS on retain_kernels there, and
// kernels/retention.cpp includes this header and calls into it only under that definition.
#pragma once
#include <cstdint>
#include <string>

#include "kernels/deferred_checks.h"
#include "kernels/retention.h"
#include "kernels/tensor.h"

namespace retain::cuda {

// ---- retention-gated attention (kernels/cuda/gated_attention.cu) -------------------------
// Same math and shapes as ops::gated_attention / ops::gated_attention_backward; every tensor
// on the CUDA device, contiguous, 16-byte aligned. q, k, v, out, dout, dq, dk, dv BF16;
// log_beta, lse, dlog_beta F32; doc I32. head_dim d ∈ {64, 128}. fp32 accumulation on
// tensor cores (mma.sync m16n8k16 bf16). Runs on the current device's default stream and
// returns without synchronizing (errors of the launch itself are raised).
// skip_weight_below = ε ∈ (0, 1) turns on an approximation (off, exact, at the default 0):
// key tiles whose every weight exp((t − i)·logβ_i) is below ε are skipped; pass the same ε to
// the backward, which is then the exact gradient of the skipping forward. A row loses softmax
// mass δ_t ≤ ε·Σ_{i skipped} exp(a_ti − a_tt) (a = q·k·scale) and ‖Δout_t‖ ≤ 2·δ_t·max‖v‖
// (kernels/cuda/attention_tiles.h states the sharper a-posteriori form; both are tested there).
void gated_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& log_beta,
                     const Tensor& doc, float scale, Tensor& out, Tensor& lse,
                     float skip_weight_below = 0.0f);
void gated_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& log_beta, const Tensor& doc, float scale,
                              const Tensor& out, const Tensor& lse, const Tensor& dout,
                              Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dlog_beta,
                              float skip_weight_below = 0.0f);

// Whether this device runs the wgmma kernels: an sm_90 GPU (H100/H200) that loaded sm_90a code
// for them (a probe kernel asks the device once; a build without 90a among its architectures
// has only traps there). wgmma_unavailable_reason says why not, or is empty. The environment
// variables RETAIN_ATTENTION_FORWARD and RETAIN_ATTENTION_BACKWARD pick each pass's kernels:
// mma (mma.sync), wgmma (Hopper's warpgroup products) or auto (unset: wgmma where it runs,
// else mma; mma on the CUDA emulator); any other value is an error, and wgmma where it cannot
// run is one too, naming the reason.
bool wgmma_supported();
std::string wgmma_unavailable_reason();
// The kernels the forward (backward) pass runs on this device as those variables pick them:
// "mma" or "wgmma" (fails as the pass would on a bad value).
std::string attention_kernels(bool backward);

// The span pairs of context parallelism (kernels/retention_spans.h's ops, same math): q, k, v,
// dout BF16; out, lse, dq, dk, dv, dlog_beta F32 (the partial and merged rows, the gradient
// sums, which the backward ADDS to); docs I32. The keys are the queries' own span (q_start =
// k_start, equal lengths and documents), a wholly earlier one (every tile a rectangle: each
// key before each query, decay (q_start − k_start + a − b)·logβ), or one wholly after them
// (nothing allowed); any other overlap is an error. No weight skip. Unverified on a GPU
// (emulated: tests/cuda/test_attention_span_cuda.cpp).
void gated_attention_span(const Tensor& q, const Tensor& q_doc, int64_t q_start, const Tensor& k, const Tensor& v,
                          const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, float scale, Tensor& out,
                          Tensor& lse);
void gated_attention_span_backward(const Tensor& q, const Tensor& q_doc, int64_t q_start, const Tensor& k,
                                   const Tensor& v, const Tensor& log_beta, const Tensor& k_doc, int64_t k_start,
                                   float scale, const Tensor& out, const Tensor& lse, const Tensor& dout, Tensor& dq,
                                   Tensor& dk, Tensor& dv, Tensor& dlog_beta);
// (out, lse) F32 [R, H, d], [R, H] ← merged with a part's (kernels/cuda/attention_merge.cu).
void merge_attention(Tensor& out, Tensor& lse, const Tensor& part_out, const Tensor& part_lse);

// ---- end of retention-gated attention ----------------------------------------------------

// ---- capacity sums and hinge (kernels/cuda/capacity.cu) ----------------------------------
// Same math and shapes as ops::capacity_sums / capacity_loss / capacity_loss_backward (the CPU
// reference, kernels/cpu/capacity.cpp), every tensor on the CUDA device: log_beta F32
// [L, T, K] (already checked ≤ 0), doc and positions I32 [T], S and dlog_beta F32 [L, T, K].
// Float64 accumulation of float32 partials (≤ 64 terms each); results are deterministic
// (fixed reduction orders, no atomics). Default stream; capacity_loss synchronizes to return
// its two numbers, the others return after the launches (temporaries are freed with
// cudaFree, which waits for the device).
void capacity_sums(const Tensor& log_beta, const Tensor& doc, Tensor& S, double skip_exponent);
ops::CapacityLoss capacity_loss(const Tensor& log_beta, const Tensor& doc, const Tensor& positions,
                                double memory, ops::CapacityMode mode, double skip_exponent);
void capacity_loss_backward(const Tensor& log_beta, const Tensor& doc, const Tensor& positions,
                            double memory, ops::CapacityMode mode, double scale, Tensor& dlog_beta,
                            double skip_exponent);
// The span pairs of context parallelism (kernels/retention_spans.h's capacity ops, same math and
// dtypes: log_beta F32, docs and positions I32, S, g and dlog_beta F64; S and dlog_beta are
// ADDED to), the keys the rows' own span, a wholly earlier one or one wholly after them (nothing
// to add); any other overlap is an error. capacity_hinge synchronizes to return its two
// numbers. Unverified on a GPU (emulated: tests/cuda/test_capacity_span_cuda.cpp).
void capacity_sums_span(const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, const Tensor& q_doc,
                        int64_t q_start, Tensor& S, double skip_exponent);
ops::CapacityLoss capacity_hinge(const Tensor& S, const Tensor& doc, const Tensor& positions, double memory,
                                 ops::CapacityMode mode, Tensor* g);
void capacity_grad_span(const Tensor& log_beta, const Tensor& k_doc, int64_t k_start, const Tensor& q_doc,
                        int64_t q_start, const Tensor& g, Tensor& dlog_beta, double skip_exponent);
// ---- end of capacity ---------------------------------------------------------------------

// The device that runs kernels/deferred_checks.h's scans (kernels/cuda/deferred_checks.cu).
ops::DeferredCheckDevice& deferred_check_device();

}  // namespace retain::cuda
