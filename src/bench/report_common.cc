#include "bench/reporters.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <map>

#include "trainscale/error.h"

namespace trainscale::bench {

double Pairing::speedup() const {
  if (!ours || !base || ours->status != Status::kOk || base->status != Status::kOk) return 0.0;
  if (ours->ms.median <= 0) return 0.0;
  return base->ms.median / ours->ms.median;
}

std::vector<Pairing> pair_rows(const std::vector<Row>& rows) {
  std::vector<Pairing> pairings;
  std::map<std::string, std::size_t> first_pairing_of_case;
  // Ours first, so baselines that come before it in the row order still pair with it.
  for (const Row& r : rows) {
    if (r.baseline || first_pairing_of_case.count(r.case_name)) continue;
    first_pairing_of_case[r.case_name] = pairings.size();
    pairings.push_back({&r, nullptr});
  }
  for (const Row& r : rows) {
    if (!r.baseline) continue;
    const auto it = first_pairing_of_case.find(r.case_name);
    if (it == first_pairing_of_case.end()) {
      first_pairing_of_case[r.case_name] = pairings.size();
      pairings.push_back({nullptr, &r});
    } else if (pairings[it->second].base == nullptr) {
      pairings[it->second].base = &r;
    } else {
      pairings.push_back({pairings[it->second].ours, &r});
    }
  }
  // Keep each case's pairings together, in the order cases first appear.
  std::stable_sort(pairings.begin(), pairings.end(), [&](const Pairing& a, const Pairing& b) {
    const Row* ra = a.ours ? a.ours : a.base;
    const Row* rb = b.ours ? b.ours : b.base;
    return first_pairing_of_case[ra->case_name] < first_pairing_of_case[rb->case_name];
  });
  return pairings;
}

std::vector<std::string> gate_notes(const std::vector<const Row*>& rows, RowCoverage coverage) {
  std::vector<std::string> notes;
  std::vector<std::string> cases;
  for (const Row* r : rows) {
    if (r->rows_coverage != coverage) continue;
    if (std::find(cases.begin(), cases.end(), r->case_name) != cases.end()) continue;
    cases.push_back(r->case_name);
    notes.push_back(coverage == RowCoverage::kPrefix
                        ? r->case_name + ": gated on the first " + std::to_string(r->rows_checked) + " of " +
                              std::to_string(r->rows_total) + " rows (timed on all)"
                        : r->case_name + ": " + r->gate_scope);
  }
  return notes;
}

std::string format_extra_memory(const Pairing& p) {
  const auto cell = [](const Row* r) {
    return r && r->status != Status::kUnsupported ? format_bytes(static_cast<double>(r->extra_memory_bytes)) : "-";
  };
  return p.base ? cell(p.ours) + " / " + cell(p.base) : cell(p.ours);
}

bool any_extra_memory(const std::vector<Pairing>& pairings) {
  return std::any_of(pairings.begin(), pairings.end(), [](const Pairing& p) {
    return (p.ours && p.ours->extra_memory_bytes > 0) || (p.base && p.base->extra_memory_bytes > 0);
  });
}

std::string format_fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

std::string format_ms(const Row* row) {
  if (!row) return "-";
  if (row->status == Status::kOk || (row->status == Status::kInterrupted && row->ms.count > 0)) {
    return format_fixed(row->ms.median, row->ms.median < 0.1 ? 5 : 4);
  }
  std::string s = status_name(row->status);
  for (char& ch : s) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  return s;
}

std::string metric_unit(const Row& row) { return row.bound == Bound::kMemory ? "GB/s" : "TFLOP/s"; }

std::string format_metric(const Row* row) {
  if (!row || row->ms.count == 0) return "-";
  return row->bound == Bound::kMemory ? format_fixed(row->gbps, 1) : format_fixed(row->tflops, 1);
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  return format_fixed(bytes, u == 0 ? 0 : 1) + " " + units[u];
}

void write_text_file(const std::string& path, const std::function<void(std::ostream&)>& write) {
  std::ofstream out(path);
  if (!out) throw Error("trainscale-bench: cannot write " + path);
  write(out);
  if (!out) throw Error("trainscale-bench: error writing " + path);
}

}  // namespace trainscale::bench
