// SIGTERM/SIGINT handling for the training loop. The handler only sets a flag; the loop polls
// it at step boundaries, agrees with every rank (a signal may reach only some of them), saves
// a checkpoint and exits cleanly. A second signal takes the default action at once (the
// process dies), so an impatient Ctrl-C twice still kills it.
#pragma once

namespace retain::trainer {

// Installs the handlers (idempotent). Call once, before the loop.
void install_stop_signal_handlers();

// The first stop signal received (SIGTERM or SIGINT), or 0 when none.
int stop_signal();

// For tests: forget a received signal.
void clear_stop_signal();

}  // namespace retain::trainer
