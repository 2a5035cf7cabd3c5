// The emulator's grid executor (kernels/cuda/emu/emu.h): each block runs as one fiber per CUDA
// thread (Boost.Context) on the launching host thread; a thread runs until it reaches a barrier
// or a warp collective, then the next one runs. A barrier opens when every thread of the block
// has arrived; a warp collective is computed once, by its last lane to arrive, from all lanes'
// inputs. A block where no thread can move on (a barrier some threads never reach, a collective
// some lanes skip) stops the program with a message naming the kernel and block.
#include <boost/context/fiber.hpp>
#include <boost/context/stack_context.hpp>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/base/half.h"
#include "kernels/cuda/emu/emu.h"
#include "kernels/cuda/emu/runtime_state.h"
#include "kernels/cuda/emu/wgmma_emu.h"

namespace retain::cuda_emu {

namespace {

namespace ctx = boost::context;

constexpr size_t kStackBytes = 256 * 1024;  // the kernels keep a few KB of "registers" each
constexpr unsigned kFullMask = 0xffffffffu;

// Fiber stacks, kept between launches (a launch of 1,024-thread blocks needs 256 MB at most).
class StackPool {
 public:
  ctx::stack_context allocate() {
    if (free_.empty()) free_.push_back(std::make_unique_for_overwrite<unsigned char[]>(kStackBytes));
    std::unique_ptr<unsigned char[]> s = std::move(free_.back());
    free_.pop_back();
    ctx::stack_context sc;
    sc.size = kStackBytes;
    sc.sp = s.get() + kStackBytes;  // stacks grow down
    in_use_.push_back(std::move(s));
    return sc;
  }
  void deallocate(ctx::stack_context& sc) {
    unsigned char* base = static_cast<unsigned char*>(sc.sp) - kStackBytes;
    for (auto& s : in_use_)
      if (s.get() == base) {
        free_.push_back(std::move(s));
        s = std::move(in_use_.back());
        in_use_.pop_back();
        return;
      }
  }

