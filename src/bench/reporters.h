// Human- and spreadsheet-facing views of a run: terminal table, CSV, Markdown.
#pragma once

#include <functional>
#include <iosfwd>
#include <string>
#include <utility>
#include <vector>

#include "bench/result.h"

namespace trainscale::bench {

// Our row of a case next to one baseline row (or none).
struct Pairing {
  const Row* ours = nullptr;
  const Row* base = nullptr;
  // base median / ours median; 0 when either is not timed.
  double speedup() const;
};
// In row order: one pairing per (case, baseline), or one with base == nullptr when the case
// has no baseline rows.
std::vector<Pairing> pair_rows(const std::vector<Row>& rows);

// Shared cell formats.
std::string format_ms(const Row* row);       // "0.1234", "FAILED", "UNSUPPORTED", "-"
std::string format_metric(const Row* row);   // GB/s or TFLOP/s by the row's bound, "-"
std::string metric_unit(const Row& row);     // "GB/s" or "TFLOP/s"
std::string format_fixed(double v, int decimals);
std::string format_bytes(double bytes);  // "1.5 GiB"

// One line per case whose gate had this coverage, in the order cases appear. kPrefix (rows
// coupled, so no sample): "<case>: gated on the first M' of M rows (timed on all)"; kCaseSample
// (the case's own check of sampled rows): "<case>: <Row::gate_scope>".
std::vector<std::string> gate_notes(const std::vector<const Row*>& rows, RowCoverage coverage);

// Memory beyond inputs and outputs (Row::extra_memory_bytes) of a pairing: "544.0 MiB", or
// "544.0 MiB / 2.0 GiB" with a baseline, "-" for a row that was not run.
std::string format_extra_memory(const Pairing& p);
// Whether any row has memory beyond its inputs and outputs (reports then show the column).
bool any_extra_memory(const std::vector<Pairing>& pairings);

// A plain-text table: first line the header (underlined), first column left-aligned, the
// others right-aligned, " | " between columns.
using Cells = std::vector<std::string>;
void write_aligned(std::ostream& out, const std::vector<Cells>& lines);

// One screen: wall time, rows timed and failed (ours / baselines), geomean speedup over each
// baseline, our % of roofline per op (median over its shapes, with the range), and the ops that
// have only their CPU reference.
std::vector<std::string> summary_lines(const RunResult& result);

// Kernel | Ours (ms) | Base (ms) | Speedup | Metric | Ours | Base | % roofline, then failures,
// skipped cases with their messages, and the summary.
void write_terminal_table(std::ostream& out, const RunResult& result);

// One line per row with every field (stable column order, header first).
void write_csv(std::ostream& out, const RunResult& result);
std::vector<std::string> csv_columns();

// Environment, roofline, one table per op, geomean speedup over each baseline, failures.
void write_markdown(std::ostream& out, const RunResult& result);
// Several runs (name, result) on one page: a table of the runs, then per-op tables with a Run
// column (trainscale-bench report DIR).
void write_markdown_report(std::ostream& out, const std::vector<std::pair<std::string, RunResult>>& runs);
// Geomean of the speedups over baseline `name` among timed pairings.
double geomean_speedup(const std::vector<Pairing>& pairings, const std::string& baseline);

// Writes `write(stream)` to `path`; throws trainscale::Error when it cannot.
void write_text_file(const std::string& path, const std::function<void(std::ostream&)>& write);

}  // namespace trainscale::bench
