// Sampling loop shared by every timer: warm-up by time, then samples until the stopping rule
// says so; samples taken while the GPU reports thermal or power throttling are dropped and
// re-taken after an idle pause (a bounded number of times).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "bench/stopping.h"

namespace trainscale::bench {

struct TimingOptions {
  StoppingRule stop;
  double warmup_ms = 25.0;
  std::int64_t warmup_min = 3;
  bool flush_l2 = true;  // cold samples (CUDA)
  int rotate = 1;        // input sets cycled through, one per sample (or per launch in a batch)
  int batch = 0;         // launches per CUDA-graph replay; 0: automatic for tiny kernels
  std::int64_t max_throttle_retakes = 20;
  // Idle time after a throttled sample before the retake, so the power average falls back
  // under the cap (retaking at once mostly meets the same slowdown).
  double throttle_recovery_ms = 50.0;
};

// Produces one timed sample of the implementation, in milliseconds per launch.
class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual double sample_ms() = 0;
};

struct ClockObservation {
  double sm_mhz = 0;       // 0 when unknown
  bool throttled = false;  // thermal or power slowdown active
  std::string reasons;     // e.g. "sw-power-cap,hw-thermal"
};

// Reports the SM clock (and throttling when it can) after each sample.
class ClockMonitor {
 public:
  virtual ~ClockMonitor() = default;
  // Before a row's first timed sample (after its warm-up): what observe() compares against.
  virtual void start() {}
  virtual std::optional<ClockObservation> observe() = 0;
  // The highest SM clock seen so far (over every row): a sample whose clock fell more than 3 %
  // under it counts as throttled ("clock-drop"), since the power cap lowers the clock of
  // compute-bound kernels also at moments when NVML reports no reason.
  double highest_mhz = 0;
};
inline constexpr double kClockDropShare = 0.97;

struct SampleSet {
  std::vector<double> ms;
  StopReason reason = StopReason::kContinue;
  std::int64_t throttle_retakes = 0;
  bool throttled = false;  // still throttled after the retakes ran out
  std::string throttle_reasons;
  double sm_mhz_min = 0, sm_mhz_max = 0;  // clocks seen while sampling; 0 when unknown
};

SampleSet collect_samples(SampleSource& source, const TimingOptions& options, ClockMonitor* monitor);

// std::chrono::steady_clock around `run(set)`, set = sample index % rotate.
class HostSampleSource : public SampleSource {
 public:
  HostSampleSource(std::function<void(int set)> run, int rotate) : run_(std::move(run)), rotate_(rotate) {}
  double sample_ms() override;

 private:
  std::function<void(int)> run_;
  int rotate_;
  std::int64_t count_ = 0;
};

}  // namespace trainscale::bench