 private:
  std::vector<std::unique_ptr<unsigned char[]>> free_, in_use_;
};

struct PooledStack {
  StackPool* pool;
  ctx::stack_context allocate() { return pool->allocate(); }
  void deallocate(ctx::stack_context& sc) noexcept { pool->deallocate(sc); }
};

enum class Wait { None, Barrier, Warp };

// One pending cp.async copy: performed when its group is waited on (or the thread exits), so
// a read of the destination before the wait sees the old bytes, as it may on the device.
struct AsyncCopy {
  void* dst;
  const void* src;
  bool valid;
};

struct Thread {
  ThreadPosition pos;
  ctx::fiber fiber;  // the thread itself, resumed by the scheduler
  ctx::fiber sink;   // the scheduler, resumed by the thread when it waits
  bool done = false;
  Wait wait = Wait::None;
  uint64_t wait_generation = 0;
  std::vector<AsyncCopy> uncommitted;
  std::vector<std::vector<AsyncCopy>> committed;  // oldest first
  // wgmma.mma_async products, run when a wgmma.wait_group retires their group (wgmma_emu.h).
  bool wgmma_fenced = false;  // a wgmma.fence since the last wait (or the start)
  std::vector<WgmmaOp> wgmma_open;
  std::vector<std::vector<WgmmaOp>> wgmma_groups;  // committed, oldest first
};

// A warp collective in progress: lanes' inputs, then the outputs the last lane computes.
struct WarpSlot {
  static constexpr size_t kBytes = 64;
  int op = 0;
  unsigned mask = 0;
  int arrived = 0;
  uint64_t generation = 0;
  std::array<std::array<unsigned char, kBytes>, 32> in{}, out{};
};

struct Block {
  std::vector<Thread> threads;
  std::vector<WarpSlot> warps;
  int live = 0;
  // The barrier: arrivals of the current generation and the running reductions.
  int arrived = 0;
  uint64_t generation = 0;
  int reduce_or = 0, reduce_and = 1, reduce_count = 0;
  int result_or = 0, result_and = 1, result_count = 0;
};

struct Launch {
  const char* name = "";
  Block* block = nullptr;
  Thread* current = nullptr;
  std::vector<unsigned char> shared;  // dynamic shared memory, with room to align its window
  unsigned char* window = nullptr;    // shared-window address 0: 1,024-byte aligned
  size_t window_bytes = 0;            // addresses [0, window_bytes) are the block's
};

// Dynamic shared memory starts at window address 128, not at a multiple of 1,024: a kernel that
// needs 1,024-byte alignment (the 128-byte swizzle of TMA and wgmma) must make it itself, as on
// a device, where the start is not promised either.
constexpr size_t kDynamicSharedWindowStart = 128;

thread_local Launch* g_launch = nullptr;
thread_local StackPool g_stacks;  // each host thread launches on its own

Thread& self() {
  if (!g_launch || !g_launch->current) {
    std::fprintf(stderr, "cuda-emu: a device function ran outside a kernel\n");
    std::abort();
  }
  return *g_launch->current;
}

void park(Wait w, uint64_t generation) {
  Thread& t = self();
  t.wait = w;
  t.wait_generation = generation;
  t.sink = std::move(t.sink).resume();  // back to the scheduler until the wait is over
}

void flush_copies(std::vector<AsyncCopy>& copies) {
  for (const AsyncCopy& c : copies) {
    if (c.valid)
      std::memcpy(c.dst, c.src, 16);
    else
      std::memset(c.dst, 0, 16);
  }
  copies.clear();
}

bool ready(const Block& b, const Thread& t) {
  switch (t.wait) {
    case Wait::None:
      return true;
    case Wait::Barrier:
      return b.generation != t.wait_generation;
    case Wait::Warp: {
      const int tid = static_cast<int>(&t - b.threads.data());
      return b.warps[static_cast<size_t>(tid / 32)].generation != t.wait_generation;
    }
  }
  return false;
}

// The barrier opens when every thread has arrived. A barrier that the block's remaining threads
// reach after some have returned is undefined on the device ("__syncthreads() is allowed in
// conditional code but only if the conditional evaluates identically across the entire thread
// block"), so it stops the emulation instead of opening.
void maybe_open_barrier(Block& b) {
  if (b.arrived == 0 || b.arrived < b.live) return;
  if (b.live < static_cast<int>(b.threads.size()))
    device_fault("threads returned before a __syncthreads that the block's other threads reach");
  b.result_or = b.reduce_or;
  b.result_and = b.reduce_and;
  b.result_count = b.reduce_count;
  b.reduce_or = 0;
  b.reduce_and = 1;
  b.reduce_count = 0;
  b.arrived = 0;
  ++b.generation;
}

int barrier(int predicate, int Block::*result) {
  Block& b = *g_launch->block;
  b.reduce_or |= predicate != 0;
  b.reduce_and &= predicate != 0;
  b.reduce_count += predicate != 0;
  const uint64_t gen = b.generation;
  ++b.arrived;
  maybe_open_barrier(b);
  if (b.generation == gen) park(Wait::Barrier, gen);
  return result ? b.*result : 0;
}

[[noreturn]] void stuck(const Block& b) {
  int at_barrier = 0, at_warp = 0;
  for (const Thread& t : b.threads)
    if (!t.done) (t.wait == Wait::Barrier ? at_barrier : at_warp) += 1;
  const uint3 blk = b.threads.front().pos.block;
  std::fprintf(stderr,
               "cuda-emu: kernel %s block (%u, %u, %u) cannot go on: %d threads wait at __syncthreads, %d at a warp "
               "collective some lanes never reach\n",
               g_launch->name, blk.x, blk.y, blk.z, at_barrier, at_warp);
  std::abort();
}

// The order threads take turns in (RETAIN_CUDA_EMU_SCHEDULE): forward (thread 0 first), reverse,
// or shuffle (a fresh order every round, seeded by RETAIN_CUDA_EMU_SEED). A shared-memory race —
// a read that a missing barrier leaves unordered with another warp's write — reads the written
// value in one order and the old one in another, so running the tests under several orders
// shows it.
enum class Schedule { forward, reverse, shuffle };
Schedule schedule() {
  static const Schedule s = [] {
    const char* e = std::getenv("RETAIN_CUDA_EMU_SCHEDULE");
    const std::string v = e ? e : "forward";
    if (v == "forward") return Schedule::forward;
    if (v == "reverse") return Schedule::reverse;
    if (v == "shuffle") return Schedule::shuffle;
    std::fprintf(stderr, "cuda-emu: RETAIN_CUDA_EMU_SCHEDULE must be forward, reverse or shuffle, got '%s'\n", v.c_str());
    std::exit(2);
  }();
  return s;
}
std::mt19937& schedule_rng() {
  static std::mt19937 rng([] {
    const char* e = std::getenv("RETAIN_CUDA_EMU_SEED");
    return static_cast<uint32_t>(e ? std::strtoul(e, nullptr, 10) : 1);
  }());
  return rng;
}

void run_block(Block& b) {
  std::vector<size_t> order(b.threads.size());
  std::iota(order.begin(), order.end(), size_t{0});
  if (schedule() == Schedule::reverse) std::reverse(order.begin(), order.end());
  for (;;) {
    bool moved = false;
    if (schedule() == Schedule::shuffle) std::shuffle(order.begin(), order.end(), schedule_rng());
    for (const size_t i : order) {
      Thread& t = b.threads[i];
      if (t.done || !ready(b, t)) continue;
      t.wait = Wait::None;
      g_launch->current = &t;
      t.fiber = std::move(t.fiber).resume();
      g_launch->current = nullptr;
      moved = true;
    }
    if (b.live == 0) return;
    if (!moved) stuck(b);
  }
}

// ---- warp collectives ---------------------------------------------------------------------

using Compute = void (*)(WarpSlot&, int lanes);

// The mask naming a warp's `lanes` lanes (a block's last warp may be short).
unsigned lanes_mask(int lanes) { return lanes == 32 ? kFullMask : ((1u << lanes) - 1u); }

void collective(int op, unsigned mask, const void* in, size_t in_bytes, void* out, size_t out_bytes,
                Compute compute) {
  Block& b = *g_launch->block;
  Thread& t = self();
  const int tid = static_cast<int>(&t - b.threads.data());
  const int lane = tid % 32;
  WarpSlot& w = b.warps[static_cast<size_t>(tid / 32)];
  const int lanes = std::min<int>(32, static_cast<int>(b.threads.size()) - (tid / 32) * 32);
  if (mask != kFullMask && mask != lanes_mask(lanes)) device_fault("a warp collective with a partial mask is not emulated");
  if (w.arrived == 0) {
    w.op = op;
    w.mask = mask;
  } else if (w.op != op || w.mask != mask) {
    device_fault("lanes of one warp reached different collectives (or the same one with different masks)");
  }
  std::memcpy(w.in[static_cast<size_t>(lane)].data(), in, in_bytes);
  const uint64_t gen = w.generation;
  if (++w.arrived == lanes) {
    compute(w, lanes);
    w.arrived = 0;
    ++w.generation;
  } else {
    park(Wait::Warp, gen);
  }
  // No lane can start the warp's next collective before every lane has read this one's output:
  // the next one completes only when all lanes arrive, and each reads first.
  std::memcpy(out, w.out[static_cast<size_t>(lane)].data(), out_bytes);
}

template <class T>
T read_in(const WarpSlot& w, int lane) {
  T v;
  std::memcpy(&v, w.in[static_cast<size_t>(lane)].data(), sizeof v);
  return v;
}
template <class T>
void write_out(WarpSlot& w, int lane, const T& v) {
  std::memcpy(w.out[static_cast<size_t>(lane)].data(), &v, sizeof v);
}

enum Op { kShflXor = 1, kShfl, kAny, kAll, kBallot, kSyncwarp, kLdmatrix, kLdmatrixTrans, kMma, kWgmmaWait };

int vote(int op, unsigned mask, int p) {
  unsigned r = 0;
  const int in = p != 0;
  collective(op, mask, &in, sizeof in, &r, sizeof r, [](WarpSlot& w, int lanes) {
    unsigned bits = 0;
    for (int l = 0; l < lanes; ++l) bits |= static_cast<unsigned>(read_in<int>(w, l)) << l;
    unsigned v = bits;
    if (w.op == kAny) v = bits != 0;
    if (w.op == kAll) v = bits == lanes_mask(lanes);
    for (int l = 0; l < lanes; ++l) write_out(w, l, v);
  });
  return static_cast<int>(r);
}

uint16_t load_u16(const void* row, int col) {
  uint16_t v;
  std::memcpy(&v, static_cast<const unsigned char*>(row) + 2 * col, 2);
  return v;
}

}  // namespace

// Each lane names its own source lane (or xor mask), as the instruction allows.
void shuffle(bool xor_lanes, unsigned mask, const void* in, void* out, size_t bytes, int arg) {
  if (bytes > 8) device_fault("a shuffle of more than 8 bytes");
  const int op = xor_lanes ? kShflXor : kShfl;
  struct In {
    uint64_t v;
    int arg;
  } x{0, arg};
  std::memcpy(&x.v, in, bytes);
  uint64_t r = 0;
  collective(op, mask, &x, sizeof x, &r, sizeof r, [](WarpSlot& w, int lanes) {
    for (int l = 0; l < lanes; ++l) {
      const int a = read_in<In>(w, l).arg;
      int src = (w.op == kShflXor ? (l ^ a) : a) & 31;  // a source lane is taken modulo the width
      if (src >= lanes) src = l;                         // a lane past a short warp's end: its own
      write_out(w, l, read_in<In>(w, src).v);
    }
  });
  std::memcpy(out, &r, bytes);
}

int any(unsigned m, int p) { return vote(kAny, m, p); }
int all(unsigned m, int p) { return vote(kAll, m, p); }
unsigned ballot(unsigned m, int p) { return static_cast<unsigned>(vote(kBallot, m, p)); }
void syncwarp(unsigned m) { (void)vote(kSyncwarp, m, 0); }

// ldmatrix .m8n8.x4: lanes 8j..8j+7 address the 8 rows (16 bytes each) of matrix j. Lane l
// receives, in register j, matrix j's elements (row l/4, columns 2(l%4) and 2(l%4)+1), the
// lower column in the low half; with .trans, the transposed matrix's: (rows 2(l%4) and
// 2(l%4)+1, column l/4). (PTX ISA, "Warp-level matrix load instruction: ldmatrix".)
void ldmatrix_x4(uint32_t (&r)[4], const void* row_address, bool transpose) {
  if (reinterpret_cast<uintptr_t>(row_address) % 16 != 0) device_fault("ldmatrix: a row address is not 16-byte aligned");
  uint32_t out[4];
  collective(transpose ? kLdmatrixTrans : kLdmatrix, kFullMask, &row_address, sizeof row_address, out, sizeof out,
             [](WarpSlot& w, int lanes) {
               if (lanes != 32) device_fault("ldmatrix needs a whole warp");
               for (int l = 0; l < 32; ++l) {
                 uint32_t regs[4];
                 for (int j = 0; j < 4; ++j) {
                   uint16_t lo, hi;
                   if (w.op == kLdmatrix) {
                     const void* row = read_in<const void*>(w, 8 * j + l / 4);
                     lo = load_u16(row, 2 * (l % 4));
                     hi = load_u16(row, 2 * (l % 4) + 1);
                   } else {
                     lo = load_u16(read_in<const void*>(w, 8 * j + 2 * (l % 4)), l / 4);
                     hi = load_u16(read_in<const void*>(w, 8 * j + 2 * (l % 4) + 1), l / 4);
                   }
                   regs[j] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
                 }
                 write_out(w, l, regs);
               }
             });
  std::memcpy(r, out, sizeof out);
}

// mma.m16n8k16 .row.col bf16 → f32 (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating
// point type"): with g = lane/4 and c = lane%4, A's registers hold (g, 2c..2c+1), (g+8, 2c..),
// (g, 2c+8..), (g+8, 2c+8..); B's two hold (k = 2c..2c+1, n = g), (k = 2c+8.., n = g); C and D
// hold (g, 2c), (g, 2c+1), (g+8, 2c), (g+8, 2c+1). The k-sum runs in fp32, in k order.
void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  struct In {
    uint32_t a[4], b[2];
    float c[4];
  } in{{a[0], a[1], a[2], a[3]}, {b0, b1}, {d[0], d[1], d[2], d[3]}};
  static_assert(sizeof(In) <= WarpSlot::kBytes);
  float out[4];
  collective(kMma, kFullMask, &in, sizeof in, out, sizeof out, [](WarpSlot& w, int lanes) {
    if (lanes != 32) device_fault("mma.sync needs a whole warp");
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
      const In x = read_in<In>(w, l);
      const int g = l / 4, c = l % 4;
      const int rows[4] = {g, g + 8, g, g + 8}, cols[4] = {2 * c, 2 * c, 2 * c + 8, 2 * c + 8};
      for (int r = 0; r < 4; ++r) {
        A[rows[r]][cols[r]] = bf16_to_f32(static_cast<uint16_t>(x.a[r] & 0xffff));
        A[rows[r]][cols[r] + 1] = bf16_to_f32(static_cast<uint16_t>(x.a[r] >> 16));
      }
      for (int r = 0; r < 2; ++r) {
        B[2 * c + 8 * r][g] = bf16_to_f32(static_cast<uint16_t>(x.b[r] & 0xffff));
        B[2 * c + 8 * r + 1][g] = bf16_to_f32(static_cast<uint16_t>(x.b[r] >> 16));
      }
      C[g][2 * c] = x.c[0];
      C[g][2 * c + 1] = x.c[1];
      C[g + 8][2 * c] = x.c[2];
      C[g + 8][2 * c + 1] = x.c[3];
    }
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, c = l % 4;
      const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * c, 2 * c + 1, 2 * c, 2 * c + 1};
      float o[4];
      for (int e = 0; e < 4; ++e) {
        float s = C[rows[e]][cols[e]];
        for (int k = 0; k < 16; ++k) s += A[rows[e]][k] * B[k][cols[e]];
        o[e] = s;
      }
      write_out(w, l, o);
    }
  });
  std::memcpy(d, out, sizeof out);
}

