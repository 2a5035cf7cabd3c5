// The ring ops of context parallelism (trainer/context_parallel.h) over kernels/retention_spans.h.
//
// A ring step: every rank holds one rank's keys (a "packet": its two chunks' keys, values,
// logβ and document ids in a flat buffer, sized for the largest rank so that every rank
// shifts the same byte count), computes its query chunks against that rank's key chunks, and
// passes the packet on to the next rank while receiving the previous rank's. Each step starts
// the next shift before computing, so the transfer overlaps the tiles. In the backward the keys'
// gradient sums travel a second ring one step behind the keys (LaggedSums), so that their
// transfers overlap the tiles too; one last shift after the N steps takes them home.
#include "trainer/context_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/base/fault.h"
#include "kernels/kvpop.h"
#include "kernels/ops.h"
#include "kernels/retention_spans.h"

namespace retain::trainer {

ContextLayout::ContextLayout(int64_t T, int ranks) : T_(T), ranks_(ranks) {
  if (ranks < 1) fail("context parallelism: {} ranks is not ≥ 1", ranks);
  if (T < 2 * static_cast<int64_t>(ranks))
    fail("context parallelism: a sequence of {} tokens cannot be cut into 2 × {} chunks (it needs ≥ {} tokens)", T,
         ranks, 2 * static_cast<int64_t>(ranks));
}

std::array<TokenSpan, 2> ContextLayout::spans(int rank) const {
  if (rank < 0 || rank >= ranks_) fail("context parallelism: rank {} is not in [0, {})", rank, ranks_);
  const int64_t front = rank, back = 2 * static_cast<int64_t>(ranks_) - 1 - rank;
  return {TokenSpan{chunk_begin(front), chunk_begin(front + 1) - chunk_begin(front)},
          TokenSpan{chunk_begin(back), chunk_begin(back + 1) - chunk_begin(back)}};
}

int64_t ContextLayout::local_tokens(int rank) const {
  const auto s = spans(rank);
  return s[0].length + s[1].length;
}

int64_t ContextLayout::max_local_tokens() const {
  int64_t m = 0;
  for (int r = 0; r < ranks_; ++r) m = std::max(m, local_tokens(r));
  return m;
}

namespace {

// Elements of one index of dimension `dim` and the count of indices before it.
struct Strides {
  int64_t outer, inner;
};
Strides strides(const Tensor& t, int64_t dim) {
  int64_t outer = 1, inner = 1;
  for (int64_t a = 0; a < dim; ++a) outer *= t.dim(a);
  for (int64_t a = dim + 1; a < t.ndim(); ++a) inner *= t.dim(a);
  return {outer, inner};
}

// Copies indices [from, from + n) of dimension dim of src into [to, to + n) of dst (same dtype,
// same sizes in every other dimension).
// Either tensor may be on either device (a device copy per index before `dim`).
void copy_range(const Tensor& src, int64_t from, Tensor& dst, int64_t to, int64_t n, int64_t dim) {
  const Strides s = strides(src, dim);
  const size_t es = dtype_size(src.dtype());
  const int64_t ns = src.dim(dim), nd = dst.dim(dim);
  const bool host = src.device() == Device::CPU && dst.device() == Device::CPU;
  for (int64_t o = 0; o < s.outer; ++o) {
    const size_t at_dst = static_cast<size_t>((o * nd + to) * s.inner) * es,
                 at_src = static_cast<size_t>((o * ns + from) * s.inner) * es, bytes = static_cast<size_t>(n * s.inner) * es;
    if (host) {
      std::memcpy(static_cast<char*>(dst.raw()) + at_dst, static_cast<const char*>(src.raw()) + at_src, bytes);
    } else if (bytes > 0) {
      const Shape run{n * s.inner};
      dst.view_bytes(at_dst, run, dst.dtype()).copy_from(src.view_bytes(at_src, run, src.dtype()));
    }
  }
}

// The exchange of KVPOP's heads runs on the host (the scorers' step is host work under context
// parallelism: trainer/kvpop_train.cpp).
void check_on_cpu(const char* op, const Tensor& t) {
  if (t.device() != Device::CPU) fail("{}: the items must be host tensors", op);
}

void check_dim(const char* op, const Tensor& t, int64_t dim, int64_t want) {
  if (t.ndim() <= dim || t.dim(dim) != want)
    fail("{}: a tensor of shape {} does not hold this rank's {} tokens in dimension {}", op, shape_str(t.shape()),
         want, dim);
}

}  // namespace

Tensor ContextLayout::local(const Tensor& whole, int rank, int64_t dim) const {
  check_dim("ContextLayout::local", whole, dim, T_);
  Shape shape = whole.shape();
  shape[static_cast<size_t>(dim)] = local_tokens(rank);
  Tensor out = Tensor::empty(shape, whole.dtype(), whole.device());
  int64_t at = 0;
  for (const TokenSpan& s : spans(rank)) {
    copy_range(whole, s.start, out, at, s.length, dim);
    at += s.length;
  }
  return out;
}

void ContextLayout::put_local(const Tensor& local, int rank, Tensor& whole, int64_t dim) const {
  check_dim("ContextLayout::put_local", local, dim, local_tokens(rank));
  check_dim("ContextLayout::put_local", whole, dim, T_);
  int64_t at = 0;
  for (const TokenSpan& s : spans(rank)) {
    copy_range(local, at, whole, s.start, s.length, dim);
    at += s.length;
  }
}

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A flat buffer of named tensors whose token dimension is sized for the largest rank; a
// rank's tensors occupy the start of their field, contiguous, with its own token count. Fields
// start 16-byte aligned (the CUDA attention kernels' loads), the bytes between them zero.
class Packet {
 public:
  // Adds a field of `per_token` elements per token (times `outer` blocks: [outer, T, ...]).
  int add(DType dtype, int64_t per_token, int64_t max_tokens, int64_t outer = 1) {
    offsets_.push_back(bytes_);
    dtypes_.push_back(dtype);
    bytes_ += (static_cast<size_t>(outer * max_tokens * per_token) * dtype_size(dtype) + 15) / 16 * 16;
    return static_cast<int>(offsets_.size()) - 1;
  }
  size_t bytes() const { return bytes_; }
  size_t offset(int field) const { return offsets_[static_cast<size_t>(field)]; }
  Tensor view(const Tensor& buffer, int field, const Shape& shape) const {
    return buffer.view_bytes(offsets_[static_cast<size_t>(field)], shape, dtypes_[static_cast<size_t>(field)]);
  }
  Tensor buffer(Device device) const {
    return Tensor::zeros({static_cast<int64_t>(std::max<size_t>(bytes_, 16))}, DType::U8, device);
  }

