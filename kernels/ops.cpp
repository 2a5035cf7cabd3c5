// Shape/dtype/device checks and device dispatch for kernels/ops.h.
#include "kernels/ops.h"

#include "kernels/cpu/ops_cpu.h"
#include "kernels/require_cpu.h"
#ifdef RETAIN_CUDA_KERNELS
#include "kernels/cuda/gemm_cuda.h"
#include "kernels/cuda/ops_cuda.h"
#endif

namespace retain::ops {

namespace {

void expect(const Tensor& t, DType dtype, int64_t ndim, const char* op, const char* what) {
  RETAIN_CHECK(t.dtype() == dtype && t.ndim() == ndim, "{}: {} must be {}-d {}, got {} {}", op, what,
               ndim, dtype_name(dtype), dtype_name(t.dtype()), shape_str(t.shape()));
}

// Every tensor of a call on one device (the first one's); returns it. Ops with CUDA kernels
// (kernels/cuda/ops.cu, gemm.cu) run there when it is CUDA.
Device one_device(const char* op, std::initializer_list<const Tensor*> ts) {
  const Device device = (*ts.begin())->device();
  for (const Tensor* t : ts)
    if (t->device() != device)
      fail("{}: all tensors must be on one device (one is on {}, another on {})", op, device_name(device),
           device_name(t->device()));
  return device;
}

// A GEMM weight: 2-d, F32 or BF16 (the GPU trainer's frozen weights stay bf16).
void expect_weight(const Tensor& w, const char* op) {
  RETAIN_CHECK((w.dtype() == DType::F32 || w.dtype() == DType::BF16) && w.ndim() == 2,
               "{}: w must be 2-d F32 or BF16, got {} {}", op, dtype_name(w.dtype()), shape_str(w.shape()));
}

// Whether two tensors' bytes overlap (a view of the same buffer counts, not only the same start).
bool overlap(const Tensor& a, const Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto pa = reinterpret_cast<uintptr_t>(a.raw()), pb = reinterpret_cast<uintptr_t>(b.raw());
  return pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

}  // namespace

// CUDA tensors go to kernels/cuda/ (ops_cuda.h, gemm_cuda.h); a build without those kernels (CPU-only, or the ASan
// test build of this file) says so in one line, as require_cpu does.
#ifdef RETAIN_CUDA_KERNELS
#define RETAIN_CUDA_OP(op, call) \
  do {                           \
    cuda::call;                  \
    return;                      \
  } while (0)
#else
#define RETAIN_CUDA_OP(op, call) fail("{}: no CUDA implementation of this op yet", op)
#endif

void embedding(const Tensor& table, const Tensor& ids, Tensor& out) {
  RETAIN_CHECK(table.ndim() == 2, "embedding: table must be 2-d, got {}", shape_str(table.shape()));
  expect(ids, DType::I32, 1, "embedding", "ids");
  expect(out, DType::F32, 2, "embedding", "out");
  RETAIN_CHECK(out.dim(0) == ids.dim(0) && out.dim(1) == table.dim(1), "embedding: out {} for ids {} table {}",
               shape_str(out.shape()), shape_str(ids.shape()), shape_str(table.shape()));
  if (one_device("embedding", {&table, &ids, &out}) == Device::CUDA)
    RETAIN_CUDA_OP("embedding", embedding(table, ids, out));
  cpu::embedding(table, ids, out);
}

void linear(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate) {
  RETAIN_CHECK((x.dtype() == DType::F32 || x.dtype() == DType::BF16) && x.ndim() == 2,
               "linear: x must be 2-d F32 or BF16, got {} {}", dtype_name(x.dtype()), shape_str(x.shape()));
  expect_weight(w, "linear");
  expect(y, DType::F32, 2, "linear", "y");
  RETAIN_CHECK(x.dim(1) == w.dim(1) && y.dim(0) == x.dim(0) && y.dim(1) == w.dim(0),
               "linear: x {} w {} y {}", shape_str(x.shape()), shape_str(w.shape()), shape_str(y.shape()));
  RETAIN_CHECK(!overlap(y, x) && !overlap(y, w), "linear: y must not alias x or w");
  if (one_device("linear", {&x, &w, &y}) == Device::CUDA) RETAIN_CUDA_OP("linear", linear(x, w, y, accumulate));
  cpu::linear(x, w, y, accumulate);
}

void linear_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, bool accumulate) {
  expect(dy, DType::F32, 2, "linear_backward_weight", "dy");
  expect(x, DType::F32, 2, "linear_backward_weight", "x");
  expect(dw, DType::F32, 2, "linear_backward_weight", "dw");
  RETAIN_CHECK(dy.dim(0) == x.dim(0) && dw.dim(0) == dy.dim(1) && dw.dim(1) == x.dim(1),
               "linear_backward_weight: dy {} x {} dw {}", shape_str(dy.shape()), shape_str(x.shape()),
               shape_str(dw.shape()));
  RETAIN_CHECK(!overlap(dw, dy) && !overlap(dw, x), "linear_backward_weight: dw must not alias dy or x");
  if (one_device("linear_backward_weight", {&dy, &x, &dw}) == Device::CUDA)
    RETAIN_CUDA_OP("linear_backward_weight", linear_backward_weight(dy, x, dw, accumulate));
  cpu::linear_backward_weight(dy, x, dw, accumulate);
}

void cast(const Tensor& src, Tensor& dst) {
  const auto is_float = [](DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; };
  RETAIN_CHECK(is_float(src.dtype()) && is_float(dst.dtype()) && src.shape() == dst.shape(),
               "cast: src {} {} dst {} {} (F32, BF16 or F16, one shape)", dtype_name(src.dtype()),
               shape_str(src.shape()), dtype_name(dst.dtype()), shape_str(dst.shape()));
  RETAIN_CHECK(src.dtype() == dst.dtype() ? (src.raw() == dst.raw() || !overlap(src, dst)) : !overlap(src, dst),
               "cast: dst must not alias src ({} to {})", dtype_name(src.dtype()), dtype_name(dst.dtype()));
  if (one_device("cast", {&src, &dst}) == Device::CUDA) RETAIN_CUDA_OP("cast", cast(src, dst));
  cpu::cast(src, dst);
}

void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor& out) {
  expect(w, DType::F32, 1, "rmsnorm", "w");
  RETAIN_CHECK(x.dtype() == DType::F32 && x.ndim() >= 1 && x.dim(-1) == w.dim(0) && out.shape() == x.shape() &&
                   out.dtype() == DType::F32,
               "rmsnorm: x {} w {} out {}", shape_str(x.shape()), shape_str(w.shape()), shape_str(out.shape()));
  if (one_device("rmsnorm", {&x, &w, &out}) == Device::CUDA)
    RETAIN_CUDA_OP("rmsnorm", rmsnorm(x, w, eps, out));
  cpu::rmsnorm(x, w, eps, out);
}

void rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, float attention_factor) {
  expect(x, DType::F32, 3, "rope", "x");
  expect(positions, DType::I32, 1, "rope", "positions");
  expect(inv_freq, DType::F32, 1, "rope", "inv_freq");
  RETAIN_CHECK(x.dim(0) == positions.dim(0) && x.dim(2) % 2 == 0 && inv_freq.dim(0) * 2 == x.dim(2),
               "rope: x {} positions {} inv_freq {}", shape_str(x.shape()), shape_str(positions.shape()),
               shape_str(inv_freq.shape()));
  if (one_device("rope", {&x, &positions, &inv_freq}) == Device::CUDA)
    RETAIN_CUDA_OP("rope", rope(x, positions, inv_freq, attention_factor));
  cpu::rope(x, positions, inv_freq, attention_factor);
}

void swiglu(const Tensor& gate, const Tensor& up, Tensor& out) {
  RETAIN_CHECK(gate.dtype() == DType::F32 && gate.shape() == up.shape() && up.dtype() == DType::F32 &&
                   out.shape() == gate.shape() && out.dtype() == DType::F32,
               "swiglu: gate {} up {} out {}", shape_str(gate.shape()), shape_str(up.shape()), shape_str(out.shape()));
  if (one_device("swiglu", {&gate, &up, &out}) == Device::CUDA)
    RETAIN_CUDA_OP("swiglu", swiglu(gate, up, out));
  cpu::swiglu(gate, up, out);
}

void add_inplace(Tensor& x, const Tensor& y) {
  RETAIN_CHECK((x.dtype() == DType::F32 || x.dtype() == DType::F64) && y.dtype() == x.dtype() &&
                   x.shape() == y.shape(),
               "add: x {} {} y {} {} (both F32 or both F64, one shape)", dtype_name(x.dtype()), shape_str(x.shape()),
               dtype_name(y.dtype()), shape_str(y.shape()));
  if (one_device("add_inplace", {&x, &y}) == Device::CUDA)
    RETAIN_CUDA_OP("add_inplace", add_inplace(x, y));
  cpu::add_inplace(x, y);
}

