#include "bench/report_json.h"

#include <fstream>

#include "trainscale/error.h"

namespace trainscale::bench {

using nlohmann::json;

namespace {

constexpr const char* kSchemaName = "trainscale-bench";

// JSON has no NaN or Inf: nlohmann writes them as null, read back here as `fallback`.
double number(const json& j, const char* key, double fallback = 0.0) {
  const auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : fallback;
}

json to_json(const Summary& s) {
  return {{"count", s.count}, {"median", s.median}, {"mean", s.mean}, {"std", s.std},
          {"min", s.min},     {"max", s.max},       {"p5", s.p5},     {"p95", s.p95},
          {"p99", s.p99},     {"rel_noise", s.rel_noise}};
}

Summary summary_from_json(const json& j) {
  Summary s;
  s.count = j.value("count", std::int64_t{0});
  s.median = number(j, "median");
  s.mean = number(j, "mean");
  s.std = number(j, "std");
  s.min = number(j, "min");
  s.max = number(j, "max");
  s.p5 = number(j, "p5");
  s.p95 = number(j, "p95");
  s.p99 = number(j, "p99");
  s.rel_noise = number(j, "rel_noise");
  return s;
}

}  // namespace

json to_json(const Environment& e) {
  return {{"device", e.device},
          {"gpu_name", e.gpu_name},
          {"compute_capability", e.compute_capability},
          {"device_index", e.device_index},
          {"sm_count", e.sm_count},
          {"l2_bytes", e.l2_bytes},
          {"memory_bytes", e.memory_bytes},
          {"driver", e.driver},
          {"cuda_runtime", e.cuda_runtime},
          {"cuda_driver", e.cuda_driver},
          {"cudnn", e.cudnn},
          {"cublas", e.cublas},
          {"clock_source", e.clock_source},
          {"sm_clock_mhz", e.sm_clock_mhz},
          {"sm_clock_max_mhz", e.sm_clock_max_mhz},
          {"mem_clock_mhz", e.mem_clock_mhz},
          {"power_w", e.power_w},
          {"temperature_c", e.temperature_c},
          {"cpu_name", e.cpu_name},
          {"cpu_threads", e.cpu_threads},
          {"git_commit", e.git_commit},
          {"date_utc", e.date_utc},
          {"command_line", e.command_line},
          {"trainscale_version", e.trainscale_version},
          {"seed", e.seed}};
}

namespace {

Environment environment_from_json(const json& j) {
  Environment e;
  e.device = j.value("device", e.device);
  e.gpu_name = j.value("gpu_name", "");
  e.compute_capability = j.value("compute_capability", "");
  e.device_index = j.value("device_index", 0);
  e.sm_count = j.value("sm_count", 0);
  e.l2_bytes = j.value("l2_bytes", std::int64_t{0});
  e.memory_bytes = j.value("memory_bytes", std::int64_t{0});
  e.driver = j.value("driver", "");
  e.cuda_runtime = j.value("cuda_runtime", "");
  e.cuda_driver = j.value("cuda_driver", "");
  e.cudnn = j.value("cudnn", "");
  e.cublas = j.value("cublas", "");
  e.clock_source = j.value("clock_source", "");
  e.sm_clock_mhz = number(j, "sm_clock_mhz");
  e.sm_clock_max_mhz = number(j, "sm_clock_max_mhz");
  e.mem_clock_mhz = number(j, "mem_clock_mhz");
  e.power_w = number(j, "power_w");
  e.temperature_c = number(j, "temperature_c");
  e.cpu_name = j.value("cpu_name", "");
  e.cpu_threads = j.value("cpu_threads", 0);
  e.git_commit = j.value("git_commit", "");
  e.date_utc = j.value("date_utc", "");
  e.command_line = j.value("command_line", "");
  e.trainscale_version = j.value("trainscale_version", "");
  e.seed = j.value("seed", std::uint64_t{0});
  return e;
}

json to_json(const TimingOptions& t) {
  return {{"target_rel_noise", t.stop.target_rel_noise},
          {"min_samples", t.stop.min_samples},
          {"min_time_ms", t.stop.min_time_ms},
          {"timeout_ms", t.stop.timeout_ms},
          {"max_samples", t.stop.max_samples},
          {"warmup_ms", t.warmup_ms},
          {"warmup_min", t.warmup_min},
          {"flush_l2", t.flush_l2},
          {"rotate", t.rotate},
          {"batch", t.batch},
          {"max_throttle_retakes", t.max_throttle_retakes},
          {"throttle_recovery_ms", t.throttle_recovery_ms}};
}

TimingOptions timing_from_json(const json& j) {
  TimingOptions t;
  t.stop.target_rel_noise = j.value("target_rel_noise", t.stop.target_rel_noise);
  t.stop.min_samples = j.value("min_samples", t.stop.min_samples);
  t.stop.min_time_ms = j.value("min_time_ms", t.stop.min_time_ms);
  t.stop.timeout_ms = j.value("timeout_ms", t.stop.timeout_ms);
  t.stop.max_samples = j.value("max_samples", t.stop.max_samples);
  t.warmup_ms = j.value("warmup_ms", t.warmup_ms);
  t.warmup_min = j.value("warmup_min", t.warmup_min);
  t.flush_l2 = j.value("flush_l2", t.flush_l2);
  t.rotate = j.value("rotate", t.rotate);
  t.batch = j.value("batch", t.batch);
  t.max_throttle_retakes = j.value("max_throttle_retakes", t.max_throttle_retakes);
  t.throttle_recovery_ms = j.value("throttle_recovery_ms", t.throttle_recovery_ms);
  return t;
}

json to_json(const Row& r) {
  return {{"case", r.case_name},
          {"op", r.op},
          {"family", r.family},
          {"shape", r.shape},
          {"dtype", r.dtype},
          {"impl", r.impl},
          {"baseline", r.baseline},
          {"device", r.device},
          {"status", status_name(r.status)},
          {"message", r.message},
          {"timer", r.timer},
          {"batch", r.batch},
          {"cold", r.cold},
          {"rotate", r.rotate},
          {"ms", to_json(r.ms)},
          {"stop_reason", r.stop_reason},
          {"bytes", r.bytes},
          {"bytes_read", r.bytes_read},
          {"flops", r.flops},
          {"bound", bound_name(r.bound)},
          {"gbps", r.gbps},
          {"tflops", r.tflops},
          {"pct_roofline", r.pct_roofline ? json(*r.pct_roofline) : json(nullptr)},
          {"gate", {{"rel_l2", r.rel_l2},
                    {"max_abs_err", r.max_abs_err},
                    {"tolerance", r.tolerance},
                    {"rows_checked", r.rows_checked},
                    {"rows_total", r.rows_total},
                    {"rows", coverage_name(r.rows_coverage)},
                    {"scope", r.gate_scope}}},
          {"peak_memory_bytes", r.peak_memory_bytes},
          {"extra_memory_bytes", r.extra_memory_bytes},
          {"clocks", {{"sm_mhz_min", r.sm_mhz_min},
                      {"sm_mhz_max", r.sm_mhz_max},
                      {"throttle_retakes", r.throttle_retakes},
                      {"throttled", r.throttled},
                      {"throttle_reasons", r.throttle_reasons}}}};
}

Row row_from_json(const json& j) {
  Row r;
  r.case_name = j.at("case").get<std::string>();
  r.op = j.value("op", "");
  r.family = j.value("family", "");
  r.shape = j.value("shape", "");
  r.dtype = j.value("dtype", "");
  r.impl = j.at("impl").get<std::string>();
  r.baseline = j.value("baseline", false);
  r.device = j.value("device", "");
  const auto status = parse_status(j.at("status").get<std::string>());
  if (!status) throw Error("trainscale-bench: unknown row status '" + j.at("status").get<std::string>() + "'");
  r.status = *status;
  r.message = j.value("message", "");
  r.timer = j.value("timer", "");
  r.batch = j.value("batch", 1);
  r.cold = j.value("cold", false);
  r.rotate = j.value("rotate", 1);
  if (j.contains("ms")) r.ms = summary_from_json(j.at("ms"));
  r.stop_reason = j.value("stop_reason", "");
  r.bytes = number(j, "bytes");
  r.bytes_read = number(j, "bytes_read");
  r.flops = number(j, "flops");
  r.bound = j.value("bound", "memory") == std::string("compute") ? Bound::kCompute : Bound::kMemory;
  r.gbps = number(j, "gbps");
  r.tflops = number(j, "tflops");
  if (j.contains("pct_roofline") && j.at("pct_roofline").is_number()) r.pct_roofline = j.at("pct_roofline").get<double>();
  const json gate = j.value("gate", json::object());
  r.rel_l2 = number(gate, "rel_l2");
  r.max_abs_err = number(gate, "max_abs_err");
  r.tolerance = number(gate, "tolerance");
  r.rows_checked = gate.value("rows_checked", std::int64_t{0});
  r.rows_total = gate.value("rows_total", std::int64_t{0});
  r.rows_coverage = parse_coverage(gate.value("rows", "all")).value_or(RowCoverage::kAll);
  r.gate_scope = gate.value("scope", "");
  r.peak_memory_bytes = j.value("peak_memory_bytes", std::int64_t{0});
  r.extra_memory_bytes = j.value("extra_memory_bytes", std::int64_t{0});
  const json clocks = j.value("clocks", json::object());
  r.sm_mhz_min = number(clocks, "sm_mhz_min");
  r.sm_mhz_max = number(clocks, "sm_mhz_max");
  r.throttle_retakes = clocks.value("throttle_retakes", std::int64_t{0});
  r.throttled = clocks.value("throttled", false);
  r.throttle_reasons = clocks.value("throttle_reasons", "");
  return r;
}

}  // namespace

json to_json(const Roofline& r) {
  return {{"gpu", r.gpu},
          {"driver", r.driver},
          {"copy_gbps", r.copy_gbps},
          {"read_gbps", r.read_gbps},
          {"read2_write1_gbps", r.read2_write1_gbps},
          {"gemm_bf16_tflops", r.gemm_bf16_tflops},
          {"empty_kernel_us", r.empty_kernel_us},
          {"copy_bytes", r.copy_bytes},
          {"read_bytes", r.read_bytes},
          {"read2_write1_bytes", r.read2_write1_bytes},
          {"gemm_n", r.gemm_n},
          {"measured_at", r.measured_at},
          {"source", r.source},
          {"raised_by", r.raised_by}};
}

Roofline roofline_from_json(const json& j) {
  Roofline r;
  r.gpu = j.at("gpu").get<std::string>();
  r.driver = j.value("driver", "");
  r.copy_gbps = j.at("copy_gbps").get<double>();
  r.read_gbps = j.at("read_gbps").get<double>();
  r.read2_write1_gbps = j.value("read2_write1_gbps", 0.0);
  r.gemm_bf16_tflops = j.at("gemm_bf16_tflops").get<double>();
  r.empty_kernel_us = j.value("empty_kernel_us", 0.0);
  r.copy_bytes = j.value("copy_bytes", std::int64_t{0});
  r.read_bytes = j.value("read_bytes", std::int64_t{0});
  r.read2_write1_bytes = j.value("read2_write1_bytes", std::int64_t{0});
  r.gemm_n = j.value("gemm_n", std::int64_t{0});
  r.measured_at = j.value("measured_at", "");
  r.source = j.value("source", "");
  r.raised_by = j.value("raised_by", std::vector<std::string>{});
  return r;
}

json to_json(const RunResult& result) {
  json rows = json::array();
  for (const Row& r : result.rows) rows.push_back(to_json(r));
  json skipped = json::array();
  for (const SkippedCase& s : result.skipped) skipped.push_back({{"case", s.case_name}, {"reason", s.reason}});
  return {{"schema", kSchemaName},
          {"schema_version", result.schema_version},
          {"meta", {{"suite", result.suite},
                    {"interrupted", result.interrupted},
                    {"wall_seconds", result.wall_seconds},
                    {"env", to_json(result.env)},
                    {"timing", to_json(result.timing)}}},
          {"roofline", result.roofline ? to_json(*result.roofline) : json(nullptr)},
          {"rows", rows},
          {"skipped", skipped}};
}

RunResult run_result_from_json(const json& j) {
  try {
    if (!j.is_object() || j.value("schema", "") != std::string(kSchemaName)) {
      throw Error("not a trainscale-bench result (no \"schema\": \"trainscale-bench\")");
    }
    RunResult result;
    result.schema_version = j.at("schema_version").get<int>();
    if (result.schema_version > kSchemaVersion) {
      throw Error("schema version " + std::to_string(result.schema_version) + " is newer than this build's " +
                  std::to_string(kSchemaVersion));
    }
    const json& meta = j.at("meta");
    result.suite = meta.value("suite", "");
    result.interrupted = meta.value("interrupted", false);
    result.wall_seconds = meta.value("wall_seconds", 0.0);
    result.env = environment_from_json(meta.value("env", json::object()));
    result.timing = timing_from_json(meta.value("timing", json::object()));
    if (j.contains("roofline") && j.at("roofline").is_object()) result.roofline = roofline_from_json(j.at("roofline"));
    for (const json& r : j.at("rows")) result.rows.push_back(row_from_json(r));
    for (const json& s : j.value("skipped", json::array())) {
      result.skipped.push_back({s.at("case").get<std::string>(), s.value("reason", "")});
    }
    return result;
  } catch (const json::exception& e) {
    throw Error(std::string("malformed trainscale-bench result: ") + e.what());
  }
}

void write_json_file(const std::string& path, const json& j) {
  std::ofstream out(path);
  if (!out) throw Error("trainscale-bench: cannot write " + path);
  out << j.dump(2) << '\n';
  if (!out) throw Error("trainscale-bench: error writing " + path);
}

json read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error("trainscale-bench: cannot read " + path);
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw Error("trainscale-bench: " + path + " is not valid JSON: " + e.what());
  }
}

}  // namespace trainscale::bench
