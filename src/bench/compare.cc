#include "bench/compare.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <ostream>

#include "bench/reporters.h"

namespace trainscale::bench {

const char* verdict_name(Verdict verdict) {
  switch (verdict) {
    case Verdict::kFaster: return "FASTER";
    case Verdict::kSlower: return "SLOWER";
    case Verdict::kSame: return "SAME";
    case Verdict::kNotTimed: return "NOT TIMED";
    case Verdict::kOnlyOld: return "REMOVED";
    case Verdict::kOnlyNew: return "NEW";
  }
  return "unknown";
}

bool Comparison::regressed() const {
  return std::any_of(rows.begin(), rows.end(), [](const RowComparison& r) { return r.regression; });
}

namespace {

// Appends rather than prepends: GCC 12 warns (-Wrestrict, a false positive) on "x" + string.
std::string percent(double fraction, const char* prefix) {
  std::string s = prefix;
  s += format_fixed(100.0 * fraction, 1);
  s += '%';
  return s;
}

bool timed(const Row* r) { return r && r->status == Status::kOk && r->ms.median > 0; }

// How well a row's median is known, in ms: its CI half-width, but never finer than the timer.
// CUDA documents cudaEventElapsedTime's resolution as about 0.5 us; a stable kernel's samples
// all round the same way, so that error does not average out over many samples.
double uncertainty_ms(const Row& r) {
  constexpr double kEventResolutionMs = 0.5e-3;
  double resolution = 0;
  if (r.timer.starts_with("cuda-events")) resolution = kEventResolutionMs;
  if (r.timer.starts_with("cuda-graph")) resolution = kEventResolutionMs / std::max(r.batch, 1);
  return std::max(r.ms.rel_noise * r.ms.median, resolution);
}

RowComparison compare_row(const Row* old_row, const Row* new_row, double threshold) {
  RowComparison c;
  c.key = (old_row ? old_row : new_row)->key();
  c.old_row = old_row;
  c.new_row = new_row;
  if (!old_row) {
    c.verdict = Verdict::kOnlyNew;
    c.regression = new_row->status == Status::kFailed;
    return c;
  }
  if (!new_row) {
    c.verdict = Verdict::kOnlyOld;
    return c;
  }
  if (!timed(old_row) || !timed(new_row)) {
    c.verdict = Verdict::kNotTimed;
    // Passing before and failing now is a regression whatever the speed.
    c.regression = new_row->status == Status::kFailed && old_row->status != Status::kFailed;
    return c;
  }
  const double old_ms = old_row->ms.median, new_ms = new_row->ms.median;
  c.change = new_ms / old_ms - 1.0;
  const double half_widths = uncertainty_ms(*old_row) + uncertainty_ms(*new_row);
  c.noise = half_widths / old_ms;
  if (std::fabs(new_ms - old_ms) <= half_widths) {
    c.verdict = Verdict::kSame;
  } else {
    c.verdict = new_ms < old_ms ? Verdict::kFaster : Verdict::kSlower;
  }
  c.regression = c.verdict == Verdict::kSlower && c.change > threshold;
  return c;
}

}  // namespace

Comparison compare_runs(const RunResult& old_run, const RunResult& new_run, double threshold) {
  Comparison comparison;
  comparison.threshold = threshold;
  std::map<std::string, const Row*> old_by_key;
  for (const Row& r : old_run.rows) old_by_key[r.key()] = &r;
  for (const Row& r : new_run.rows) {
    const auto it = old_by_key.find(r.key());
    const Row* old_row = it == old_by_key.end() ? nullptr : it->second;
    comparison.rows.push_back(compare_row(old_row, &r, threshold));
    if (old_row) old_by_key.erase(it);
  }
  for (const Row& r : old_run.rows) {
    if (old_by_key.count(r.key())) comparison.rows.push_back(compare_row(&r, nullptr, threshold));
  }
  return comparison;
}

void write_comparison(std::ostream& out, const Comparison& comparison, bool markdown) {
  std::vector<Cells> lines = {{"Row", "Old (ms)", "New (ms)", "Change", "Noise", "Verdict"}};
  for (const RowComparison& c : comparison.rows) {
    const bool numbers = c.verdict == Verdict::kFaster || c.verdict == Verdict::kSlower || c.verdict == Verdict::kSame;
    std::string verdict = verdict_name(c.verdict);
    if (c.regression) verdict += " (regression)";
    lines.push_back({c.key, format_ms(c.old_row), format_ms(c.new_row),
                     numbers ? percent(c.change, c.change >= 0 ? "+" : "") : "-",
                     numbers ? percent(c.noise, "+-") : "-", verdict});
  }
  if (markdown) {
    for (std::size_t l = 0; l < lines.size(); ++l) {
      out << '|';
      for (const std::string& cell : lines[l]) out << ' ' << cell << " |";
      out << '\n';
      if (l == 0) out << "|---|---:|---:|---:|---:|---|\n";
    }
    out << '\n';
  } else {
    write_aligned(out, lines);
  }
  std::map<Verdict, int> counts;
  int regressions = 0;
  for (const RowComparison& c : comparison.rows) {
    ++counts[c.verdict];
    regressions += c.regression;
  }
  out << counts[Verdict::kFaster] << " faster, " << counts[Verdict::kSlower] << " slower, "
      << counts[Verdict::kSame] << " same, " << counts[Verdict::kNotTimed] << " not timed, " << counts[Verdict::kOnlyNew]
      << " new, " << counts[Verdict::kOnlyOld] << " removed; " << regressions << " regression(s) beyond "
      << format_fixed(100.0 * comparison.threshold, 1) << "%\n";
}

}  // namespace trainscale::bench
