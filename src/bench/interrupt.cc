#include "bench/interrupt.h"

#include <atomic>
#include <chrono>
#include <csignal>

namespace trainscale::bench {
namespace {

std::atomic<bool> g_interrupted{false};
std::function<bool()> g_poll;
std::chrono::steady_clock::time_point g_last_poll{};

extern "C" void on_sigint(int) {
  g_interrupted.store(true);
  std::signal(SIGINT, SIG_DFL);  // a second Ctrl-C ends the process
}

}  // namespace

void install_interrupt_handler() { std::signal(SIGINT, on_sigint); }

bool interrupt_requested() {
  if (g_interrupted.load()) return true;
  if (g_poll) {
    const auto now = std::chrono::steady_clock::now();
    if (now - g_last_poll >= std::chrono::milliseconds(50)) {
      g_last_poll = now;
      if (g_poll()) g_interrupted.store(true);
    }
  }
  return g_interrupted.load();
}

void request_interrupt() { g_interrupted.store(true); }
void clear_interrupt() { g_interrupted.store(false); }
void set_interrupt_poll(std::function<bool()> poll) { g_poll = std::move(poll); }

}  // namespace trainscale::bench