 private:
  std::vector<size_t> offsets_;
  std::vector<DType> dtypes_;
  size_t bytes_ = 0;
};

// A rank's chunk i in its local rows: [offset, offset + length) of the local dimension.
int64_t local_offset(const std::array<TokenSpan, 2>& s, int i) { return i == 0 ? 0 : s[0].length; }

// The key chunk lies wholly after the query chunk: no allowed pair (causal).
bool after(const TokenSpan& keys, const TokenSpan& queries) { return keys.start >= queries.end(); }

// f(qi, ki, q0, k0) for every pair of this rank's query chunk qi and a source rank's key chunk
// ki that can hold an allowed pair (the keys not wholly after the queries); q0 and k0 are the
// chunks' first rows in their ranks' local order.
template <typename F>
void for_each_pair(const std::array<TokenSpan, 2>& mine, const std::array<TokenSpan, 2>& theirs, F f) {
  for (int qi = 0; qi < 2; ++qi)
    for (int ki = 0; ki < 2; ++ki)
      if (!after(theirs[ki], mine[qi])) f(qi, ki, local_offset(mine, qi), local_offset(theirs, ki));
}

// The N steps of a ring: at step s this rank holds rank (r − s)'s packet in buffer `cur` of
// `packets` and body(s, r − s, cur) computes on it while the next step's packet is already on
// its way (sent ahead, waited for after the body).
template <typename Packets, typename Body>
void ring_steps(dist::Comm& group, int r, int N, Packets& packets, Body body) {
  int cur = 0;
  for (int step = 0; step < N; ++step) {
    std::unique_ptr<dist::Request> next;
    if (step + 1 < N) next = packets.shift(group, cur);
    body(step, (r - step + N) % N, cur);
    if (next) next->wait();
    cur ^= 1;
  }
}

struct Group {
  int rank, ranks;
};
Group check_group(const char* op, dist::Comm& group, const ContextLayout& layout) {
  if (group.size() != layout.ranks())
    fail("{}: the group has {} ranks, the layout {}", op, group.size(), layout.ranks());
  return {group.rank(), group.size()};
}

// A ring's packets of per-token fields, double-buffered: field f holds a rank's tokens
// ([tokens, per-token shape...], sized for the largest rank so that every rank shifts the same
// byte count); buffer `cur` goes to the next rank while the previous rank's arrives in the other.
// The attention rings carry a rank's keys, values, logβ and document ids (its two chunks in local
// order: the ops take row ranges of them); the target ring its queries, their lse and documents.
class TokenPackets {
 public:
  TokenPackets(const ContextLayout& layout, std::vector<std::pair<DType, Shape>> fields, Device device)
      : fields_(std::move(fields)) {
    for (const auto& [dtype, per_token] : fields_) p_.add(dtype, shape_numel(per_token), layout.max_local_tokens());
    buf_ = {p_.buffer(device), p_.buffer(device)};
  }
  // This rank's tensors, one per field in order, into the first buffer.
  void pack(std::initializer_list<const Tensor*> tensors) {
    int f = 0;
    for (const Tensor* t : tensors) p_.view(buf_[0], f++, t->shape()).copy_from(*t);
  }
  // Buffer `cur` to the next rank, the previous rank's into the other buffer.
  std::unique_ptr<dist::Request> shift(dist::Comm& group, int cur) {
    return group.ring_shift_bytes_async(buf_[cur].raw(), buf_[cur ^ 1].raw(), p_.bytes());
  }
  // Field f of buffer cur, for a rank holding `tokens` tokens.
  Tensor field(int cur, int f, int64_t tokens) const {
    Shape shape{tokens};
    const Shape& per_token = fields_[static_cast<size_t>(f)].second;
    shape.insert(shape.end(), per_token.begin(), per_token.end());
    return p_.view(buf_[cur], f, shape);
  }

