#include <ostream>

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

void write_terminal_table(std::ostream& out, const RunResult& result) {
  std::vector<Cells> lines = {{"Kernel", "Ours (ms)", "Base (ms)", "Speedup", "Metric", "Ours", "Base", "% roofline"}};
  for (const Pairing& p : pair_rows(result.rows)) {
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
  }
  write_aligned(out, lines);

  std::vector<const Row*> rows;
  for (const Row& r : result.rows) rows.push_back(&r);
  const std::vector<std::string> prefix_notes = prefix_gate_notes(rows);
  if (!prefix_notes.empty()) out << "\nGated on a prefix problem (rows coupled, too large for a full fp64 reference):\n";
  for (const std::string& note : prefix_notes) out << "  " << note << '\n';

  bool header = false;
  for (const Row& r : result.rows) {
    if (r.status == Status::kOk) continue;
    if (!header) out << "\nNot timed:\n";
    header = true;
    out << "  " << format_ms(&r) << "  " << r.key() << ": " << r.message << '\n';
  }
  if (!result.skipped.empty()) {
    out << "\nSkipped cases:\n";
    for (const SkippedCase& s : result.skipped) out << "  " << s.case_name << ": " << s.reason << '\n';
  }
}

}  // namespace trainscale::bench