// ---- cp.async -----------------------------------------------------------------------------

void cp_async_16(void* dst, const void* src, bool valid) {
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0)
    device_fault("cp.async: an address is not 16-byte aligned");
  self().uncommitted.push_back({dst, src, valid});
}
void cp_async_commit() {
  Thread& t = self();
  t.committed.push_back(std::move(t.uncommitted));
  t.uncommitted.clear();
}
void cp_async_wait(int pending) {
  Thread& t = self();
  while (static_cast<int>(t.committed.size()) > pending) {
    flush_copies(t.committed.front());
    t.committed.erase(t.committed.begin());
  }
}

// ---- wgmma.mma_async ------------------------------------------------------------------------

// A product is queued at issue and computed when a wgmma.wait_group retires its group: it reads
// shared memory and the accumulators then, so shared memory overwritten before the wait, or
// accumulators read before it, give wrong results here as they may on the device.
void wgmma_bf16(float* d, int n, const uint32_t* a_registers, uint64_t desc_a, uint64_t desc_b, bool accumulate,
                bool trans_b) {
  Thread& t = self();
  const dim3 bd = t.pos.block_dim;
  if ((uint64_t{bd.x} * bd.y * bd.z) % 128 != 0) device_fault("wgmma: the block is not whole warpgroups of 128 threads");
  if (!t.wgmma_fenced)
    device_fault("wgmma.mma_async without a wgmma.fence since the accumulators were last accessible (the start or a "
                 "wgmma.wait_group)");
  WgmmaOp op;
  op.d = d;
  op.n = n;
  op.a_in_registers = a_registers != nullptr;
  if (a_registers) std::memcpy(op.a, a_registers, sizeof op.a);
  op.desc_a = desc_a;
  op.desc_b = desc_b;
  op.accumulate = accumulate;
  op.trans_b = trans_b;
  t.wgmma_open.push_back(op);
}
void wgmma_fence() { self().wgmma_fenced = true; }
void wgmma_commit_group() {
  Thread& t = self();
  t.wgmma_groups.push_back(std::move(t.wgmma_open));
  t.wgmma_open.clear();
}
// A warp collective: the last lane to arrive runs the warp's share of every product in the
// groups it retires, in issue order, for all 32 lanes.
void wgmma_wait_group(int pending) {
  Thread& t = self();
  const int retire = std::max(0, static_cast<int>(t.wgmma_groups.size()) - pending);
  int out = 0;
  collective(kWgmmaWait, kFullMask, &retire, sizeof retire, &out, sizeof out, [](WarpSlot& w, int lanes) {
    if (lanes != 32) device_fault("wgmma.wait_group needs a whole warp");
    Block& b = *g_launch->block;
    Thread* const first = &b.threads[static_cast<size_t>(&w - b.warps.data()) * 32];
    const int n = read_in<int>(w, 0);
    size_t ops = 0;
    for (int l = 0; l < 32; ++l) {
      if (read_in<int>(w, l) != n) device_fault("wgmma.wait_group: lanes of one warp have different wgmma groups in flight");
      size_t count = 0;
      for (int g = 0; g < n; ++g) count += first[l].wgmma_groups[static_cast<size_t>(g)].size();
      if (l > 0 && count != ops) device_fault("wgmma.wait_group: lanes of one warp have different wgmma groups in flight");
      ops = count;
    }
    const int warp_in_group = static_cast<int>(&w - b.warps.data()) % 4;
    for (int g = 0; g < n; ++g)
      for (size_t i = 0; i < first[0].wgmma_groups[static_cast<size_t>(g)].size(); ++i) {
        const WgmmaOp* lane_ops[32];
        for (int l = 0; l < 32; ++l) lane_ops[l] = &first[l].wgmma_groups[static_cast<size_t>(g)][i];
        run_wgmma_warp(lane_ops, warp_in_group, g_launch->window, kDynamicSharedWindowStart, g_launch->window_bytes);
      }
    for (int l = 0; l < 32; ++l) {
      auto& groups = first[l].wgmma_groups;
      groups.erase(groups.begin(), groups.begin() + n);
      first[l].wgmma_fenced = false;
    }
  });
}