 private:
  std::vector<std::pair<DType, Shape>> fields_;
  Packet p_;
  std::array<Tensor, 2> buf_;
};

// The attention rings' packets: a rank's keys and values (F32 on the CPU, BF16 on CUDA), logβ
// and document ids, on k's device.
enum KeyField { kKeys, kValues, kLogBeta, kKeyDocs };
TokenPackets attention_keys(const ContextLayout& layout, const Tensor& k) {
  const int64_t K = k.dim(1), d = k.dim(2);
  return TokenPackets(layout, {{k.dtype(), {K, d}}, {k.dtype(), {K, d}}, {DType::F32, {K}}, {DType::I32, {}}},
                      k.device());
}

// Gradient sums that travel a ring one step behind the keys they belong to. At step s a rank
// adds its part for that step's keys into `mine()` (zeroed by begin_step) while, in the same
// shift, it receives the sums its predecessors made for those keys and passes on the sums it
// finished for the previous step's; end_step waits for that shift and adds. So each shift
// overlaps a step's tiles, where sums that moved after the tiles would wait for them at every
// step; only the last shift, which takes every sum home, waits (home()). Costs a third buffer.
// The buffers are flat F32 or F64 fields (a Packet), added element by element.
class LaggedSums {
 public:
  // `fields`: the sums' layout, every field of `dtype` (F32 or F64).
  LaggedSums(dist::Comm& group, const Packet& fields, DType dtype, Device device)
      : group_(group),
        bytes_(fields.bytes()),
        dtype_(dtype),
        in_(fields.buffer(device)),
        out_(fields.buffer(device)),
        mine_(fields.buffer(device)) {}
  Tensor& mine() { return mine_; }
  void begin_step(int step) {
    Tensor all = flat(mine_);
    ops::fill(all, 0.0);
    // (at step 0 the keys are this rank's own: nobody before it has sums for them)
    if (step > 0) shift_ = group_.ring_shift_bytes_async(out_.raw(), in_.raw(), bytes_);
  }
  void end_step(int step) {
    if (step == 0) {
      std::swap(out_, mine_);
      return;
    }
    shift_->wait();
    shift_.reset();
    add(in_, mine_);
    std::swap(out_, in_);  // the received sums, plus this rank's, go on at the next step
  }
  // After the last step: the sums of this rank's own keys, from every rank.
  const Tensor& home() {
    group_.ring_shift_bytes_async(out_.raw(), in_.raw(), bytes_)->wait();
    return in_;
  }

 private:
  // The fields are all F32 or all F64 (16-byte aligned, zero padding): one flat array.
  Tensor flat(const Tensor& buffer) const {
    return buffer.view_bytes(0, {static_cast<int64_t>(bytes_ / dtype_size(dtype_))}, dtype_);
  }
  void add(Tensor& into, const Tensor& from) {
    Tensor a = flat(into);
    ops::add_inplace(a, flat(from));
  }

  dist::Comm& group_;
  size_t bytes_;
  DType dtype_;
  Tensor in_, out_, mine_;
  std::unique_ptr<dist::Request> shift_;
};

}  // namespace

