#include "bench/timing.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "bench/interrupt.h"

namespace trainscale::bench {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

}  // namespace

double HostSampleSource::sample_ms() {
  const int set = static_cast<int>(count_++ % rotate_);
  const auto start = Clock::now();
  run_(set);
  return ms_since(start);
}

SampleSet collect_samples(SampleSource& source, const TimingOptions& options, ClockMonitor* monitor) {
  SampleSet result;
  const auto warmup_start = Clock::now();
  for (std::int64_t i = 0; i < options.warmup_min || ms_since(warmup_start) < options.warmup_ms; ++i) {
    if (interrupt_requested()) {
      result.reason = StopReason::kInterrupted;
      return result;
    }
    source.sample_ms();
  }

  if (monitor) monitor->start();
  const auto start = Clock::now();
  while (true) {
    const double ms = source.sample_ms();
    const std::optional<ClockObservation> clock = monitor ? monitor->observe() : std::nullopt;
    bool keep = true;
    bool throttled = clock && clock->throttled;
    std::string reasons = clock ? clock->reasons : "";
    if (clock && clock->sm_mhz > 0) {
      monitor->highest_mhz = std::max(monitor->highest_mhz, clock->sm_mhz);
      if (clock->sm_mhz < kClockDropShare * monitor->highest_mhz) {
        throttled = true;
        reasons += reasons.empty() ? "clock-drop" : ",clock-drop";
      }
    }
    if (throttled) {
      result.throttle_reasons = reasons;
      if (result.throttle_retakes < options.max_throttle_retakes) {
        ++result.throttle_retakes;
        keep = false;
        std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(options.throttle_recovery_ms));
      } else {
        result.throttled = true;
      }
    }
    // The clocks of the samples kept.
    if (keep && clock && clock->sm_mhz > 0) {
      result.sm_mhz_min = result.sm_mhz_min == 0 ? clock->sm_mhz : std::min(result.sm_mhz_min, clock->sm_mhz);
      result.sm_mhz_max = std::max(result.sm_mhz_max, clock->sm_mhz);
    }
    if (keep) result.ms.push_back(ms);
    if (interrupt_requested()) {
      result.reason = StopReason::kInterrupted;
      return result;
    }
    result.reason = check_stop(options.stop, result.ms, ms_since(start));
    if (result.reason != StopReason::kContinue) return result;
  }
}

}  // namespace trainscale::bench