// ---- barriers and positions ---------------------------------------------------------------

void syncthreads() { barrier(0, nullptr); }
int syncthreads_or(int p) { return barrier(p, &Block::result_or); }
int syncthreads_and(int p) { return barrier(p, &Block::result_and); }
int syncthreads_count(int p) { return barrier(p, &Block::result_count); }

const ThreadPosition& position() { return self().pos; }
void* dynamic_shared() {  // 128-byte aligned, as `extern __shared__ __align__(128)` asks
  return g_launch->window + kDynamicSharedWindowStart;
}
uint32_t shared_window_address(const void* p) {
  const auto* c = static_cast<const unsigned char*>(p);
  if (c < g_launch->window + kDynamicSharedWindowStart || c > g_launch->window + g_launch->window_bytes)
    device_fault("a shared-memory address outside the block's dynamic shared memory (static __shared__ arrays have "
                 "no window address here)");
  return static_cast<uint32_t>(c - g_launch->window);
}

[[noreturn]] void device_fault(const char* what) {
  const Thread* t = g_launch ? g_launch->current : nullptr;
  if (t)
    std::fprintf(stderr, "cuda-emu: kernel %s block (%u, %u, %u) thread (%u, %u, %u): %s\n", g_launch->name,
                 t->pos.block.x, t->pos.block.y, t->pos.block.z, t->pos.thread.x, t->pos.thread.y, t->pos.thread.z,
                 what);
  else
    std::fprintf(stderr, "cuda-emu: %s\n", what);
  std::abort();
}