void ring_gated_attention(dist::Comm& group, const ContextLayout& layout, const Tensor& q, const Tensor& k,
                          const Tensor& v, const Tensor& log_beta, const Tensor& doc, float scale, Tensor& out,
                          Tensor& lse) {
  const char* op = "ring_gated_attention";
  const auto [r, N] = check_group(op, group, layout);
  if (fault::hangs_in_ring(r)) fault::hang_forever();  // tests only (kernels/base/fault.h)
  const int64_t Tl = layout.local_tokens(r);
  for (const Tensor* t : std::initializer_list<const Tensor*>{&q, &k, &v, &log_beta, &doc, &out, &lse})
    check_dim(op, *t, 0, Tl);
  const int64_t H = q.dim(1), d = k.dim(2);
  const Device dev = q.device();

  TokenPackets keys = attention_keys(layout, k);
  keys.pack({&k, &v, &log_beta, &doc});

  // The rows' running (out, lse): out itself on the CPU (F32); on CUDA an F32 sum, rounded into
  // the BF16 out at the end (the span kernels' partials are F32).
  Tensor acc = out.dtype() == DType::F32 ? out : Tensor::empty({Tl, H, d}, DType::F32, dev);
  ops::fill(acc, 0.0);
  ops::fill(lse, kNegInf);
  const auto mine = layout.spans(r);
  Tensor part_out = Tensor::empty({Tl, H, d}, DType::F32, dev), part_lse = Tensor::empty({Tl, H}, DType::F32, dev);
  ring_steps(group, r, N, keys, [&](int /*step*/, int src, int cur) {
    const int64_t Ts = layout.local_tokens(src);
    const Tensor ks = keys.field(cur, kKeys, Ts), vs = keys.field(cur, kValues, Ts),
                 ls = keys.field(cur, kLogBeta, Ts), ds = keys.field(cur, kKeyDocs, Ts);
    const auto theirs = layout.spans(src);
    for_each_pair(mine, theirs, [&](int qi, int ki, int64_t q0, int64_t k0) {
      const TokenSpan &qs = mine[qi], &kspan = theirs[ki];
      Tensor po = part_out.rows(0, qs.length), pl = part_lse.rows(0, qs.length);
      ops::gated_attention_span(q.rows(q0, q0 + qs.length), doc.rows(q0, q0 + qs.length), qs.start,
                                ks.rows(k0, k0 + kspan.length), vs.rows(k0, k0 + kspan.length),
                                ls.rows(k0, k0 + kspan.length), ds.rows(k0, k0 + kspan.length), kspan.start, scale,
                                po, pl);
      Tensor o = acc.rows(q0, q0 + qs.length), l = lse.rows(q0, q0 + qs.length);
      ops::merge_attention(o, l, po, pl);
    });
  });
  if (acc.raw() != out.raw()) ops::cast(acc, out);
}

