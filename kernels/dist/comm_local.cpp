// The one-rank world of a plain run: every collective is a copy or nothing at all.
#include <cstdlib>
#include <cstring>
#include <memory>

#include "kernels/dist/comm.h"

namespace retain::dist {
namespace {

class LocalComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string_view backend() const override { return "local"; }

 private:
  void do_all_gather(const float* send, float* recv, size_t count) override {
    if (send != recv) std::memcpy(recv, send, count * sizeof(float));  // in place: nothing to do
  }
  // The copy is done when the request is made.
  class CopiedRequest final : public Request {
   public:
    void wait() override {}
    bool test() override { return true; }
  };
  std::unique_ptr<Request> do_all_gather_async(const float* send, float* recv,
                                               size_t count) override {
    do_all_gather(send, recv, count);
    return std::make_unique<CopiedRequest>();
  }
  void do_all_gather_bytes(const void* send, void* recv, size_t bytes) override {
    std::memcpy(recv, send, bytes);  // no overlap: checked by Comm
  }
  std::unique_ptr<Request> do_all_gather_bytes_async(const void* send, void* recv,
                                                     size_t bytes) override {
    if (send != recv) std::memcpy(recv, send, bytes);  // in place: nothing to do
    return std::make_unique<CopiedRequest>();
  }
  std::unique_ptr<Request> do_ring_shift_bytes_async(const void* send, void* recv, size_t bytes, int) override {
    std::memcpy(recv, send, bytes);  // to and from itself (no overlap: checked by Comm)
    return std::make_unique<CopiedRequest>();
  }
  void do_reduce_scatter(const float* send, float* recv, size_t count) override {
    std::memcpy(recv, send, count * sizeof(float));
  }
  void do_all_reduce(float*, size_t) override {}
  void do_all_reduce(double*, size_t) override {}
  void do_all_reduce_max(double*, size_t) override {}
  void do_broadcast(void*, size_t, int) override {}
  void do_barrier() override {}
  std::unique_ptr<Comm> do_split(int, int) override { return std::make_unique<LocalComm>(); }
  // One process is the whole job; stdio was flushed by Comm::abort.
  void do_abort(int code) override { std::_Exit(code); }
};

}  // namespace

std::unique_ptr<Comm> make_local_comm() { return std::make_unique<LocalComm>(); }

}  // namespace retain::dist