// ---- the grid -----------------------------------------------------------------------------

void run_grid(const LaunchConfig& config, const void* kernel, const char* name, const std::function<void()>& body) {
  const dim3 g = config.grid, bd = config.block;
  const uint64_t threads = uint64_t{bd.x} * bd.y * bd.z;
  if (g.x == 0 || g.y == 0 || g.z == 0 || threads == 0 || threads > 1024 || bd.z > 64 || g.y > 65535 ||
      g.z > 65535) {
    runtime::set_launch_error(cudaErrorInvalidConfiguration);
    return;
  }
  if (!runtime::dynamic_shared_allowed(kernel, config.dynamic_shared)) {
    runtime::set_launch_error(cudaErrorInvalidValue);
    return;
  }
  if (g_launch) device_fault("a kernel launched another kernel (dynamic parallelism is not emulated)");
  Launch launch;
  launch.name = name;
  // Poisoned (0xff: NaN as float, −1 as an integer) so that a read before any write shows.
  launch.shared.assign(config.dynamic_shared + 1024 + kDynamicSharedWindowStart, 0xff);
  launch.window = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(launch.shared.data()) + 1023) & ~uintptr_t{1023});
  launch.window_bytes = kDynamicSharedWindowStart + config.dynamic_shared;
  g_launch = &launch;
  struct Reset {
    ~Reset() { g_launch = nullptr; }
  } reset;
  for (unsigned bz = 0; bz < g.z; ++bz)
    for (unsigned by = 0; by < g.y; ++by)
      for (unsigned bx = 0; bx < g.x; ++bx) {
        std::memset(launch.shared.data(), 0xff, launch.shared.size());
        Block b;
        b.threads.resize(threads);
        b.warps.resize((threads + 31) / 32);
        b.live = static_cast<int>(threads);
        launch.block = &b;
        for (uint64_t i = 0; i < threads; ++i) {
          Thread& t = b.threads[i];
          t.pos.thread = {static_cast<unsigned>(i % bd.x), static_cast<unsigned>(i / bd.x % bd.y),
                          static_cast<unsigned>(i / (uint64_t{bd.x} * bd.y))};
          t.pos.block = {bx, by, bz};
          t.pos.block_dim = bd;
          t.pos.grid_dim = g;
          t.fiber = ctx::fiber(std::allocator_arg, PooledStack{&g_stacks}, [&b, &t, &body](ctx::fiber&& sink) {
            t.sink = std::move(sink);
            body();
            flush_copies(t.uncommitted);  // copies still in flight land, as on the device
            for (auto& group : t.committed) flush_copies(group);
            t.committed.clear();
            if (!t.wgmma_open.empty() || !t.wgmma_groups.empty())
              device_fault("a thread returned with wgmma.mma_async products no wgmma.wait_group retired");
            t.done = true;
            --b.live;
            maybe_open_barrier(b);
            return std::move(t.sink);
          });
        }
        run_block(b);
      }
}

}  // namespace retain::cuda_emu