void ring_gated_attention_backward(dist::Comm& group, const ContextLayout& layout, const Tensor& q,
                                   const Tensor& k, const Tensor& v, const Tensor& log_beta, const Tensor& doc,
                                   float scale, const Tensor& out, const Tensor& lse, const Tensor& dout,
                                   Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dlog_beta) {
  const char* op = "ring_gated_attention_backward";
  const auto [r, N] = check_group(op, group, layout);
  const int64_t Tl = layout.local_tokens(r), Tm = layout.max_local_tokens();
  for (const Tensor* t :
       std::initializer_list<const Tensor*>{&q, &k, &v, &log_beta, &doc, &out, &lse, &dout, &dq, &dk, &dv, &dlog_beta})
    check_dim(op, *t, 0, Tl);
  const int64_t K = k.dim(1), d = k.dim(2);
  const Device dev = q.device();
  // F32 on the CPU; on CUDA (BF16 activations) out is read as F32 and dq summed in F32, rounded
  // into the BF16 dq at the end (the span kernels take out F32 and add to F32 sums).
  const bool f32 = dq.dtype() == DType::F32;
  const auto as_f32 = [&](const Tensor& x) {
    Tensor y = Tensor::empty(x.shape(), DType::F32, dev);
    ops::cast(x, y);
    return y;
  };
  const Tensor out32 = f32 ? out : as_f32(out);
  Tensor dq32 = f32 ? dq : Tensor::empty(dq.shape(), DType::F32, dev);

  // The keys, each step's next packet sent ahead of the tiles; their gradient sums (dk, dv,
  // dlogβ; F32) in a ring one step behind them (LaggedSums).
  TokenPackets keys = attention_keys(layout, k);
  keys.pack({&k, &v, &log_beta, &doc});
  Packet g;
  const int gk = g.add(DType::F32, K * d, Tm), gv = g.add(DType::F32, K * d, Tm), gl = g.add(DType::F32, K, Tm);
  LaggedSums sums(group, g, DType::F32, dev);

  ops::fill(dq32, 0.0);
  const auto mine = layout.spans(r);
  ring_steps(group, r, N, keys, [&](int step, int src, int cur) {
    sums.begin_step(step);
    const int64_t Ts = layout.local_tokens(src);
    const Tensor ks = keys.field(cur, kKeys, Ts), vs = keys.field(cur, kValues, Ts),
                 ls = keys.field(cur, kLogBeta, Ts), ds = keys.field(cur, kKeyDocs, Ts);
    Tensor dks = g.view(sums.mine(), gk, {Ts, K, d}), dvs = g.view(sums.mine(), gv, {Ts, K, d}),
           dls = g.view(sums.mine(), gl, {Ts, K});
    const auto theirs = layout.spans(src);
    for_each_pair(mine, theirs, [&](int qi, int ki, int64_t q0, int64_t k0) {
      const int64_t q1 = q0 + mine[qi].length, k1 = k0 + theirs[ki].length;
      Tensor dq_rows = dq32.rows(q0, q1), dk_rows = dks.rows(k0, k1), dv_rows = dvs.rows(k0, k1),
             dl_rows = dls.rows(k0, k1);
      ops::gated_attention_span_backward(q.rows(q0, q1), doc.rows(q0, q1), mine[qi].start, ks.rows(k0, k1),
                                         vs.rows(k0, k1), ls.rows(k0, k1), ds.rows(k0, k1), theirs[ki].start, scale,
                                         out32.rows(q0, q1), lse.rows(q0, q1), dout.rows(q0, q1), dq_rows, dk_rows,
                                         dv_rows, dl_rows);
    });
    sums.end_step(step);
  });
  const Tensor& home = sums.home();
  const auto take = [&](const Tensor& sum, Tensor& into) {
    if (into.dtype() == DType::F32)
      into.copy_from(sum);
    else
      ops::cast(sum, into);
  };
  take(g.view(home, gk, dk.shape()), dk);
  take(g.view(home, gv, dv.shape()), dv);
  dlog_beta.copy_from(g.view(home, gl, dlog_beta.shape()));
  if (!f32) ops::cast(dq32, dq);
}

namespace {

// The capacity ops' per-chunk tensors: [L, length, K] of each of a rank's two chunks (the
// span ops want consecutive tokens, and a rank's two chunks are not).
std::array<Tensor, 2> split_chunks(const Tensor& x, const std::array<TokenSpan, 2>& s) {
  std::array<Tensor, 2> out;
  for (int i = 0; i < 2; ++i) {
    out[i] = Tensor::empty({x.dim(0), s[i].length, x.dim(2)}, x.dtype(), x.device());
    copy_range(x, local_offset(s, i), out[i], 0, s[i].length, 1);
  }
  return out;
}

// The inverse, from F64 sums: out F32 [L, T_local, K] = scale · the two chunks' [L, len, K], rounded
// (on either device: one run of len·K values per chunk and layer).
void join_chunks(const std::array<Tensor, 2>& parts, const std::array<TokenSpan, 2>& s, double scale, Tensor& out) {
  const int64_t L = out.dim(0), Tl = out.dim(1), K = out.dim(2);
  for (int i = 0; i < 2; ++i) {
    const int64_t len = s[i].length, off = local_offset(s, i);
    if (len == 0) continue;
    for (int64_t l = 0; l < L; ++l) {
      Tensor o = out.view_bytes(static_cast<size_t>((l * Tl + off) * K) * sizeof(float), {len * K}, DType::F32);
      ops::scale_to_f32(parts[i].view_bytes(static_cast<size_t>(l * len * K) * sizeof(double), {len * K}, DType::F64),
                        scale, o);
    }
  }
}

// The capacity rings' packets, double-buffered: a rank's logβ as its two chunks, each
// [L, len, K], one after the other (the field holds L·Tm·K floats), and its document ids.
class CapacityKeys {
 public:
  CapacityKeys(const ContextLayout& layout, int64_t L, int64_t K, Device device) : L_(L), K_(K) {
    const int64_t Tm = layout.max_local_tokens();
    fl_ = p_.add(DType::F32, K, Tm, L);
    fd_ = p_.add(DType::I32, 1, Tm);
    buf_ = {p_.buffer(device), p_.buffer(device)};
  }
  // This rank's logβ [L, T_local, K] and doc into the first buffer.
  void pack(const Tensor& log_beta, const Tensor& doc, const std::array<TokenSpan, 2>& mine) {
    const auto parts = split_chunks(log_beta, mine);
    chunk(0, mine, 0).copy_from(parts[0]);
    chunk(0, mine, 1).copy_from(parts[1]);
    p_.view(buf_[0], fd_, doc.shape()).copy_from(doc);
  }
  // Buffer `cur` to the next rank, the previous rank's into the other buffer.
  std::unique_ptr<dist::Request> shift(dist::Comm& group, int cur) {
    return group.ring_shift_bytes_async(buf_[cur].raw(), buf_[cur ^ 1].raw(), p_.bytes());
  }
  // Buffer cur's logβ of the chunk `i` of a rank whose chunks are `spans`, and its doc ids.
  Tensor chunk(int cur, const std::array<TokenSpan, 2>& spans, int i) const {
    const size_t front = i == 0 ? 0 : static_cast<size_t>(L_ * spans[0].length * K_) * 4;
    return buf_[cur].view_bytes(p_.offset(fl_) + front, {L_, spans[i].length, K_}, DType::F32);
  }
  Tensor doc(int cur, int64_t tokens) const { return p_.view(buf_[cur], fd_, {tokens}); }

