// Statistics, the stopping rule and the sampling loop on known data.
#include <gtest/gtest.h>

#include <chrono>

#include <cmath>
#include <random>
#include <vector>

#include "bench/interrupt.h"
#include "bench/statistics.h"
#include "bench/stopping.h"
#include "bench/timing.h"

namespace trainscale::bench {
namespace {

TEST(BenchStatistics, SummaryOfKnownData) {
  // 1..100 shuffled: NumPy gives median 50.5, p5 5.95, p95 95.05, p99 99.01, std 29.0115.
  std::vector<double> v;
  for (int i = 1; i <= 100; ++i) v.push_back(i);
  std::shuffle(v.begin(), v.end(), std::mt19937(3));
  const Summary s = summarize(v);
  EXPECT_EQ(s.count, 100);
  EXPECT_DOUBLE_EQ(s.median, 50.5);
  EXPECT_DOUBLE_EQ(s.mean, 50.5);
  EXPECT_DOUBLE_EQ(s.min, 1);
  EXPECT_DOUBLE_EQ(s.max, 100);
  EXPECT_NEAR(s.p5, 5.95, 1e-12);
  EXPECT_NEAR(s.p95, 95.05, 1e-12);
  EXPECT_NEAR(s.p99, 99.01, 1e-12);
  EXPECT_NEAR(s.std, 29.011491975882016, 1e-12);
  // n = 100: ranks 40 and 61 bound the median's 95% CI -> half-width (61 - 40) / 2.
  EXPECT_NEAR(s.rel_noise, 10.5 / 50.5, 1e-12);
}

TEST(BenchStatistics, SmallAndDegenerateInputs) {
  EXPECT_EQ(summarize(std::vector<double>{}).count, 0);
  const Summary one = summarize(std::vector<double>{2.5});
  EXPECT_EQ(one.median, 2.5);
  EXPECT_EQ(one.std, 0);
  EXPECT_EQ(one.rel_noise, 0);
  const Summary same = summarize(std::vector<double>(50, 1.0));
  EXPECT_EQ(same.rel_noise, 0);
  EXPECT_EQ(same.p99, 1.0);
  const std::vector<double> two = {1.0, 3.0};
  EXPECT_DOUBLE_EQ(summarize(two).median, 2.0);
}

TEST(BenchStatistics, MedianConfidenceIntervalCoversTheMedian) {
  std::mt19937_64 rng(11);
  std::normal_distribution<double> noise(10.0, 1.0);
  for (int n : {10, 31, 200, 5000}) {
    std::vector<double> v;
    for (int i = 0; i < n; ++i) v.push_back(noise(rng));
    std::sort(v.begin(), v.end());
    const Interval ci = median_ci95_sorted(v);
    const double median = percentile_sorted(v, 50);
    EXPECT_LE(ci.lo, median);
    EXPECT_GE(ci.hi, median);
  }
}

TEST(BenchStatistics, Geomean) {
  EXPECT_NEAR(geomean(std::vector<double>{1, 4, 16}), 4.0, 1e-12);
  EXPECT_NEAR(geomean(std::vector<double>{0.5, 2}), 1.0, 1e-12);
  EXPECT_EQ(geomean(std::vector<double>{}), 0.0);
}

// Feeds a synthetic stream to the rule; each sample advances the clock by its own value.
struct Stopped {
  StopReason reason;
  std::size_t samples;
  double elapsed_ms;
};
Stopped run_rule(const StoppingRule& rule, const std::function<double()>& next) {
  std::vector<double> samples;
  double elapsed = 0;
  while (true) {
    samples.push_back(next());
    elapsed += samples.back();
    const StopReason r = check_stop(rule, samples, elapsed);
    if (r != StopReason::kContinue) return {r, samples.size(), elapsed};
  }
}

TEST(BenchStopping, LowNoiseStopsEarly) {
  StoppingRule rule;
  rule.min_samples = 10;
  rule.min_time_ms = 0;
  rule.timeout_ms = 1000;
  std::mt19937_64 rng(1);
  std::normal_distribution<double> noise(1.0, 0.001);  // 0.1% jitter
  const Stopped s = run_rule(rule, [&] { return noise(rng); });
  EXPECT_EQ(s.reason, StopReason::kConverged);
  EXPECT_LE(s.samples, 20u);
}

TEST(BenchStopping, HighNoiseRunsToTheTimeout) {
  StoppingRule rule;
  rule.min_samples = 10;
  rule.min_time_ms = 0;
  rule.timeout_ms = 200;
  std::mt19937_64 rng(2);
  std::uniform_real_distribution<double> noise(0.5, 1.5);  // +-50%
  const Stopped s = run_rule(rule, [&] { return noise(rng); });
  EXPECT_EQ(s.reason, StopReason::kTimeout);
  EXPECT_GE(s.elapsed_ms, 200);
  EXPECT_LT(s.elapsed_ms, 202);
}

TEST(BenchStopping, MinimumsAndCaps) {
  StoppingRule rule;
  rule.min_samples = 5;
  rule.min_time_ms = 10;
  rule.timeout_ms = 100;
  rule.max_samples = 1000;
  const std::vector<double> flat(5, 1.0);
  EXPECT_EQ(check_stop(rule, flat, 5.0), StopReason::kContinue);  // too early
  EXPECT_EQ(check_stop(rule, flat, 10.0), StopReason::kConverged);
  EXPECT_EQ(check_stop(rule, std::vector<double>(4, 1.0), 50.0), StopReason::kContinue);  // too few
  EXPECT_EQ(check_stop(rule, std::vector<double>{}, 500.0), StopReason::kContinue);  // none yet
  EXPECT_EQ(check_stop(rule, std::vector<double>(1000, 1.0), 1.0), StopReason::kMaxSamples);
}

class FakeSource : public SampleSource {
 public:
  explicit FakeSource(std::vector<double> values) : values_(std::move(values)) {}
  double sample_ms() override { return values_[count_++ % values_.size()]; }
  std::size_t count_ = 0;

