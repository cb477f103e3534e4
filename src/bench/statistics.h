// Summary statistics of timing samples. The median is the primary figure; its relative noise
// is the half-width of a distribution-free 95% confidence interval of the median (order
// statistics), divided by the median.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace trainscale::bench {

struct Summary {
  std::int64_t count = 0;
  double median = 0, mean = 0, std = 0, min = 0, max = 0;
  double p5 = 0, p95 = 0, p99 = 0;
  // Half-width of the 95% CI of the median / median (0 when count < 2).
  double rel_noise = 0;
};

// Percentile with linear interpolation between closest ranks (NumPy's default); q in [0, 100].
// `sorted` must be ascending and non-empty.
double percentile_sorted(std::span<const double> sorted, double q);

// Order-statistic 95% confidence interval of the median: with n samples sorted, the ranks
// n/2 -+ 1.96 sqrt(n)/2 (normal approximation of Binomial(n, 1/2)), clamped to the data.
struct Interval {
  double lo = 0, hi = 0;
};
Interval median_ci95_sorted(std::span<const double> sorted);

// Relative noise of the median, as defined above; `sorted` ascending.
double median_rel_noise_sorted(std::span<const double> sorted);

Summary summarize(std::span<const double> samples);

// Geometric mean of positive values (0 when empty).
double geomean(std::span<const double> values);

}  // namespace trainscale::bench
