#include "bench/progress.h"

#include <unistd.h>

#include <cstdio>

namespace trainscale::bench {

std::string format_duration(double seconds) {
  const auto total = static_cast<long>(seconds + 0.5);
  char buf[32];
  if (total >= 3600) {
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", total / 3600, total / 60 % 60, total % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%ld:%02ld", total / 60, total % 60);
  }
  return buf;
}

ProgressLine::ProgressLine(bool enabled)
    : enabled_(enabled), tty_(isatty(fileno(stderr)) != 0), start_(std::chrono::steady_clock::now()) {}

ProgressLine::~ProgressLine() {
  if (enabled_ && tty_) std::fprintf(stderr, "\r\033[K");
}

void ProgressLine::update(std::size_t index, std::size_t count, const std::string& name) {
  if (!enabled_) return;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  // Cases so far set the pace for the rest.
  const std::string eta = index == 0 ? "?" : format_duration(elapsed / static_cast<double>(index) *
                                                             static_cast<double>(count - index));
  std::fprintf(stderr, "%s[%zu/%zu] %s  elapsed %s  ETA %s%s", tty_ ? "\r\033[K" : "", index + 1, count, name.c_str(),
               format_duration(elapsed).c_str(), eta.c_str(), tty_ ? "" : "\n");
  std::fflush(stderr);
}

}  // namespace trainscale::bench