 private:
  std::vector<double> values_;
};

class ThrottleEvery : public ClockMonitor {
 public:
  explicit ThrottleEvery(int period) : period_(period) {}
  std::optional<ClockObservation> observe() override {
    ClockObservation o;
    o.sm_mhz = 1700 + (calls_ % 3) * 10;  // within 3 %: no clock drop
    o.throttled = ++calls_ % period_ == 0;
    o.reasons = o.throttled ? "hw-thermal" : "";
    return o;
  }

 private:
  int period_;
  int calls_ = 0;
};

TimingOptions quick_options() {
  TimingOptions t;
  t.warmup_ms = 0;
  t.warmup_min = 2;
  t.stop.min_samples = 10;
  t.stop.min_time_ms = 0;
  t.stop.timeout_ms = 50;
  t.throttle_recovery_ms = 0;
  return t;
}

TEST(BenchTiming, WarmupSamplesAreDiscardedAndThrottledSamplesRetaken) {
  FakeSource source({1.0});
  ThrottleEvery monitor(4);
  const SampleSet s = collect_samples(source, quick_options(), &monitor);
  EXPECT_EQ(s.reason, StopReason::kConverged);
  EXPECT_EQ(s.ms.size(), 10u);
  EXPECT_EQ(s.throttle_retakes, 3);  // samples 4, 8 and 12 of 13 were throttled
  EXPECT_EQ(source.count_, 2u + 13u);
  EXPECT_FALSE(s.throttled);
  EXPECT_EQ(s.sm_mhz_min, 1700);
  EXPECT_EQ(s.sm_mhz_max, 1720);
}

// No reason reported, but the clock fell more than 3 % under the highest seen: retaken.
class ClockDipEvery : public ClockMonitor {
 public:
  explicit ClockDipEvery(int period) : period_(period) {}
  std::optional<ClockObservation> observe() override {
    ClockObservation o;
    o.sm_mhz = ++calls_ % period_ == 0 ? 1900 : 1980;
    return o;
  }

