// The progress line on stderr: "[3/40] rmsnorm_forward 32768x4096 bfloat16  elapsed 0:12  ETA 2:41".
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

namespace trainscale::bench {

class ProgressLine {
 public:
  // `enabled` false prints nothing; on a terminal the line is redrawn in place.
  explicit ProgressLine(bool enabled);
  ~ProgressLine();
  void update(std::size_t index, std::size_t count, const std::string& name);

 private:
  bool enabled_;
  bool tty_;
  std::chrono::steady_clock::time_point start_;
};

// "1:05:09", "2:41"
std::string format_duration(double seconds);

}  // namespace trainscale::bench
