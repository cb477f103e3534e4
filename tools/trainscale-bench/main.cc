// trainscale-bench: runs benchmark suites, measures the roofline, compares and merges results.
// docs/benchmarking.md is the user guide; docs/bench-json.md the result schema.
#include <CLI/CLI.hpp>
#include <iostream>

#include "commands.h"
#include "trainscale/error.h"

namespace {

using namespace trainscale::bench;
using namespace trainscale::bench::cli;

std::string joined_command_line(int argc, char** argv) {
  std::string s;
  for (int i = 0; i < argc; ++i) {
    if (i) s += ' ';
    s += argv[i];
  }
  return s;
}

void add_timing_options(CLI::App& app, TimingOptions& t) {
  app.add_option("--target-noise", t.stop.target_rel_noise,
                 "Stop when the median's 95% CI half-width / median is under this")
      ->capture_default_str();
  app.add_option("--min-samples", t.stop.min_samples, "Samples before the noise target may stop sampling")
      ->capture_default_str();
  app.add_option("--min-time-ms", t.stop.min_time_ms, "Sampling time before the noise target may stop sampling")
      ->capture_default_str();
  app.add_option("--timeout-ms", t.stop.timeout_ms, "Sampling time limit per implementation")->capture_default_str();
  app.add_option("--max-samples", t.stop.max_samples, "Sample limit per implementation")->capture_default_str();
  app.add_option("--warmup-ms", t.warmup_ms, "Warm-up time before sampling")->capture_default_str();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"trainscale-bench: benchmarks TrainScale's kernels against the fp64 reference and vendor baselines"};
  app.require_subcommand(0, 1);
  app.footer(
      "Exit status: 0 when every implementation of ours passed its gate and ran; 1 when one of ours failed its "
      "gate or a case errored (a baseline that fails its gate is reported FAILED but does not fail the run); "
      "2 for a usage error; 130 when interrupted (Ctrl-C: the results so far are written).\n"
      "On a GPU, ops that have only their CPU reference are listed as such and not run.");

  RunArgs run;
  run.command_line = joined_command_line(argc, argv);
  app.add_option("--suite", run.suite, "Suites, comma-separated: smoke, quack, quack-m, dsv3, llama, attention, flce, muon, sweep, training")
      ->capture_default_str();
  app.add_option("--ops", run.ops, "Only these ops (comma-separated)")->delimiter(',');
  app.add_option("--dtype", run.dtypes, "Only these dtypes: fp32, fp16, bf16, ... (comma-separated)")->delimiter(',');
  app.add_option("--configs", run.configs, "Only these shapes, e.g. 32768x4096,8192x8192")->delimiter(',');
  app.add_option("--impl", run.impls, "Only these implementations: trainscale, cpu-ref, baselines, opt-in ones (run only when named)")->delimiter(',');
  app.add_flag("--list", run.list, "Print the selected cases without running them");
  app.add_option("--json", run.json, "Write results as JSON (docs/bench-json.md)");
  app.add_option("--csv", run.csv, "Write results as CSV");
  app.add_option("--md", run.md, "Write results as Markdown");
  app.add_option("--device", run.device, "auto (a GPU when there is one), cpu or cuda")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--gpu", run.gpu, "CUDA device index")->capture_default_str();
  app.add_option("--seed", run.seed, "Seed of the random inputs")->capture_default_str();
  add_timing_options(app, run.timing);
  app.add_option("--rotate", run.timing.rotate, "Input sets to cycle through")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--batch", run.timing.batch, "Launches per CUDA-graph replay; 0 = automatic, 1 = no graphs")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--warm", [&](std::int64_t) { run.timing.flush_l2 = false; }, "Do not flush the L2 before samples");
  app.add_flag("--refresh-roofline", run.refresh_roofline, "Measure the roofline again instead of using the cache");
  app.add_flag("--no-roofline", run.no_roofline, "Do not measure or load the roofline (no % of roofline)");
  app.add_flag("--quiet", run.quiet, "No progress line");

  RooflineArgs roofline;
  roofline.command_line = run.command_line;
  CLI::App* roofline_cmd = app.add_subcommand("roofline", "Measure (or show the cached) roofline of the GPU");
  roofline_cmd->add_option("--gpu", roofline.gpu, "CUDA device index")->capture_default_str();
  roofline_cmd->add_flag("--refresh", roofline.refresh, "Measure again instead of using the cache");
  roofline_cmd->add_option("--json", roofline.json, "Write the roofline as JSON");
  roofline_cmd->add_option("--md", roofline.md, "Write the roofline as Markdown");
  add_timing_options(*roofline_cmd, roofline.timing);

  CompareArgs compare;
  CLI::App* compare_cmd = app.add_subcommand("compare", "Compare two result files row by row");
  compare_cmd->add_option("old", compare.old_path, "Baseline result JSON")->required();
  compare_cmd->add_option("new", compare.new_path, "New result JSON")->required();
  compare_cmd->add_option("--threshold", compare.threshold_pct, "Slowdown in % that counts as a regression")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  compare_cmd->add_option("--md", compare.md, "Also write the comparison as Markdown");

  ReportArgs report;
  CLI::App* report_cmd = app.add_subcommand("report", "Merge the result JSON files of a directory into Markdown");
  report_cmd->add_option("dir", report.dir, "Directory of result JSON files")->required();
  report_cmd->add_option("--out", report.out, "Markdown file (default: stdout)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "trainscale-bench: " << e.what() << "\n(see trainscale-bench --help)\n";
    return kExitUsage;
  }

  try {
    if (*roofline_cmd) return roofline_command(roofline);
    if (*compare_cmd) return compare_command(compare);
    if (*report_cmd) return report_command(report);
    return run_command(run);
  } catch (const UsageError& e) {
    std::cerr << "trainscale-bench: " << e.what() << '\n';
    return kExitUsage;
  } catch (const std::exception& e) {
    std::cerr << "trainscale-bench: " << e.what() << '\n';
    return kExitFailure;
  }
}
