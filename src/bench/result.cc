#include "bench/result.h"

#include <algorithm>

namespace trainscale::bench {

namespace {
constexpr std::pair<Status, const char*> kStatusNames[] = {
    {Status::kOk, "ok"},
    {Status::kFailed, "failed"},
    {Status::kUnsupported, "unsupported"},
    {Status::kSkipped, "skipped"},
    {Status::kInterrupted, "interrupted"},
};
constexpr std::pair<RowCoverage, const char*> kCoverageNames[] = {
    {RowCoverage::kAll, "all"},
    {RowCoverage::kSample, "sample"},
    {RowCoverage::kPrefix, "prefix"},
    {RowCoverage::kGroups, "groups"},
    {RowCoverage::kCaseSample, "case-sample"},
};
}  // namespace

const char* status_name(Status status) {
  for (const auto& [s, name] : kStatusNames) {
    if (s == status) return name;
  }
  return "unknown";
}

std::optional<Status> parse_status(const std::string& name) {
  for (const auto& [s, n] : kStatusNames) {
    if (name == n) return s;
  }
  return std::nullopt;
}

const char* coverage_name(RowCoverage coverage) {
  for (const auto& [c, name] : kCoverageNames) {
    if (c == coverage) return name;
  }
  return "unknown";
}

std::optional<RowCoverage> parse_coverage(const std::string& name) {
  for (const auto& [c, n] : kCoverageNames) {
    if (name == n) return c;
  }
  return std::nullopt;
}

bool RunResult::any_failed() const {
  return std::any_of(rows.begin(), rows.end(),
                     [](const Row& r) { return !r.baseline && r.status == Status::kFailed; });
}

}  // namespace trainscale::bench
