#include "trainer/signals.h"

#include <atomic>
#include <csignal>

namespace retain::trainer {

namespace {

std::atomic<int> g_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the handler may only touch lock-free atomics");

extern "C" void on_stop_signal(int sig) {
  int expected = 0;
  if (!g_signal.compare_exchange_strong(expected, sig)) {
    // Second signal: the default action, now (both calls are async-signal-safe).
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
}

}  // namespace

void install_stop_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // blocking I/O and MPI calls are resumed, not failed with EINTR
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

int stop_signal() { return g_signal.load(); }

void clear_stop_signal() { g_signal.store(0); }

}  // namespace retain::trainer
