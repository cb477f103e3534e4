// Reporters (JSON round trip against the documented schema, CSV, Markdown geomean) and compare.
#include <gtest/gtest.h>

#include <sstream>

#include "bench/compare.h"
#include "bench/registry.h"
#include "bench/report_json.h"
#include "bench/reporters.h"
#include "trainscale/error.h"

namespace trainscale::bench {
namespace {

Row timed_row(const std::string& op, const std::string& impl, bool baseline, double median_ms, double rel_noise = 0.001) {
  Row r;
  r.op = op;
  r.family = "test";
  r.shape = "1024x4096";
  r.dtype = "bfloat16";
  r.case_name = op + " 1024x4096 bfloat16";
  r.impl = impl;
  r.baseline = baseline;
  r.device = "cuda";
  r.timer = "cuda-events";
  r.cold = true;
  r.ms.count = 50;
  r.ms.median = median_ms;
  r.ms.mean = median_ms * 1.01;
  r.ms.min = median_ms * 0.99;
  r.ms.max = median_ms * 1.2;
  r.ms.p5 = median_ms * 0.995;
  r.ms.p95 = median_ms * 1.05;
  r.ms.p99 = median_ms * 1.1;
  r.ms.rel_noise = rel_noise;
  r.stop_reason = "converged";
  r.bytes = 16e6;
  r.flops = 4e6;
  r.gbps = r.bytes / (median_ms * 1e-3) / 1e9;
  r.pct_roofline = 50.0;
  r.rel_l2 = 1e-3;
  r.tolerance = 1e-2;
  r.rows_checked = r.rows_total = 1024;
  r.peak_memory_bytes = 8 << 20;
  return r;
}

RunResult sample_run() {
  RunResult run;
  run.suite = "smoke";
  run.env.device = "cuda";
  run.env.gpu_name = "NVIDIA H100 80GB HBM3";
  run.env.git_commit = "abc123";
  run.env.seed = 42;
  run.env.command_line = "trainscale-bench --suite smoke";
  run.roofline = Roofline{"NVIDIA H100 80GB HBM3", "580.1", 3000, 3090, 3060, 782, 2.5, 4ll << 30, 2ll << 30,
                          3ll << 30, 8192, "2026-11-21T00:00:00Z", "measured"};
  run.rows = {timed_row("rmsnorm_forward", "trainscale", false, 1.0), timed_row("rmsnorm_forward", "cudnn", true, 2.0),
              timed_row("softmax_forward", "trainscale", false, 1.0), timed_row("softmax_forward", "cudnn", true, 8.0)};
  run.rows[0].rows_checked = 512;
  run.rows[0].rows_coverage = RowCoverage::kSample;
  for (Row* coupled : {&run.rows[2], &run.rows[3]}) {  // a prefix gate, as for a backward's reduction over rows
    coupled->rows_checked = 16;
    coupled->rows_coverage = RowCoverage::kPrefix;
  }
  Row failed = timed_row("layernorm_forward", "trainscale", false, 0);
  failed.status = Status::kFailed;
  failed.message = "output 'y': NaN at 3, where the reference is finite";
  failed.ms = {};
  failed.gbps = 0;
  failed.pct_roofline.reset();
  run.rows.push_back(failed);
  run.skipped = {{"rmsnorm_forward 4194304x4096 bfloat16", "does not fit in device memory"}};
  return run;
}

TEST(BenchJson, RoundTripKeepsEveryField) {
  const RunResult run = sample_run();
  const nlohmann::json j = to_json(run);
  const RunResult back = run_result_from_json(nlohmann::json::parse(j.dump()));
  EXPECT_EQ(to_json(back), j);
  EXPECT_EQ(back.rows.size(), run.rows.size());
  EXPECT_EQ(back.rows[4].status, Status::kFailed);
  EXPECT_FALSE(back.rows[4].pct_roofline.has_value());
  EXPECT_EQ(back.roofline->gemm_bf16_tflops, 782);
  EXPECT_EQ(back.rows[0].rows_coverage, RowCoverage::kSample);
  EXPECT_EQ(back.rows[2].rows_coverage, RowCoverage::kPrefix);
  EXPECT_EQ(back.rows[4].rows_coverage, RowCoverage::kAll);
  nlohmann::json older = j;  // written before the gate said which rows it checked
  older["rows"][2]["gate"].erase("rows");
  EXPECT_EQ(run_result_from_json(older).rows[2].rows_coverage, RowCoverage::kAll);
}

// docs/bench-json.md lists these keys; a change here is a schema change.
TEST(BenchJson, MatchesTheDocumentedSchema) {
  const nlohmann::json j = to_json(sample_run());
  EXPECT_EQ(j.at("schema"), "trainscale-bench");
  EXPECT_EQ(j.at("schema_version"), kSchemaVersion);
  for (const char* key : {"suite", "interrupted", "env", "timing"}) EXPECT_TRUE(j.at("meta").contains(key)) << key;
  for (const char* key : {"device", "gpu_name", "compute_capability", "device_index", "sm_count", "l2_bytes",
                          "memory_bytes", "driver", "cuda_runtime", "cuda_driver", "cudnn", "cublas", "clock_source",
                          "sm_clock_mhz", "sm_clock_max_mhz", "mem_clock_mhz", "power_w", "temperature_c", "cpu_name",
                          "cpu_threads", "git_commit", "date_utc", "command_line", "trainscale_version", "seed"}) {
    EXPECT_TRUE(j.at("meta").at("env").contains(key)) << key;
  }
  for (const char* key : {"target_rel_noise", "min_samples", "min_time_ms", "timeout_ms", "max_samples", "warmup_ms",
                          "warmup_min", "flush_l2", "rotate", "batch", "max_throttle_retakes"}) {
    EXPECT_TRUE(j.at("meta").at("timing").contains(key)) << key;
  }
  for (const char* key : {"gpu", "driver", "copy_gbps", "read_gbps", "read2_write1_gbps", "gemm_bf16_tflops",
                          "empty_kernel_us", "copy_bytes", "read_bytes", "read2_write1_bytes", "gemm_n", "measured_at",
                          "source"}) {
    EXPECT_TRUE(j.at("roofline").contains(key)) << key;
  }
  const nlohmann::json& row = j.at("rows").at(0);
  for (const char* key : {"case", "op", "family", "shape", "dtype", "impl", "baseline", "device", "status", "message",
                          "timer", "batch", "cold", "rotate", "ms", "stop_reason", "bytes", "bytes_read", "flops", "bound", "gbps",
                          "tflops", "pct_roofline", "gate", "peak_memory_bytes", "extra_memory_bytes", "clocks"}) {
    EXPECT_TRUE(row.contains(key)) << key;
  }
  for (const char* key : {"count", "median", "mean", "std", "min", "max", "p5", "p95", "p99", "rel_noise"}) {
    EXPECT_TRUE(row.at("ms").contains(key)) << key;
  }
  for (const char* key : {"rel_l2", "max_abs_err", "tolerance", "rows_checked", "rows_total", "rows", "scope"}) {
    EXPECT_TRUE(row.at("gate").contains(key)) << key;
  }
  EXPECT_EQ(row.at("gate").at("rows"), "sample");
  EXPECT_EQ(j.at("rows").at(2).at("gate").at("rows"), "prefix");
  EXPECT_EQ(j.at("rows").at(4).at("gate").at("rows"), "all");
  for (const char* key : {"sm_mhz_min", "sm_mhz_max", "throttle_retakes", "throttled", "throttle_reasons"}) {
    EXPECT_TRUE(row.at("clocks").contains(key)) << key;
  }
  EXPECT_EQ(j.at("rows").size(), 5u);
  EXPECT_EQ(j.at("skipped").at(0).at("reason"), "does not fit in device memory");
}

TEST(BenchJson, RejectsOtherDocuments) {
  EXPECT_THROW(run_result_from_json(nlohmann::json::parse(R"({"rows": []})")), Error);
  nlohmann::json newer = to_json(sample_run());
  newer["schema_version"] = kSchemaVersion + 1;
  EXPECT_THROW(run_result_from_json(newer), Error);
  nlohmann::json bad_status = to_json(sample_run());
  bad_status["rows"][0]["status"] = "great";
  EXPECT_THROW(run_result_from_json(bad_status), Error);
}

TEST(BenchCsv, HeaderAndOneLinePerRow) {
  std::ostringstream out;
  write_csv(out, sample_run());
  std::istringstream lines(out.str());
  std::string header, line;
  std::getline(lines, header);
  std::string expected;
  for (const auto& c : csv_columns()) expected += (expected.empty() ? "" : ",") + c;
  EXPECT_EQ(header, expected);
  int count = 0;
  while (std::getline(lines, line)) {
    ++count;
    if (line.find("layernorm") != std::string::npos) {
      // The message holds a comma: quoted.
      EXPECT_NE(line.find("failed"), std::string::npos);
      EXPECT_NE(line.find("\"output 'y': NaN at 3, where the reference is finite\""), std::string::npos);
    } else {
      EXPECT_EQ(std::count(line.begin(), line.end(), ','), static_cast<long>(csv_columns().size() - 1)) << line;
    }
  }
  EXPECT_EQ(count, 5);
}

TEST(BenchMarkdown, GeomeanSpeedupOverEachBaseline) {
  const RunResult run = sample_run();
  const std::vector<Pairing> pairings = pair_rows(run.rows);
  ASSERT_EQ(pairings.size(), 3u);
  EXPECT_DOUBLE_EQ(pairings[0].speedup(), 2.0);
  EXPECT_DOUBLE_EQ(pairings[1].speedup(), 8.0);
  EXPECT_EQ(pairings[2].base, nullptr);
  EXPECT_DOUBLE_EQ(geomean_speedup(pairings, "cudnn"), 4.0);
  std::ostringstream out;
  write_markdown(out, run);
  const std::string md = out.str();
  EXPECT_NE(md.find("| cudnn | 2 | 4.000x |"), std::string::npos) << md;
  EXPECT_NE(md.find("## rmsnorm_forward"), std::string::npos);
  EXPECT_NE(md.find("## softmax_forward"), std::string::npos);
  EXPECT_NE(md.find("| layernorm_forward 1024x4096 bfloat16 | trainscale | FAILED |"), std::string::npos) << md;
  EXPECT_NE(md.find("does not fit in device memory"), std::string::npos);
  EXPECT_NE(md.find("`abc123`"), std::string::npos);
  EXPECT_NE(md.find("bf16 GEMM 782.0 TFLOP/s, empty kernel 2.50 us |"), std::string::npos) << md;
  EXPECT_NE(md.find("- softmax_forward 1024x4096 bfloat16: gated on the first 16 of 1024 rows (timed on all)\n"),
            std::string::npos)
      << md;
}

TEST(BenchTerminal, TableHasTheDocumentedColumns) {
  std::ostringstream out;
  write_terminal_table(out, sample_run());
  const std::string text = out.str();
  EXPECT_EQ(text.rfind("Kernel", 0), 0u);
  for (const char* column : {"Ours (ms)", "Base (ms)", "Speedup", "Metric", "% roofline"}) {
    EXPECT_NE(text.find(column), std::string::npos) << column;
  }
  EXPECT_NE(text.find("2.00x"), std::string::npos);
  EXPECT_NE(text.find("50.0%"), std::string::npos);
  EXPECT_NE(text.find("FAILED"), std::string::npos);
  // Once per case, not per implementation; sampled rows need no note.
  const std::string note = "  softmax_forward 1024x4096 bfloat16: gated on the first 16 of 1024 rows (timed on all)\n";
  EXPECT_NE(text.find("Gated on a prefix problem"), std::string::npos) << text;
  EXPECT_NE(text.find(note), std::string::npos) << text;
  EXPECT_EQ(text.find(note, text.find(note) + 1), std::string::npos) << text;
  EXPECT_EQ(text.find("rmsnorm_forward 1024x4096 bfloat16: gated"), std::string::npos) << text;
}

// A compute-bound case gated by its own sampled check, with a workspace, next to a baseline
// that keeps more memory: the reports show the memory beyond inputs and outputs where a row
// has some, and say which rows the gate checked.
TEST(BenchReports, ExtraMemoryAndCaseSampleNotes) {
  RunResult run = sample_run();
  const std::string scope = "fp64 on the host: lse and grad_hidden at 9 of 8192 tokens (0, 8191)";
  for (const char* impl : {"trainscale", "unfused"}) {
    Row r = timed_row("fused_linear_cross_entropy_forward", impl, std::string(impl) != "trainscale", 10.0);
    r.bound = Bound::kCompute;
    r.rows_coverage = RowCoverage::kCaseSample;
    r.rows_checked = 9;
    r.rows_total = 8192;
    r.gate_scope = scope;
    r.extra_memory_bytes = r.baseline ? std::int64_t{2} << 30 : std::int64_t{3} << 29;
    run.rows.push_back(r);
  }
  const nlohmann::json j = to_json(run);
  EXPECT_EQ(j.at("rows").at(5).at("gate").at("rows"), "case-sample");
  EXPECT_EQ(j.at("rows").at(5).at("gate").at("scope"), scope);
  EXPECT_EQ(j.at("rows").at(6).at("extra_memory_bytes"), std::int64_t{2} << 30);
  const RunResult back = run_result_from_json(nlohmann::json::parse(j.dump()));
  EXPECT_EQ(to_json(back), j);
  EXPECT_EQ(back.rows[5].rows_coverage, RowCoverage::kCaseSample);

  std::ostringstream md;
  write_markdown(md, run);
  const std::string m = md.str();
  EXPECT_NE(m.find("| Noise (samples) | Extra memory |"), std::string::npos) << m;
  EXPECT_NE(m.find("| 1.5 GiB / 2.0 GiB |"), std::string::npos) << m;
  // Only the table of the op that has some.
  EXPECT_EQ(m.find("| Noise (samples) | Extra memory |"), m.rfind("| Noise (samples) | Extra memory |")) << m;
  EXPECT_NE(m.find("## Gated on sampled rows"), std::string::npos) << m;
  EXPECT_NE(m.find("- fused_linear_cross_entropy_forward 1024x4096 bfloat16: " + scope + "\n"), std::string::npos) << m;

  std::ostringstream term;
  write_terminal_table(term, run);
  const std::string t = term.str();
  EXPECT_NE(t.find("Extra memory"), std::string::npos) << t;
  EXPECT_NE(t.find("1.5 GiB / 2.0 GiB"), std::string::npos) << t;
  const std::string note = "  fused_linear_cross_entropy_forward 1024x4096 bfloat16: " + scope + "\n";
  EXPECT_NE(t.find(note), std::string::npos) << t;
  EXPECT_EQ(t.find(note, t.find(note) + 1), std::string::npos) << t;  // once per case

  // Without such rows, no column.
  std::ostringstream plain;
  write_terminal_table(plain, sample_run());
  EXPECT_EQ(plain.str().find("Extra memory"), std::string::npos);
}

// A median is not known more finely than the timer: 10 us kernels 0.3 us apart with tiny CIs
// are the same under CUDA events (0.5 us resolution), different under a graph of 100 launches
// or the host timer.
TEST(BenchCompare, NoiseIsAtLeastTheTimerResolution) {
  RunResult old_run, new_run;
  for (const char* timer : {"cuda-events", "cuda-graph", "host"}) {
    old_run.rows.push_back(timed_row(timer, "trainscale", false, 0.0100, 0.0005));
    new_run.rows.push_back(timed_row(timer, "trainscale", false, 0.0103, 0.0005));
    for (Row* r : {&old_run.rows.back(), &new_run.rows.back()}) {
      r->timer = timer;
      r->batch = std::string(timer) == "cuda-graph" ? 100 : 1;
    }
  }
  const Comparison c = compare_runs(old_run, new_run, 0.05);
  ASSERT_EQ(c.rows.size(), 3u);
  EXPECT_EQ(c.rows[0].verdict, Verdict::kSame);
  EXPECT_NEAR(c.rows[0].noise, 1e-3 / 0.01, 1e-9);
  EXPECT_EQ(c.rows[1].verdict, Verdict::kSlower);
  EXPECT_EQ(c.rows[2].verdict, Verdict::kSlower);
}

// Nor more finely than a re-run moves it: medians 1.5 % apart with 0.1 % CIs are the same
// (kRunToRun each), 2.5 % apart they are not.
TEST(BenchCompare, NoiseIsAtLeastTheRunToRunFloor) {
  RunResult old_run, new_run;
  old_run.rows = {timed_row("close", "trainscale", false, 1.0, 0.001), timed_row("apart", "trainscale", false, 1.0, 0.001)};
  new_run.rows = {timed_row("close", "trainscale", false, 1.015, 0.001), timed_row("apart", "trainscale", false, 1.025, 0.001)};
  const Comparison c = compare_runs(old_run, new_run, 0.05);
  ASSERT_EQ(c.rows.size(), 2u);
  EXPECT_EQ(c.rows[0].verdict, Verdict::kSame);
  EXPECT_NEAR(c.rows[0].noise, kRunToRun * (1.0 + 1.015), 1e-12);
  EXPECT_EQ(c.rows[1].verdict, Verdict::kSlower);
}

TEST(BenchCompare, VerdictsFollowTheNoise) {
  RunResult old_run, new_run;
  old_run.rows = {timed_row("same", "trainscale", false, 1.00, 0.01), timed_row("faster", "trainscale", false, 1.00),
                  timed_row("slower", "trainscale", false, 1.00), timed_row("slightly", "trainscale", false, 1.00),
                  timed_row("gone", "trainscale", false, 1.00), timed_row("breaks", "trainscale", false, 1.00)};
  new_run.rows = {timed_row("same", "trainscale", false, 1.01, 0.01),  // 1% apart, +-2% noise
                  timed_row("faster", "trainscale", false, 0.90), timed_row("slower", "trainscale", false, 1.10),
                  timed_row("slightly", "trainscale", false, 1.03),  // slower, but under the 5% threshold
                  timed_row("fresh", "trainscale", false, 1.00), timed_row("breaks", "trainscale", false, 1.00)};
  new_run.rows.back().status = Status::kFailed;
  const Comparison c = compare_runs(old_run, new_run, 0.05);
  auto verdict = [&](const std::string& op) {
    for (const auto& r : c.rows) {
      if (r.key.rfind(op + " ", 0) == 0) return r;
    }
    throw std::runtime_error("no row " + op);
  };
  EXPECT_EQ(verdict("same").verdict, Verdict::kSame);
  EXPECT_EQ(verdict("faster").verdict, Verdict::kFaster);
  EXPECT_EQ(verdict("slower").verdict, Verdict::kSlower);
  EXPECT_TRUE(verdict("slower").regression);
  EXPECT_NEAR(verdict("slower").change, 0.10, 1e-12);
  EXPECT_EQ(verdict("slightly").verdict, Verdict::kSlower);
  EXPECT_FALSE(verdict("slightly").regression);
  EXPECT_EQ(verdict("gone").verdict, Verdict::kOnlyOld);
  EXPECT_EQ(verdict("fresh").verdict, Verdict::kOnlyNew);
  EXPECT_EQ(verdict("breaks").verdict, Verdict::kNotTimed);
  EXPECT_TRUE(verdict("breaks").regression);
  EXPECT_TRUE(c.regressed());
  EXPECT_FALSE(compare_runs(old_run, old_run, 0.05).regressed());

  std::ostringstream text;
  write_comparison(text, c, false);
  EXPECT_NE(text.str().find("SLOWER (regression)"), std::string::npos);
  EXPECT_NE(text.str().find("+10.0%"), std::string::npos);
}

// Result files from before the ops took their C++ entry points' names (bench/results/h100/)
// compare row for row with new ones, reported under the new names.
TEST(BenchCompare, OldOpNamesMatchTheirNewNames) {
  EXPECT_EQ(current_op_name("rmsnorm_fwd"), "rmsnorm_forward");
  EXPECT_EQ(current_op_name("gelu_tanh_bwd"), "gelu_backward_tanh");
  EXPECT_EQ(current_op_name("swiglu_packed_fwd"), "swiglu_forward_packed");
  EXPECT_EQ(current_op_name("cross_entropy_fwd_bwd"), "cross_entropy_forward_with_grad");
  EXPECT_EQ(current_op_name("fp8_quant_1x128_t"), "fp8_quantize_1x128_t");
  EXPECT_EQ(current_op_name("rmsnorm_forward"), "rmsnorm_forward");
  EXPECT_EQ(current_op_name("newton_schulz"), "newton_schulz");
  // Every op registered today keeps its name.
  for (const std::string& op : Registry::global().op_names()) EXPECT_EQ(current_op_name(op), op);

  RunResult old_run, new_run;
  old_run.rows = {timed_row("rmsnorm_fwd", "trainscale", false, 1.00), timed_row("fp8_quant_row", "trainscale", false, 1.00)};
  new_run.rows = {timed_row("rmsnorm_forward", "trainscale", false, 0.90),
                  timed_row("fp8_quantize_row", "trainscale", false, 1.00)};
  const Comparison c = compare_runs(old_run, new_run, 0.05);
  ASSERT_EQ(c.rows.size(), 2u);
  EXPECT_EQ(c.rows[0].verdict, Verdict::kFaster);
  EXPECT_EQ(c.rows[0].key.rfind("rmsnorm_forward ", 0), 0u) << c.rows[0].key;
  EXPECT_EQ(c.rows[1].verdict, Verdict::kSame);
}

}  // namespace
}  // namespace trainscale::bench