 private:
  int64_t L_, K_;
  Packet p_;
  int fl_ = 0, fd_ = 0;
  std::array<Tensor, 2> buf_;
};

// The capacity sums S F64 [L, len, K] of this rank's two chunks over every key of the sequence.
std::array<Tensor, 2> chunk_capacity_sums(dist::Comm& group, const ContextLayout& layout, int r, int N,
                                         const Tensor& log_beta, const Tensor& doc, double E) {
  const int64_t L = log_beta.dim(0), K = log_beta.dim(2);
  const auto mine = layout.spans(r);
  const Device dev = log_beta.device();
  CapacityKeys keys(layout, L, K, dev);
  keys.pack(log_beta, doc, mine);
  std::array<Tensor, 2> S{Tensor::zeros({L, mine[0].length, K}, DType::F64, dev),
                          Tensor::zeros({L, mine[1].length, K}, DType::F64, dev)};
  ring_steps(group, r, N, keys, [&](int /*step*/, int src, int cur) {
    const auto theirs = layout.spans(src);
    const Tensor ds = keys.doc(cur, layout.local_tokens(src));
    for_each_pair(mine, theirs, [&](int qi, int ki, int64_t q0, int64_t k0) {
      ops::capacity_sums_span(keys.chunk(cur, theirs, ki), ds.rows(k0, k0 + theirs[ki].length), theirs[ki].start,
                              doc.rows(q0, q0 + mine[qi].length), mine[qi].start, S[qi], E);
    });
  });
  return S;
}

void check_capacity(const char* op, const ContextLayout& layout, int r, const Tensor& log_beta, const Tensor& doc,
                    const Tensor& positions) {
  const int64_t Tl = layout.local_tokens(r);
  check_dim(op, log_beta, 1, Tl);
  check_dim(op, doc, 0, Tl);
  check_dim(op, positions, 0, Tl);
  if (log_beta.ndim() != 3 || log_beta.dtype() != DType::F32)
    fail("{}: log_beta must be F32 [L, T_local, K], got {} {}", op, dtype_name(log_beta.dtype()),
         shape_str(log_beta.shape()));
}

}  // namespace

Tensor ring_capacity_sums(dist::Comm& group, const ContextLayout& layout, const Tensor& log_beta, const Tensor& doc,
                          double E) {
  const char* op = "ring_capacity_sums";
  const auto [r, N] = check_group(op, group, layout);
  check_capacity(op, layout, r, log_beta, doc, doc);
  Tensor out = Tensor::empty({log_beta.dim(0), layout.local_tokens(r), log_beta.dim(2)}, DType::F32,
                             log_beta.device());
  join_chunks(chunk_capacity_sums(group, layout, r, N, log_beta, doc, E), layout.spans(r), 1.0, out);
  return out;
}

ops::CapacityLoss ring_capacity_loss(dist::Comm& group, const ContextLayout& layout, const Tensor& log_beta,
                                     const Tensor& doc, const Tensor& positions, double memory,
                                     ops::CapacityMode mode, double E) {
  const char* op = "ring_capacity_loss";
  const auto [r, N] = check_group(op, group, layout);
  check_capacity(op, layout, r, log_beta, doc, positions);
  const auto S = chunk_capacity_sums(group, layout, r, N, log_beta, doc, E);
  const auto mine = layout.spans(r);
  ops::CapacityLoss loss;
  for (int i = 0; i < 2; ++i) {
    const int64_t a = local_offset(mine, i), b = a + mine[i].length;
    const ops::CapacityLoss part = ops::capacity_hinge(S[i], doc.rows(a, b), positions.rows(a, b), memory, mode);
    loss.sum += part.sum;
    loss.positive += part.positive;
  }
  return loss;
}

