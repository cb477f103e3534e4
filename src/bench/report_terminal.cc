#include <algorithm>
#include <map>
#include <ostream>
#include <utility>

#include "bench/engine.h"
#include "bench/reporters.h"

namespace trainscale::bench {

void write_aligned(std::ostream& out, const std::vector<Cells>& lines) {
  std::vector<std::size_t> widths;
  for (const Cells& cells : lines) {
    widths.resize(std::max(widths.size(), cells.size()));
    for (std::size_t c = 0; c < cells.size(); ++c) widths[c] = std::max(widths[c], cells[c].size());
  }
  for (std::size_t l = 0; l < lines.size(); ++l) {
    for (std::size_t c = 0; c < lines[l].size(); ++c) {
      const std::string& cell = lines[l][c];
      // Kernel names left-aligned, numbers right-aligned.
      if (c == 0) {
        out << cell << std::string(widths[c] - cell.size(), ' ');
      } else {
        out << " | " << std::string(widths[c] - cell.size(), ' ') << cell;
      }
    }
    out << '\n';
    if (l == 0) {
      std::size_t total = 0;
      for (std::size_t w : widths) total += w + 3;
      out << std::string(total - 3, '-') << '\n';
    }
  }
}

std::vector<std::string> summary_lines(const RunResult& result) {
  std::vector<std::string> lines;
  std::int64_t timed = 0, ours_failed = 0, base_failed = 0;
  for (const Row& r : result.rows) {
    timed += r.status == Status::kOk;
    (r.baseline ? base_failed : ours_failed) += r.status == Status::kFailed;
  }
  std::string head = std::to_string(timed) + " rows timed";
  if (result.wall_seconds > 0) head += " in " + format_fixed(result.wall_seconds, 0) + " s";
  head += "; failed: " + std::to_string(ours_failed) + " of ours, " + std::to_string(base_failed) + " baseline rows";
  if (result.interrupted) head += "; interrupted";
  lines.push_back(head);

  const std::vector<Pairing> pairings = pair_rows(result.rows);
  std::vector<std::string> baselines;
  for (const Pairing& p : pairings) {
    if (p.base && std::find(baselines.begin(), baselines.end(), p.base->impl) == baselines.end()) {
      baselines.push_back(p.base->impl);
    }
  }
  for (const std::string& name : baselines) {
    std::int64_t count = 0;
    for (const Pairing& p : pairings) count += p.base && p.base->impl == name && p.speedup() > 0;
    if (count > 0) {
      lines.push_back("geomean speedup over " + name + ": " + format_fixed(geomean_speedup(pairings, name), 3) +
                      "x (" + std::to_string(count) + " cases)");
    }
  }

  std::vector<std::string> ops;
  std::map<std::string, std::vector<double>> pct;
  std::map<std::string, std::string> unit;
  for (const Row& r : result.rows) {
    if (r.baseline || r.status != Status::kOk || !r.pct_roofline) continue;
    if (!pct.contains(r.op)) ops.push_back(r.op);
    pct[r.op].push_back(*r.pct_roofline);
    unit[r.op] = r.bound == Bound::kMemory ? "DRAM bandwidth" : "bf16 GEMM";
  }
  for (const std::string& op : ops) {
    std::vector<double>& v = pct[op];
    std::sort(v.begin(), v.end());
    std::string line = op + ": " + format_fixed(v[v.size() / 2], 1) + " % of " + unit[op];
    if (v.size() > 1) line += " (" + format_fixed(v.front(), 1) + "-" + format_fixed(v.back(), 1) + " over " +
                              std::to_string(v.size()) + " shapes)";
    lines.push_back(line);
  }

  std::vector<std::string> cpu_only;
  for (const SkippedCase& s : result.skipped) {
    if (s.reason != kCpuReferenceOnly) continue;
    const std::string op = s.case_name.substr(0, s.case_name.find(' '));
    if (std::find(cpu_only.begin(), cpu_only.end(), op) == cpu_only.end()) cpu_only.push_back(op);
  }
  if (!cpu_only.empty()) {
    std::string line = std::string(kCpuReferenceOnly) + " (not run on the GPU):";
    for (std::size_t i = 0; i < cpu_only.size(); ++i) line += (i ? ", " : " ") + cpu_only[i];
    lines.push_back(line);
  }
  return lines;
}

void write_terminal_table(std::ostream& out, const RunResult& result) {
  const std::vector<Pairing> pairings = pair_rows(result.rows);
  const bool extra_memory = any_extra_memory(pairings);
  std::vector<Cells> lines = {{"Kernel", "Ours (ms)", "Base (ms)", "Speedup", "Metric", "Ours", "Base", "% roofline"}};
  if (extra_memory) lines[0].push_back("Extra memory");
  for (const Pairing& p : pairings) {
    const Row& any = p.ours ? *p.ours : *p.base;
    std::string kernel = any.case_name;
    if (p.ours) kernel += " [" + p.ours->impl + "]";
    if (p.base) kernel += " vs " + p.base->impl;
    const double speedup = p.speedup();
    const Row* ours_timed = p.ours && p.ours->ms.count > 0 ? p.ours : nullptr;
    lines.push_back({kernel, format_ms(p.ours), format_ms(p.base),
                     speedup > 0 ? format_fixed(speedup, 2) + "x" : "-", metric_unit(any), format_metric(p.ours),
                     format_metric(p.base),
                     ours_timed && ours_timed->pct_roofline ? format_fixed(*ours_timed->pct_roofline, 1) + "%" : "-"});
    if (extra_memory) lines.back().push_back(format_extra_memory(p));
  }
  write_aligned(out, lines);
  if (extra_memory) out << "Extra memory: beyond inputs and outputs (workspace), ours / baseline\n";

  std::vector<const Row*> rows;
  for (const Row& r : result.rows) rows.push_back(&r);
  for (const auto& [coverage, title] : {std::pair{RowCoverage::kPrefix, "Gated on a prefix problem"},
                                        std::pair{RowCoverage::kCaseSample, "Gated on sampled rows by the case's own fp64 check"}}) {
    const std::vector<std::string> notes = gate_notes(rows, coverage);
    if (!notes.empty()) out << '\n' << title << " (rows coupled, too large for a full fp64 reference):\n";
    for (const std::string& note : notes) out << "  " << note << '\n';
  }

  bool header = false;
  for (const Row& r : result.rows) {
    if (r.status == Status::kOk) continue;
    if (!header) out << "\nNot timed:\n";
    header = true;
    out << "  " << format_ms(&r) << "  " << r.key() << ": " << r.message << '\n';
  }
  bool skipped_header = false;
  for (const SkippedCase& s : result.skipped) {
    if (s.reason == kCpuReferenceOnly) continue;  // listed by op in the summary
    if (!skipped_header) out << "\nSkipped cases:\n";
    skipped_header = true;
    out << "  " << s.case_name << ": " << s.reason << '\n';
  }
  out << "\nSummary:\n";
  for (const std::string& line : summary_lines(result)) out << "  " << line << '\n';
}

}  // namespace trainscale::bench