 private:
  int period_;
  int calls_ = 0;
};

// start() comes once per row, after the warm-up and before the first timed sample (what a
// monitor compares its cumulative counters against).
class CountingMonitor : public ClockMonitor {
 public:
  explicit CountingMonitor(const FakeSource& source) : source_(source) {}
  void start() override {
    ++starts_;
    samples_at_start_ = source_.count_;
  }
  std::optional<ClockObservation> observe() override {
    EXPECT_EQ(starts_, 1) << "observe() before start()";
    return ClockObservation{};
  }
  int starts_ = 0;
  std::size_t samples_at_start_ = 0;

 private:
  const FakeSource& source_;
};

TEST(BenchTiming, MonitorStartsAfterTheWarmup) {
  FakeSource source({1.0});
  CountingMonitor monitor(source);
  const SampleSet s = collect_samples(source, quick_options(), &monitor);
  EXPECT_EQ(monitor.starts_, 1);
  EXPECT_EQ(monitor.samples_at_start_, 2u);  // the two warm-up samples
  EXPECT_EQ(s.ms.size(), 10u);
}

TEST(BenchTiming, ClockDropsCountAsThrottled) {
  FakeSource source({1.0});
  ClockDipEvery monitor(4);
  const SampleSet s = collect_samples(source, quick_options(), &monitor);
  EXPECT_EQ(s.ms.size(), 10u);
  EXPECT_EQ(s.throttle_retakes, 3);
  EXPECT_EQ(s.throttle_reasons, "clock-drop");
  EXPECT_EQ(s.sm_mhz_min, 1980);  // the kept samples' clocks
  EXPECT_EQ(monitor.highest_mhz, 1980);
}

// Each retake waits the recovery time first, so the power average can fall under the cap.
TEST(BenchTiming, ThrottledSamplesWaitBeforeTheRetake) {
  FakeSource source({1.0});
  ThrottleEvery monitor(4);
  TimingOptions t = quick_options();
  t.stop.timeout_ms = 10000;
  t.throttle_recovery_ms = 20;
  const auto start = std::chrono::steady_clock::now();
  const SampleSet s = collect_samples(source, t, &monitor);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(s.throttle_retakes, 3);
  EXPECT_EQ(s.ms.size(), 10u);
  EXPECT_GE(ms, 3 * 20.0);
}

TEST(BenchTiming, RetakesAreBounded) {
  FakeSource source({1.0});
  ThrottleEvery always(1);
  TimingOptions t = quick_options();
  t.max_throttle_retakes = 5;
  const SampleSet s = collect_samples(source, t, &always);
  EXPECT_EQ(s.throttle_retakes, 5);
  EXPECT_TRUE(s.throttled);
  EXPECT_EQ(s.throttle_reasons, "hw-thermal");
  EXPECT_EQ(s.ms.size(), 10u);
}

TEST(BenchTiming, InterruptStopsAfterTheCurrentSample) {
  FakeSource source({1.0, 2.0});
  request_interrupt();
  const SampleSet s = collect_samples(source, quick_options(), nullptr);
  clear_interrupt();
  EXPECT_EQ(s.reason, StopReason::kInterrupted);
  EXPECT_TRUE(s.ms.empty());
}

TEST(BenchTiming, HostTimerMeasuresWallTime) {
  int calls = 0;
  HostSampleSource source([&](int set) {
    EXPECT_EQ(set, calls++ % 3);
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    while (std::chrono::steady_clock::now() < until) {
    }
  }, 3);
  for (int i = 0; i < 6; ++i) {
    const double ms = source.sample_ms();
    EXPECT_GE(ms, 0.2);
    EXPECT_LT(ms, 50.0);
  }
}

}  // namespace
}  // namespace trainscale::bench
