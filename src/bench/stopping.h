// When to stop sampling: once the median's relative noise (statistics.h) is under a target,
// with at least a minimum number of samples and a minimum sampling time; at the latest at a
// timeout or a sample cap.
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace trainscale::bench {

struct StoppingRule {
  double target_rel_noise = 0.005;  // 0.5%
  std::int64_t min_samples = 10;
  double min_time_ms = 50.0;
  double timeout_ms = 3000.0;
  std::int64_t max_samples = 100000;
};

enum class StopReason { kContinue, kConverged, kTimeout, kMaxSamples, kInterrupted };
const char* stop_reason_name(StopReason reason);

// `samples` in any order; `elapsed_ms` is the wall time spent sampling so far.
StopReason check_stop(const StoppingRule& rule, std::span<const double> samples, double elapsed_ms);

}  // namespace trainscale::bench