void ring_capacity_loss_backward(dist::Comm& group, const ContextLayout& layout, const Tensor& log_beta,
                                 const Tensor& doc, const Tensor& positions, double memory, ops::CapacityMode mode,
                                 double scale, Tensor& dlog_beta, double E) {
  const char* op = "ring_capacity_loss_backward";
  const auto [r, N] = check_group(op, group, layout);
  check_capacity(op, layout, r, log_beta, doc, positions);
  check_dim(op, dlog_beta, 1, layout.local_tokens(r));
  const int64_t L = log_beta.dim(0), K = log_beta.dim(2), Tm = layout.max_local_tokens();
  const auto mine = layout.spans(r);
  const auto S = chunk_capacity_sums(group, layout, r, N, log_beta, doc, E);
  std::array<Tensor, 2> g;
  for (int i = 0; i < 2; ++i) {
    const int64_t a = local_offset(mine, i), b = a + mine[i].length;
    g[i] = Tensor::empty(S[i].shape(), DType::F64, log_beta.device());
    ops::capacity_hinge(S[i], doc.rows(a, b), positions.rows(a, b), memory, mode, &g[i]);
  }

  // The keys' logβ and documents (sent ahead), and their F64 gradient sums in a ring one step
  // behind (LaggedSums), laid out as the packets' logβ: each chunk's [L, len, K] in turn.
  CapacityKeys keys(layout, L, K, log_beta.device());
  keys.pack(log_beta, doc, mine);
  Packet gp;
  const int fg = gp.add(DType::F64, K, Tm, L);
  LaggedSums sums(group, gp, DType::F64, log_beta.device());
  auto sum_chunk = [&](const Tensor& buffer, const std::array<TokenSpan, 2>& spans, int i) {
    const size_t front = i == 0 ? 0 : static_cast<size_t>(L * spans[0].length * K) * 8;
    return buffer.view_bytes(gp.offset(fg) + front, {L, spans[i].length, K}, DType::F64);
  };
  ring_steps(group, r, N, keys, [&](int step, int src, int cur) {
    sums.begin_step(step);
    const auto theirs = layout.spans(src);
    const Tensor ds = keys.doc(cur, layout.local_tokens(src));
    Tensor gk[2] = {sum_chunk(sums.mine(), theirs, 0), sum_chunk(sums.mine(), theirs, 1)};
    for_each_pair(mine, theirs, [&](int qi, int ki, int64_t q0, int64_t k0) {
      ops::capacity_grad_span(keys.chunk(cur, theirs, ki), ds.rows(k0, k0 + theirs[ki].length), theirs[ki].start,
                              doc.rows(q0, q0 + mine[qi].length), mine[qi].start, g[qi], gk[ki], E);
    });
    sums.end_step(step);
  });
  // Home: this rank's own keys' sums, chunk by chunk, scaled and rounded into dlog_beta.
  const Tensor& all = sums.home();
  join_chunks({sum_chunk(all, mine, 0), sum_chunk(all, mine, 1)}, mine, scale, dlog_beta);
}

