#include <cstdio>
#include <ostream>

#include "bench/reporters.h"

namespace trainscale::bench {
namespace {

// RFC 4180: quote fields holding a separator, a quote or a line break.
std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string quoted = "\"";
  for (char ch : s) {
    if (ch == '"') quoted += '"';
    quoted += ch;
  }
  return quoted + '"';
}

std::string number(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

std::vector<std::string> csv_values(const Row& r) {
  return {r.case_name, r.op, r.family, r.shape, r.dtype, r.impl, r.baseline ? "true" : "false", r.device,
          status_name(r.status), number(r.ms.median), number(r.ms.mean), number(r.ms.std), number(r.ms.min),
          number(r.ms.max), number(r.ms.p5), number(r.ms.p95), number(r.ms.p99), std::to_string(r.ms.count),
          number(r.ms.rel_noise), number(r.bytes), number(r.flops), bound_name(r.bound), number(r.gbps),
          number(r.tflops), r.pct_roofline ? number(*r.pct_roofline) : "", number(r.rel_l2), number(r.max_abs_err),
          number(r.tolerance), std::to_string(r.rows_checked), std::to_string(r.rows_total),
          coverage_name(r.rows_coverage), r.gate_scope, std::to_string(r.peak_memory_bytes),
          std::to_string(r.extra_memory_bytes), r.timer, std::to_string(r.batch),
          r.cold ? "true" : "false", number(r.sm_mhz_min), number(r.sm_mhz_max), std::to_string(r.throttle_retakes),
          r.throttled ? "true" : "false", r.message};
}

}  // namespace

std::vector<std::string> csv_columns() {
  return {"case", "op", "family", "shape", "dtype", "impl", "baseline", "device", "status", "median_ms", "mean_ms",
          "std_ms", "min_ms", "max_ms", "p5_ms", "p95_ms", "p99_ms", "samples", "rel_noise", "bytes", "flops", "bound",
          "gbps", "tflops", "pct_roofline", "rel_l2", "max_abs_err", "tolerance", "rows_checked", "rows_total",
          "gate_rows", "gate_scope", "peak_memory_bytes", "extra_memory_bytes", "timer",
          "batch", "cold", "sm_mhz_min", "sm_mhz_max", "throttle_retakes", "throttled", "message"};
}

void write_csv(std::ostream& out, const RunResult& result) {
  auto write_line = [&](const std::vector<std::string>& fields) {
    for (std::size_t i = 0; i < fields.size(); ++i) out << (i ? "," : "") << csv_field(fields[i]);
    out << '\n';
  };
  write_line(csv_columns());
  for (const Row& r : result.rows) write_line(csv_values(r));
}

}  // namespace trainscale::bench
