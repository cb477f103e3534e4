#include <algorithm>
#include <map>
#include <ostream>

#include "bench/reporters.h"

namespace trainscale::bench {
namespace {

std::string device_label(const Environment& env) {
  return env.device == "cuda" ? env.gpu_name : "CPU (" + env.cpu_name + ")";
}

void write_environment(std::ostream& out, const RunResult& r) {
  const Environment& e = r.env;
  out << "| | |\n|---|---|\n";
  out << "| Device | " << device_label(e) << " |\n";
  if (e.device == "cuda") {
    out << "| GPU | " << e.sm_count << " SMs, CC " << e.compute_capability << ", L2 "
        << format_bytes(static_cast<double>(e.l2_bytes)) << ", " << format_bytes(static_cast<double>(e.memory_bytes))
        << " |\n";
    out << "| Software | driver " << e.driver << ", CUDA " << e.cuda_runtime << ", cuBLAS " << e.cublas << ", cuDNN "
        << (e.cudnn.empty() ? "-" : e.cudnn) << " |\n";
    out << "| Clocks at start (" << e.clock_source << ") | SM " << format_fixed(e.sm_clock_mhz, 0) << " / "
        << format_fixed(e.sm_clock_max_mhz, 0) << " MHz, memory " << format_fixed(e.mem_clock_mhz, 0) << " MHz, "
        << format_fixed(e.power_w, 0) << " W, " << format_fixed(e.temperature_c, 0) << " C |\n";
  }
  out << "| Commit | `" << e.git_commit << "` |\n";
  out << "| Date (UTC) | " << e.date_utc << " |\n";
  out << "| Seed | " << e.seed << " |\n";
  out << "| Command | `" << e.command_line << "` |\n";
  if (r.roofline) {
    out << "| Roofline | copy " << format_fixed(r.roofline->copy_gbps, 0) << " GB/s, read "
        << format_fixed(r.roofline->read_gbps, 0) << " GB/s, 2 reads per write "
        << format_fixed(r.roofline->read2_write1_gbps, 0) << " GB/s, bf16 GEMM "
        << format_fixed(r.roofline->gemm_bf16_tflops, 1) << " TFLOP/s";
    if (r.roofline->empty_kernel_us > 0) {
      out << ", empty kernel " << format_fixed(r.roofline->empty_kernel_us, 2) << " us";
    }
    out << " |\n";
    for (const std::string& raised : r.roofline->raised_by) out << "| Ceiling raised to a row | " << raised << " |\n";
  }
  out << '\n';
}

std::vector<std::string> baseline_names(const std::vector<Pairing>& pairings) {
  std::vector<std::string> names;
  for (const Pairing& p : pairings) {
    if (p.base && std::find(names.begin(), names.end(), p.base->impl) == names.end()) names.push_back(p.base->impl);
  }
  return names;
}

void write_geomeans(std::ostream& out, const std::vector<Pairing>& pairings) {
  const std::vector<std::string> names = baseline_names(pairings);
  if (names.empty()) return;
  out << "| Baseline | Cases timed | Geomean speedup (base ms / ours ms) |\n|---|---:|---:|\n";
  for (const std::string& name : names) {
    std::int64_t count = 0;
    for (const Pairing& p : pairings) count += p.base && p.base->impl == name && p.speedup() > 0;
    out << "| " << name << " | " << count << " | " << format_fixed(geomean_speedup(pairings, name), 3) << "x |\n";
  }
  out << '\n';
}

std::string noise_cell(const Row* r) {
  return r && r->ms.count > 0 ? format_fixed(100.0 * r->ms.rel_noise, 2) + "% (" + std::to_string(r->ms.count) + ")"
                              : "-";
}

// One table per op, rows in run order.
void write_op_tables(std::ostream& out, const std::vector<Pairing>& pairings, bool with_run_column,
                     const std::map<const Row*, std::string>& run_of_row) {
  std::vector<std::string> ops;
  for (const Pairing& p : pairings) {
    const Row& any = p.ours ? *p.ours : *p.base;
    if (std::find(ops.begin(), ops.end(), any.op) == ops.end()) ops.push_back(any.op);
  }
  for (const std::string& op : ops) {
    std::vector<Pairing> of_op;
    for (const Pairing& p : pairings) {
      if ((p.ours ? *p.ours : *p.base).op == op) of_op.push_back(p);
    }
    const bool extra_memory = any_extra_memory(of_op);
    out << "## " << op << "\n\n";
    out << (with_run_column ? "| Run " : "")
        << "| Shape | dtype | Ours | Ours (ms) | Base | Base (ms) | Speedup | Metric | Ours | Base | % roofline | "
           "Noise (samples) |"
        << (extra_memory ? " Extra memory |" : "") << "\n"
        << (with_run_column ? "|---" : "") << "|---|---|---|---:|---|---:|---:|---|---:|---:|---:|---:|"
        << (extra_memory ? "---:|" : "") << "\n";
    for (const Pairing& p : of_op) {
      const Row& any = p.ours ? *p.ours : *p.base;
      const double speedup = p.speedup();
      if (with_run_column) out << "| " << run_of_row.at(&any) << " ";
      out << "| " << any.shape << " | " << any.dtype << " | " << (p.ours ? p.ours->impl : "-") << " | "
          << format_ms(p.ours) << " | " << (p.base ? p.base->impl : "-") << " | " << format_ms(p.base) << " | "
          << (speedup > 0 ? format_fixed(speedup, 2) + "x" : "-") << " | " << metric_unit(any) << " | "
          << format_metric(p.ours) << " | " << format_metric(p.base) << " | "
          << (p.ours && p.ours->pct_roofline ? format_fixed(*p.ours->pct_roofline, 1) + "%" : "-") << " | "
          << noise_cell(p.ours) << " |";
      if (extra_memory) out << ' ' << format_extra_memory(p) << " |";
      out << '\n';
    }
    out << '\n';
    if (extra_memory) out << "Extra memory: beyond inputs and outputs (workspace), ours / baseline.\n\n";
  }
}

void write_problems(std::ostream& out, const std::vector<const Row*>& rows, const std::vector<SkippedCase>& skipped) {
  bool header = false;
  for (const Row* r : rows) {
    if (r->status == Status::kOk) continue;
    if (!header) out << "## Not timed\n\n| Case | Impl | Status | Message |\n|---|---|---|---|\n";
    header = true;
    std::string message = r->message;
    for (char& ch : message) ch = ch == '|' ? '/' : ch == '\n' ? ' ' : ch;
    out << "| " << r->case_name << " | " << r->impl << " | " << format_ms(r) << " | " << message << " |\n";
  }
  if (header) out << '\n';
  const auto gate_section = [&](RowCoverage coverage, const char* title, const char* how) {
    const std::vector<std::string> notes = gate_notes(rows, coverage);
    if (notes.empty()) return;
    out << "## " << title << "\n\nRows coupled and too large for a full fp64 reference: " << how
        << " (docs/benchmarking.md).\n\n";
    for (const std::string& note : notes) out << "- " << note << '\n';
    out << '\n';
  };
  gate_section(RowCoverage::kPrefix, "Gated on a prefix problem", "the gate ran the first rows only");
  gate_section(RowCoverage::kCaseSample, "Gated on sampled rows",
               "the case's own fp64 check of sampled rows of the full call");
  if (skipped.empty()) return;
  out << "## Skipped cases\n\n| Case | Reason |\n|---|---|\n";
  for (const SkippedCase& s : skipped) out << "| " << s.case_name << " | " << s.reason << " |\n";
  out << '\n';
}

}  // namespace

double geomean_speedup(const std::vector<Pairing>& pairings, const std::string& baseline) {
  std::vector<double> speedups;
  for (const Pairing& p : pairings) {
    if (p.base && p.base->impl == baseline && p.speedup() > 0) speedups.push_back(p.speedup());
  }
  return geomean(speedups);
}

void write_markdown(std::ostream& out, const RunResult& result) {
  out << "# TrainScale benchmark: " << result.suite << " on " << device_label(result.env) << "\n\n";
  if (result.interrupted) out << "**Interrupted**: the run was stopped before every case was measured.\n\n";
  write_environment(out, result);
  out << "## Summary\n\n";
  for (const std::string& line : summary_lines(result)) out << "- " << line << '\n';
  out << '\n';
  const std::vector<Pairing> pairings = pair_rows(result.rows);
  write_geomeans(out, pairings);
  write_op_tables(out, pairings, false, {});
  std::vector<const Row*> rows;
  for (const Row& r : result.rows) rows.push_back(&r);
  write_problems(out, rows, result.skipped);
}

void write_markdown_report(std::ostream& out, const std::vector<std::pair<std::string, RunResult>>& runs) {
  out << "# TrainScale benchmark report\n\n";
  out << "| Run | Suite | Device | Commit | Date (UTC) | Rows |\n|---|---|---|---|---|---:|\n";
  for (const auto& [name, r] : runs) {
    out << "| " << name << " | " << r.suite << " | " << device_label(r.env) << " | `" << r.env.git_commit.substr(0, 12)
        << "` | " << r.env.date_utc << " | " << r.rows.size() << " |\n";
  }
  out << '\n';
  std::vector<Pairing> pairings;
  std::map<const Row*, std::string> run_of_row;
  std::vector<const Row*> rows;
  std::vector<SkippedCase> skipped;
  for (const auto& [name, r] : runs) {
    for (const Pairing& p : pair_rows(r.rows)) {
      pairings.push_back(p);
      run_of_row[p.ours ? p.ours : p.base] = name;
    }
    for (const Row& row : r.rows) rows.push_back(&row);
    for (const SkippedCase& s : r.skipped) skipped.push_back({name + ": " + s.case_name, s.reason});
  }
  write_geomeans(out, pairings);
  write_op_tables(out, pairings, true, run_of_row);
  write_problems(out, rows, skipped);
}

}  // namespace trainscale::bench
