// Row-by-row comparison of two runs. A timed row is FASTER or SLOWER only when the medians
// differ by more than the noise of both (the sum of the two medians' uncertainties: 95% CI
// half-width, at least the timer's resolution and kRunToRun of the median), else SAME; a
// SLOWER row beyond the threshold, or a row that passed its gate before and fails now, is a
// regression.
#pragma once

#include <iosfwd>
#include <string>
#include <string_view>
#include <vector>

#include "bench/result.h"

namespace trainscale::bench {

// The least relative uncertainty of a median when it is compared with another run's: what a
// re-run of the same commit moves a row by, beyond its own samples' CI.
inline constexpr double kRunToRun = 0.01;

enum class Verdict { kFaster, kSlower, kSame, kNotTimed, kOnlyOld, kOnlyNew };
const char* verdict_name(Verdict verdict);  // "FASTER", "SLOWER", "SAME", ...

struct RowComparison {
  std::string key;
  const Row* old_row = nullptr;
  const Row* new_row = nullptr;
  double change = 0;  // new median / old median - 1
  double noise = 0;   // relative: (old + new uncertainties) / old median
  Verdict verdict = Verdict::kSame;
  bool regression = false;
};

struct Comparison {
  std::vector<RowComparison> rows;
  double threshold = 0.05;
  bool regressed() const;
};

// The current name of a bench op: an op renamed since (rmsnorm_fwd -> rmsnorm_forward, ...)
// gets its new name, any other name comes back unchanged.
std::string_view current_op_name(std::string_view op);

// `threshold`: fraction (0.05 for 5%). Rows are matched by case and implementation, the ops
// under their current names, so results written before a rename still compare.
Comparison compare_runs(const RunResult& old_run, const RunResult& new_run, double threshold);

void write_comparison(std::ostream& out, const Comparison& comparison, bool markdown);

}  // namespace trainscale::bench
