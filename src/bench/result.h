// Rows and run results: what the engine produces and every reporter consumes. The JSON form is
// docs/bench-json.md; bump kSchemaVersion on any incompatible change.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bench/environment.h"
#include "bench/registry.h"
#include "bench/statistics.h"
#include "bench/timing.h"

namespace trainscale::bench {

inline constexpr int kSchemaVersion = 1;

enum class Status { kOk, kFailed, kUnsupported, kSkipped, kInterrupted };
const char* status_name(Status status);          // "ok", "failed", ...
std::optional<Status> parse_status(const std::string& name);

// Which rows of a case the gate compared with the reference.
enum class RowCoverage {
  kAll,
  kSample,  // a random sample of rows (rows independent), among all rows computed
  kPrefix,  // rows coupled: the gated call solved the problem made of the first rows only
  kGroups,  // compute-bound: a run of consecutive independent groups (attention: kv heads)
  kCaseSample,  // compute-bound, rows coupled: the case's own fp64 check of sampled rows of the
                // full call (SampledCheck); Row::gate_scope says which
};
const char* coverage_name(RowCoverage coverage);  // "all", "sample", "prefix", "groups", "case-sample"
std::optional<RowCoverage> parse_coverage(const std::string& name);

struct Row {
  std::string case_name;  // "rmsnorm_forward 32768x4096 bfloat16"
  std::string op, family, shape, dtype;
  std::string impl;  // "trainscale", "cpu-ref", baseline name
  bool baseline = false;
  std::string device;  // "cuda" or "cpu"
  Status status = Status::kOk;
  std::string message;  // why FAILED / UNSUPPORTED / SKIPPED

  // Timing (Status::kOk; partial for kInterrupted)
  std::string timer;  // "host", "cuda-events", "cuda-graph"
  int batch = 1;      // launches per timed replay (cuda-graph)
  bool cold = false;  // L2 flushed before each sample
  int rotate = 1;
  Summary ms;
  std::string stop_reason;

  // Work and rates at the median
  double bytes = 0, flops = 0;
  double bytes_read = 0;  // the part of `bytes` that is read; the memory ceiling depends on the mix
  Bound bound = Bound::kMemory;
  double gbps = 0, tflops = 0;
  std::optional<double> pct_roofline;  // of the ceiling `bound` and the read share select

  // Gate
  double rel_l2 = 0, max_abs_err = 0, tolerance = 0;
  std::int64_t rows_checked = 0, rows_total = 0;
  RowCoverage rows_coverage = RowCoverage::kAll;
  std::string gate_scope;  // kCaseSample: which rows of which outputs were checked

  // Outputs + workspace + device memory the implementation kept after its first call.
  std::int64_t peak_memory_bytes = 0;
  // The part of it beyond inputs and outputs: the case's scratch tensors, the workspace the
  // implementation declares and the device memory it kept after its first call.
  std::int64_t extra_memory_bytes = 0;

  // Clocks and throttling while sampling
  double sm_mhz_min = 0, sm_mhz_max = 0;
  std::int64_t throttle_retakes = 0;
  bool throttled = false;
  std::string throttle_reasons;

  // Rows of one measurement compare across runs by this key.
  std::string key() const { return case_name + " | " + impl; }
};

struct Roofline {
  std::string gpu, driver;
  double copy_gbps = 0;       // bytes read + written / time
  double read_gbps = 0;
  double read2_write1_gbps = 0;  // two bytes read per byte written
  double gemm_bf16_tflops = 0;  // cuBLASLt, 2*n^3 / time
  double empty_kernel_us = 0;   // an empty kernel timed as rows are; 0: not measured
  std::int64_t copy_bytes = 0, read_bytes = 0, read2_write1_bytes = 0;  // bytes moved per launch
  std::int64_t gemm_n = 0;
  std::string measured_at;  // UTC ISO
  std::string source;       // "measured" or the cache file it came from
  // Ceilings a row of the run beat, raised to that row (raise_ceilings_to_rows): what, to what,
  // by which row, from what the stream kernels measured.
  std::vector<std::string> raised_by;
};

struct SkippedCase {
  std::string case_name;
  std::string reason;
};

struct RunResult {
  int schema_version = kSchemaVersion;
  Environment env;
  std::string suite;
  TimingOptions timing;
  std::optional<Roofline> roofline;
  std::vector<Row> rows;
  std::vector<SkippedCase> skipped;
  bool interrupted = false;
  double wall_seconds = 0;  // from the start of the run (roofline included) to its last row

  // Whether one of our implementations failed its gate or errored. Baselines that fail are
  // reported FAILED but do not fail the run.
  bool any_failed() const;
};

}  // namespace trainscale::bench
