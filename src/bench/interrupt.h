// Ctrl-C handling: the first SIGINT asks the run to stop after the current sample (so what was
// measured so far is still written); a second one kills the process as usual.
#pragma once

namespace trainscale::bench {

void install_interrupt_handler();
bool interrupt_requested();
void request_interrupt();  // what the handler does; tests call it directly
void clear_interrupt();

}  // namespace trainscale::bench