Tensor ring_future_attention_target(dist::Comm& group, const ContextLayout& layout, const Tensor& q, const Tensor& k,
                                    const Tensor& lse, const Tensor& doc, int64_t w, float scale) {
  const char* op = "ring_future_attention_target";
  const auto [r, N] = check_group(op, group, layout);
  const int64_t Tl = layout.local_tokens(r);
  for (const Tensor* t : std::initializer_list<const Tensor*>{&q, &k, &lse, &doc}) check_dim(op, *t, 0, Tl);
  if (q.ndim() != 3 || k.ndim() != 3)
    fail("{}: q must be [T_local, H, d] and k [T_local, K, d], got {} and {}", op, shape_str(q.shape()),
         shape_str(k.shape()));
  const int64_t H = q.dim(1), d = q.dim(2), K = k.dim(1);

  // The ring's packets: a rank's queries, their lse and document ids.
  enum { kQueries, kLse, kQueryDocs };
  const Device dev = q.device();
  TokenPackets queries(layout, {{DType::F32, {H, d}}, {DType::F32, {H}}, {DType::I32, {}}}, dev);
  queries.pack({&q, &lse, &doc});
  const auto mine = layout.spans(r);
  // Each key chunk's running log-sum-exp (the span op wants consecutive keys).
  std::array<std::pair<Tensor, Tensor>, 2> acc{kvpop::future_attention_start(mine[0].length, H, dev),
                                               kvpop::future_attention_start(mine[1].length, H, dev)};
  ring_steps(group, r, N, queries, [&](int /*step*/, int src, int cur) {
    const int64_t Ts = layout.local_tokens(src);
    const Tensor qs = queries.field(cur, kQueries, Ts), ls = queries.field(cur, kLse, Ts),
                 ds = queries.field(cur, kQueryDocs, Ts);
    const auto theirs = layout.spans(src);
    // Pairs of their query chunk and this rank's key chunk, keys not wholly after the queries.
    for_each_pair(theirs, mine, [&](int qi, int ki, int64_t q0, int64_t k0) {
      const int64_t q1 = q0 + theirs[qi].length, k1 = k0 + mine[ki].length;
      kvpop::future_attention_sums(qs.rows(q0, q1), ls.rows(q0, q1), ds.rows(q0, q1), theirs[qi].start,
                                   k.rows(k0, k1), doc.rows(k0, k1), mine[ki].start, w, scale, acc[ki].first,
                                   acc[ki].second);
    });
  });
  Tensor log_m = Tensor::empty({K, Tl}, DType::F32, dev);
  for (int i = 0; i < 2; ++i) copy_range(kvpop::future_attention_finish(acc[i].first, acc[i].second, K), 0, log_m,
                                         local_offset(mine, i), mine[i].length, 1);
  return log_m;
}

std::vector<Tensor> gather_to_owners(dist::Comm& group, const ContextLayout& layout, const std::vector<Tensor>& local,
                                     const std::vector<int>& owner) {
  const char* op = "gather_to_owners";
  const auto [r, N] = check_group(op, group, layout);
  if (owner.size() != local.size()) fail("{}: {} items but {} owners", op, local.size(), owner.size());
  const int64_t Tl = layout.local_tokens(r), Tm = layout.max_local_tokens(), T = layout.tokens();
  // Per destination rank: the floats of its items for a rank of Tm tokens (the shift's size).
  std::vector<int64_t> per_token(static_cast<size_t>(N), 0);
  for (size_t i = 0; i < local.size(); ++i) {
    if (owner[i] < 0 || owner[i] >= N) fail("{}: item {} has owner {}, not a rank of [0, {})", op, i, owner[i], N);
    const Tensor& t = local[i];
    check_on_cpu(op, t);
    check_dim(op, t, 0, Tl);
    if (t.ndim() != 2 || t.dtype() != DType::F32)
      fail("{}: item {} must be F32 [T_local, C], got {} {}", op, i, dtype_name(t.dtype()), shape_str(t.shape()));
    per_token[static_cast<size_t>(owner[i])] += t.dim(1);
  }
  const int64_t widest = *std::max_element(per_token.begin(), per_token.end());
  std::vector<Tensor> out(local.size());
  for (size_t i = 0; i < local.size(); ++i)
    if (owner[i] == r) out[i] = Tensor::empty({T, local[i].dim(1)}, DType::F32);
  if (widest == 0) return out;
  Tensor send = Tensor::empty({Tm * widest}, DType::F32), recv = Tensor::empty({Tm * widest}, DType::F32);
  for (int s = 0; s < N; ++s) {
    // Distance s: this rank's rows of rank (r + s)'s items out, rank (r − s)'s rows of its own in.
    const int dst = (r + s) % N, src = (r - s + N) % N;
    int64_t at = 0;
    for (size_t i = 0; i < local.size(); ++i)
      if (owner[i] == dst) {
        const int64_t n = local[i].numel();
        std::memcpy(send.data<float>() + at, local[i].data<float>(), static_cast<size_t>(n) * sizeof(float));
        at += n;
      }
    if (s == 0)
      std::swap(send, recv);
    else
      group.ring_shift_bytes_async(send.raw(), recv.raw(), send.nbytes(), s)->wait();
    const int64_t Ts = layout.local_tokens(src);
    at = 0;
    for (size_t i = 0; i < local.size(); ++i)
      if (owner[i] == r) {
        const int64_t C = local[i].dim(1);
        layout.put_local(recv.view_bytes(static_cast<size_t>(at) * sizeof(float), {Ts, C}, DType::F32), src, out[i]);
        at += Ts * C;
      }
  }
  return out;
}

}  // namespace retain::trainer
