// Ctrl-C handling: the first SIGINT asks the run to stop after the current sample (so what was
// measured so far is still written); a second one kills the process as usual. Long waits (a host
// reference, a sampling loop) poll interrupt_requested() at least every 100 ms.
#pragma once

#include <functional>

namespace trainscale::bench {

void install_interrupt_handler();
bool interrupt_requested();
void request_interrupt();  // what the handler does; tests call it directly
void clear_interrupt();
// An extra source of interrupts, asked by interrupt_requested() (at most every 50 ms): the
// Python front-end checks Python's pending signals there, since Python's own SIGINT handler only
// sets a flag while C++ runs. Empty: none.
void set_interrupt_poll(std::function<bool()> poll);

}  // namespace trainscale::bench
