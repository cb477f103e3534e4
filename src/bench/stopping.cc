#include "bench/stopping.h"

#include <algorithm>
#include <vector>

#include "bench/statistics.h"

namespace trainscale::bench {

const char* stop_reason_name(StopReason reason) {
  switch (reason) {
    case StopReason::kContinue: return "running";
    case StopReason::kConverged: return "converged";
    case StopReason::kTimeout: return "timeout";
    case StopReason::kMaxSamples: return "max-samples";
    case StopReason::kInterrupted: return "interrupted";
  }
  return "unknown";
}

StopReason check_stop(const StoppingRule& rule, std::span<const double> samples, double elapsed_ms) {
  const auto n = static_cast<std::int64_t>(samples.size());
  if (n >= rule.max_samples) return StopReason::kMaxSamples;
  // At least one sample even past the timeout, so every timed row has a number.
  if (elapsed_ms >= rule.timeout_ms && n > 0) return StopReason::kTimeout;
  if (n < std::max<std::int64_t>(rule.min_samples, 2) || elapsed_ms < rule.min_time_ms) {
    return StopReason::kContinue;
  }
  // Sorting costs O(n log n): past 100 samples, re-evaluate the noise every 1% of n only.
  if (n > 100 && n % (n / 100) != 0) return StopReason::kContinue;
  std::vector<double> sorted(samples.begin(), samples.end());
  std::sort(sorted.begin(), sorted.end());
  return median_rel_noise_sorted(sorted) <= rule.target_rel_noise ? StopReason::kConverged
                                                                  : StopReason::kContinue;
}

}  // namespace trainscale::bench