void fill(Tensor& x, double value) {
  RETAIN_CHECK(x.dtype() == DType::F32 || x.dtype() == DType::F64, "fill: x is {} (F32 or F64)",
               dtype_name(x.dtype()));
  if (one_device("fill", {&x}) == Device::CUDA) RETAIN_CUDA_OP("fill", fill(x, value));
  cpu::fill(x, value);
}

void scale_to_f32(const Tensor& src, double scale, Tensor& dst) {
  RETAIN_CHECK(src.dtype() == DType::F64 && dst.dtype() == DType::F32 && src.numel() == dst.numel(),
               "scale_to_f32: src {} {} dst {} {} (F64 to F32, one element count)", dtype_name(src.dtype()),
               shape_str(src.shape()), dtype_name(dst.dtype()), shape_str(dst.shape()));
  if (one_device("scale_to_f32", {&src, &dst}) == Device::CUDA)
    RETAIN_CUDA_OP("scale_to_f32", scale_to_f32(src, scale, dst));
  cpu::scale_to_f32(src, scale, dst);
}

namespace {
// a [T, A], b [T, B] and the joined [T, A + B], all F32 on one device; returns the device.
Device check_columns(const char* op, const Tensor& a, const Tensor& b, const Tensor& joined) {
  RETAIN_CHECK(a.dtype() == DType::F32 && b.dtype() == DType::F32 && joined.dtype() == DType::F32 && a.ndim() == 2 &&
                   b.ndim() == 2 && joined.ndim() == 2 && b.dim(0) == a.dim(0) && joined.dim(0) == a.dim(0) &&
                   joined.dim(1) == a.dim(1) + b.dim(1),
               "{}: parts {} {} {} {}, joined {} {} (F32 [T, A], [T, B] and [T, A + B])", op, dtype_name(a.dtype()),
               shape_str(a.shape()), dtype_name(b.dtype()), shape_str(b.shape()), dtype_name(joined.dtype()),
               shape_str(joined.shape()));
  RETAIN_CHECK(!overlap(joined, a) && !overlap(joined, b), "{}: the joined tensor overlaps a part", op);
  return one_device(op, {&a, &b, &joined});
}
}  // namespace

void concat_columns(const Tensor& a, const Tensor& b, Tensor& out) {
  if (check_columns("concat_columns", a, b, out) == Device::CUDA)
    RETAIN_CUDA_OP("concat_columns", concat_columns(a, b, out));
  cpu::concat_columns(a, b, out);
}

void split_columns_add(const Tensor& src, Tensor& da, Tensor& db) {
  if (check_columns("split_columns_add", da, db, src) == Device::CUDA)
    RETAIN_CUDA_OP("split_columns_add", split_columns_add(src, da, db));
  cpu::split_columns_add(src, da, db);
}

void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& doc, float scale, Tensor& out) {
  expect(q, DType::F32, 3, "attention", "q");
  expect(k, DType::F32, 3, "attention", "k");
  expect(v, DType::F32, 3, "attention", "v");
  expect(doc, DType::I32, 1, "attention", "doc");
  int64_t T = q.dim(0), H = q.dim(1), K = k.dim(1), d = q.dim(2);
  RETAIN_CHECK(k.shape() == v.shape() && k.dim(0) == T && k.dim(2) == d && K > 0 && H % K == 0 &&
                   doc.dim(0) == T && out.shape() == q.shape() && out.dtype() == DType::F32,
               "attention: q {} k {} v {} doc {} out {}", shape_str(q.shape()), shape_str(k.shape()),
               shape_str(v.shape()), shape_str(doc.shape()), shape_str(out.shape()));
  require_cpu("attention", {&q, &k, &v, &doc, &out});
  cpu::attention(q, k, v, doc, scale, out);
}

Tensor document_positions(const Tensor& doc) {
  expect(doc, DType::I32, 1, "document_positions", "doc");
  require_cpu("document_positions", {&doc});
  Tensor pos = Tensor::empty(doc.shape(), DType::I32);
  const int32_t* d = doc.data<int32_t>();
  int32_t* p = pos.data<int32_t>();
  // Documents are contiguous runs in packed data, so a position is the distance to the
  // start of the current run of equal ids.
  for (int64_t t = 0; t < doc.dim(0); ++t)
    p[t] = (d[t] < 0) ? 0 : (t > 0 && d[t - 1] == d[t] ? p[t - 1] + 1 : 0);
  return pos;
}

