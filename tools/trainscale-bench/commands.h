// The CLI's commands; main.cc only parses arguments into these structs.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/timing.h"

namespace trainscale::bench::cli {

// Exit codes: 0 success, 1 a FAILED row / a regression / a runtime error, 2 bad usage,
// 130 interrupted (results so far are still written).
inline constexpr int kExitOk = 0, kExitFailure = 1, kExitUsage = 2, kExitInterrupted = 130;

// Bad arguments: printed on stderr, exit code 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct RunArgs {
  std::string suite = "smoke";
  std::vector<std::string> ops, dtypes, configs, impls;
  bool list = false;
  std::string json, csv, md;
  std::string device = "auto";  // auto | cpu | cuda
  int gpu = 0;
  std::uint64_t seed = 1;
  TimingOptions timing;
  bool refresh_roofline = false;
  bool no_roofline = false;
  bool quiet = false;
  std::string command_line;
};

struct RooflineArgs {
  int gpu = 0;
  bool refresh = false;
  std::string json, md;
  TimingOptions timing;
  std::string command_line;
};

struct CompareArgs {
  std::string old_path, new_path;
  double threshold_pct = 5.0;
  std::string md;
};

struct ReportArgs {
  std::string dir;
  std::string out;  // empty: stdout
};

int run_command(const RunArgs& args);
int roofline_command(const RooflineArgs& args);
int compare_command(const CompareArgs& args);
int report_command(const ReportArgs& args);

}  // namespace trainscale::bench::cli
