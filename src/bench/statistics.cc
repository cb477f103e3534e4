#include "bench/statistics.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace trainscale::bench {

double percentile_sorted(std::span<const double> sorted, double q) {
  const double pos = q / 100.0 * static_cast<double>(sorted.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(pos));
  const std::size_t hi = std::min(lo + 1, sorted.size() - 1);
  const double frac = pos - static_cast<double>(lo);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * frac;
}

Interval median_ci95_sorted(std::span<const double> sorted) {
  const auto n = static_cast<double>(sorted.size());
  const double half_ranks = 1.96 * std::sqrt(n) / 2.0;
  // 1-based ranks, rounded outward so the interval is conservative.
  const auto lo_rank = static_cast<std::int64_t>(std::floor(n / 2.0 - half_ranks));
  const auto hi_rank = static_cast<std::int64_t>(std::ceil(n / 2.0 + half_ranks)) + 1;
  const auto last = static_cast<std::int64_t>(sorted.size());
  return {sorted[std::clamp<std::int64_t>(lo_rank, 1, last) - 1],
          sorted[std::clamp<std::int64_t>(hi_rank, 1, last) - 1]};
}

double median_rel_noise_sorted(std::span<const double> sorted) {
  if (sorted.size() < 2) return 0.0;
  const double median = percentile_sorted(sorted, 50.0);
  if (median <= 0.0) return 0.0;
  const Interval ci = median_ci95_sorted(sorted);
  return (ci.hi - ci.lo) / 2.0 / median;
}

Summary summarize(std::span<const double> samples) {
  Summary s;
  s.count = static_cast<std::int64_t>(samples.size());
  if (samples.empty()) return s;
  std::vector<double> sorted(samples.begin(), samples.end());
  std::sort(sorted.begin(), sorted.end());
  s.min = sorted.front();
  s.max = sorted.back();
  s.median = percentile_sorted(sorted, 50.0);
  s.p5 = percentile_sorted(sorted, 5.0);
  s.p95 = percentile_sorted(sorted, 95.0);
  s.p99 = percentile_sorted(sorted, 99.0);
  s.mean = std::accumulate(sorted.begin(), sorted.end(), 0.0) / static_cast<double>(sorted.size());
  if (sorted.size() > 1) {
    double ss = 0;
    for (double v : sorted) ss += (v - s.mean) * (v - s.mean);
    s.std = std::sqrt(ss / static_cast<double>(sorted.size() - 1));  // sample std
  }
  s.rel_noise = median_rel_noise_sorted(sorted);
  return s;
}

double geomean(std::span<const double> values) {
  if (values.empty()) return 0.0;
  double log_sum = 0;
  for (double v : values) log_sum += std::log(v);
  return std::exp(log_sum / static_cast<double>(values.size()));
}

}  // namespace trainscale::bench