// Backward ops (CPU reference in cpu/ops_backward.cpp).

void linear_backward_input(const Tensor& dy, const Tensor& w, Tensor& dx, bool accumulate) {
  expect(dy, DType::F32, 2, "linear_backward_input", "dy");
  expect_weight(w, "linear_backward_input");
  expect(dx, DType::F32, 2, "linear_backward_input", "dx");
  RETAIN_CHECK(dy.dim(1) == w.dim(0) && dx.dim(0) == dy.dim(0) && dx.dim(1) == w.dim(1),
               "linear_backward_input: dy {} w {} dx {}", shape_str(dy.shape()), shape_str(w.shape()),
               shape_str(dx.shape()));
  RETAIN_CHECK(!overlap(dx, dy) && !overlap(dx, w), "linear_backward_input: dx must not alias dy or w");
  if (one_device("linear_backward_input", {&dy, &w, &dx}) == Device::CUDA)
    RETAIN_CUDA_OP("linear_backward_input", linear_backward_input(dy, w, dx, accumulate));
  cpu::linear_backward_input(dy, w, dx, accumulate);
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, float eps, const Tensor& dy, Tensor& dx, bool accumulate) {
  expect(w, DType::F32, 1, "rmsnorm_backward", "w");
  RETAIN_CHECK(x.dtype() == DType::F32 && x.ndim() >= 1 && x.dim(-1) == w.dim(0) && dy.dtype() == DType::F32 &&
                   dy.shape() == x.shape() && dx.dtype() == DType::F32 && dx.shape() == x.shape(),
               "rmsnorm_backward: x {} w {} dy {} dx {}", shape_str(x.shape()), shape_str(w.shape()),
               shape_str(dy.shape()), shape_str(dx.shape()));
  RETAIN_CHECK(x.numel() == 0 || dx.raw() != x.raw(), "rmsnorm_backward: dx must not alias x");
  RETAIN_CHECK(!accumulate || x.numel() == 0 || !overlap(dx, dy), "rmsnorm_backward: an accumulated dx must not alias dy");
  if (one_device("rmsnorm_backward", {&x, &w, &dy, &dx}) == Device::CUDA)
    RETAIN_CUDA_OP("rmsnorm_backward", rmsnorm_backward(x, w, eps, dy, dx, accumulate));
  cpu::rmsnorm_backward(x, w, eps, dy, dx, accumulate);
}

void rope_backward(Tensor& dx, const Tensor& positions, const Tensor& inv_freq, float attention_factor) {
  expect(dx, DType::F32, 3, "rope_backward", "dx");
  expect(positions, DType::I32, 1, "rope_backward", "positions");
  expect(inv_freq, DType::F32, 1, "rope_backward", "inv_freq");
  RETAIN_CHECK(dx.dim(0) == positions.dim(0) && dx.dim(2) % 2 == 0 && inv_freq.dim(0) * 2 == dx.dim(2),
               "rope_backward: dx {} positions {} inv_freq {}", shape_str(dx.shape()), shape_str(positions.shape()),
               shape_str(inv_freq.shape()));
  if (one_device("rope_backward", {&dx, &positions, &inv_freq}) == Device::CUDA)
    RETAIN_CUDA_OP("rope_backward", rope_backward(dx, positions, inv_freq, attention_factor));
  cpu::rope_backward(dx, positions, inv_freq, attention_factor);
}

void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate, Tensor& dup) {
  const Shape& s = gate.shape();
  RETAIN_CHECK(gate.dtype() == DType::F32 && up.dtype() == DType::F32 && dout.dtype() == DType::F32 &&
                   dgate.dtype() == DType::F32 && dup.dtype() == DType::F32 && up.shape() == s && dout.shape() == s &&
                   dgate.shape() == s && dup.shape() == s,
               "swiglu_backward: gate {} up {} dout {} dgate {} dup {}", shape_str(s), shape_str(up.shape()),
               shape_str(dout.shape()), shape_str(dgate.shape()), shape_str(dup.shape()));
  RETAIN_CHECK(gate.numel() == 0 || dgate.raw() != dup.raw(), "swiglu_backward: dgate and dup must not alias");
  if (one_device("swiglu_backward", {&gate, &up, &dout, &dgate, &dup}) == Device::CUDA)
    RETAIN_CUDA_OP("swiglu_backward", swiglu_backward(gate, up, dout, dgate, dup));
  cpu::swiglu_backward(gate, up, dout, dgate, dup);
}

}  // namespace retain::ops
