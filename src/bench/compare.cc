#include "bench/compare.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <ostream>
#include <string_view>
#include <utility>

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

// How well a row's median is known for a comparison with another run, in ms: its CI
// half-width, but never finer than the timer or than kRunToRun of the median.
// - CUDA documents cudaEventElapsedTime's resolution as about 0.5 us; a stable kernel's samples
//   all round the same way, so that error does not average out over many samples.
// - The CI describes one run's samples only. A new run allocates its buffers elsewhere and
//   starts from another clock and thermal state: two back-to-back runs of one commit moved
//   GPU rows by up to 1.7 % (median 0.1 %) where their CIs were 0.1-1.4 % (docs/benchmarking.md).
double uncertainty_ms(const Row& r) {
  constexpr double kEventResolutionMs = 0.5e-3;
  double resolution = 0;
  if (r.timer.starts_with("cuda-events")) resolution = kEventResolutionMs;
  if (r.timer.starts_with("cuda-graph")) resolution = kEventResolutionMs / std::max(r.batch, 1);
  return std::max(std::max(r.ms.rel_noise, kRunToRun) * r.ms.median, resolution);
}

RowComparison compare_row(const Row* old_row, const Row* new_row, std::string key, double threshold) {
  RowComparison c;
  c.key = std::move(key);
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

std::string_view current_op_name(std::string_view op) {
  // Bench op names before the ops took their C++ entry points' names (result files written
  // then, e.g. bench/results/h100/, compare with new ones), sorted.
  static constexpr std::pair<std::string_view, std::string_view> kRenamed[] = {
    {"attention_bwd", "attention_backward"},
    {"attention_fwd", "attention_forward"},
    {"cross_entropy_fwd", "cross_entropy_forward"},
    {"cross_entropy_fwd_bwd", "cross_entropy_forward_with_grad"},
    {"fp8_quant_128x128", "fp8_quantize_128x128"},
    {"fp8_quant_128x128_t", "fp8_quantize_128x128_t"},
    {"fp8_quant_1x128", "fp8_quantize_1x128"},
    {"fp8_quant_1x128_t", "fp8_quantize_1x128_t"},
    {"fp8_quant_row", "fp8_quantize_row"},
    {"fp8_quant_tensor", "fp8_quantize_tensor"},
    {"fused_add_rmsnorm_bwd", "fused_add_rmsnorm_backward"},
    {"fused_add_rmsnorm_fwd", "fused_add_rmsnorm_forward"},
    {"geglu_bwd", "geglu_backward"},
    {"geglu_fwd", "geglu_forward"},
    {"gelu_bwd", "gelu_backward"},
    {"gelu_fwd", "gelu_forward"},
    {"gelu_tanh_bwd", "gelu_backward_tanh"},
    {"gelu_tanh_fwd", "gelu_forward_tanh"},
    {"layernorm_bwd", "layernorm_backward"},
    {"layernorm_fwd", "layernorm_forward"},
    {"mse_bwd", "mse_backward"},
    {"mse_fwd", "mse_forward"},
    {"rmsnorm_bwd", "rmsnorm_backward"},
    {"rmsnorm_fwd", "rmsnorm_forward"},
    {"rope_bwd", "rope_backward"},
    {"rope_fwd", "rope_forward"},
    {"silu_bwd", "silu_backward"},
    {"silu_fwd", "silu_forward"},
    {"softmax_bwd", "softmax_backward"},
    {"softmax_fwd", "softmax_forward"},
    {"swiglu_bwd", "swiglu_backward"},
    {"swiglu_fwd", "swiglu_forward"},
    {"swiglu_packed_bwd", "swiglu_backward_packed"},
    {"swiglu_packed_fwd", "swiglu_forward_packed"},
  };
  const auto it = std::lower_bound(std::begin(kRenamed), std::end(kRenamed), op,
                                   [](const auto& entry, std::string_view name) { return entry.first < name; });
  return it != std::end(kRenamed) && it->first == op ? it->second : op;
}

namespace {

// Row::key() with the op under its current name: "<op> <shape> <dtype> | <impl>".
std::string current_key(const Row& r) {
  const std::string key = r.key();
  const std::size_t end = key.find(' ');
  const std::string_view op = std::string_view(key).substr(0, end);
  const std::string_view current = current_op_name(op);
  return current == op ? key : std::string(current) + key.substr(op.size());
}

}  // namespace

Comparison compare_runs(const RunResult& old_run, const RunResult& new_run, double threshold) {
  Comparison comparison;
  comparison.threshold = threshold;
  std::map<std::string, const Row*> old_by_key;
  for (const Row& r : old_run.rows) old_by_key[current_key(r)] = &r;
  for (const Row& r : new_run.rows) {
    const std::string key = current_key(r);
    const auto it = old_by_key.find(key);
    const Row* old_row = it == old_by_key.end() ? nullptr : it->second;
    comparison.rows.push_back(compare_row(old_row, &r, key, threshold));
    if (old_row) old_by_key.erase(it);
  }
  for (const Row& r : old_run.rows) {
    const std::string key = current_key(r);
    if (old_by_key.count(key)) comparison.rows.push_back(compare_row(&r, nullptr, key, threshold));
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
