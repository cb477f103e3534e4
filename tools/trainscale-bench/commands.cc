#include <sstream>
#include "commands.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "bench/compare.h"
#include "bench/cuda_util.h"
#include "bench/engine.h"
#include "bench/environment.h"
#include "bench/gate.h"
#include "bench/interrupt.h"
#include "bench/progress.h"
#include "bench/registry.h"
#include "bench/report_json.h"
#include "bench/reporters.h"
#include "bench/roofline.h"
#include "trainscale/error.h"

namespace trainscale::bench::cli {
namespace {

std::string join(const std::vector<std::string>& items) {
  std::string s;
  for (const auto& item : items) s += (s.empty() ? "" : ", ") + item;
  return s;
}

bool contains(const std::vector<std::string>& items, const std::string& item) {
  return std::find(items.begin(), items.end(), item) != items.end();
}

bool gpu_present() {
#if TRAINSCALE_HAVE_CUDA
  return cuda_device_count() > 0;
#else
  return false;
#endif
}

bool choose_gpu(const std::string& device) {
  if (device == "cpu") return false;
  const bool present = gpu_present();
  if (device == "cuda" && !present) {
    throw UsageError(TRAINSCALE_HAVE_CUDA ? "--device cuda: no CUDA device is visible"
                                          : "--device cuda: this build has no CUDA support");
  }
  return present;
}

// Turns the filters into a Selection, rejecting names the registry does not know.
Selection make_selection(const Registry& registry, const RunArgs& args) {
  Selection s;
  s.suites.clear();
  std::stringstream names(args.suite);
  for (std::string suite; std::getline(names, suite, ',');) {
    if (!registry.has_suite(suite)) {
      throw UsageError("unknown suite '" + suite + "' (known: " + join(registry.suite_names()) + ")");
    }
    s.suites.push_back(suite);
  }
  if (s.suites.empty()) throw UsageError("--suite names no suite");
  for (const auto& op : args.ops) {
    if (!registry.find_op(op)) throw UsageError("unknown op '" + op + "' (known: " + join(registry.op_names()) + ")");
    s.ops.push_back(op);
  }
  for (const auto& name : args.dtypes) {
    const auto dtype = parse_dtype(name);
    if (!dtype) throw UsageError("unknown dtype '" + name + "' (known: fp32, fp16, bf16, e4m3, e5m2, fp64)");
    s.dtypes.push_back(*dtype);
  }
  for (const auto& text : args.configs) {
    const auto shape = parse_shape(text);
    if (!shape) throw UsageError("bad --configs entry '" + text + "' (expected sizes joined by 'x', e.g. 32768x4096)");
    s.configs.push_back(*shape);
  }
  std::vector<std::string> impls = {kOursGpu, kOursCpu};
  for (const auto& name : registry.baseline_names()) impls.push_back(name);
  for (const auto& name : registry.opt_in_names()) impls.push_back(name);
  for (const auto& impl : args.impls) {
    if (!contains(impls, impl)) throw UsageError("unknown implementation '" + impl + "' (known: " + join(impls) + ")");
    s.impls.push_back(impl);
  }
  return s;
}

int list_cases(const Registry& registry, const Selection& selection) {
  std::vector<Cells> lines = {{"Case", "Family", "Bound", "Bytes", "FLOPs", "Scratch"}};
  for (const Config& config : select_configs(registry, selection)) {
    try {
      const Case c = registry.find_op(config.op)->make(config.shape, config.dtype);
      lines.push_back({c.name(), c.family, bound_name(c.bound), format_bytes(c.bytes), format_fixed(c.flops / 1e9, 3) + " G",
                       format_bytes(static_cast<double>(c.scratch_bytes()))});
    } catch (const std::exception& e) {
      lines.push_back({config.op + " " + shape_str(config.shape) + " " + dtype_name(config.dtype), "-", "-", "-",
                       std::string("not buildable: ") + e.what(), "-"});
    }
  }
  write_aligned(std::cout, lines);
  return kExitOk;
}

void write_outputs(const RunArgs& args, const RunResult& result) {
  if (!args.json.empty()) write_json_file(args.json, to_json(result));
  if (!args.csv.empty()) write_text_file(args.csv, [&](std::ostream& out) { write_csv(out, result); });
  if (!args.md.empty()) write_text_file(args.md, [&](std::ostream& out) { write_markdown(out, result); });
}

std::string existing_file(const std::string& path) {
  if (!std::filesystem::exists(path)) throw UsageError("no such file: " + path);
  return path;
}

RunResult load_run(const std::string& path) {
  try {
    return run_result_from_json(read_json_file(existing_file(path)));
  } catch (const Error& e) {
    throw UsageError(path + ": " + e.what());
  }
}

}  // namespace

int run_command(const RunArgs& args) {
  const Registry& registry = Registry::global();
  RunOptions options;
  options.selection = make_selection(registry, args);
  if (args.list) return list_cases(registry, options.selection);
  options.use_gpu = choose_gpu(args.device);
  options.device_index = args.gpu;
  options.timing = args.timing;
  options.seed = args.seed;

  const auto started = std::chrono::steady_clock::now();
  RunResult result;
  result.suite = args.suite;
  result.timing = args.timing;
  result.env = capture_environment(options.use_gpu, args.gpu);
  result.env.seed = args.seed;
  result.env.command_line = args.command_line;
  if (options.use_gpu && !args.no_roofline) {
    if (!args.quiet) std::cerr << "trainscale-bench: loading or measuring the roofline...\n";
    result.roofline = load_or_measure_roofline(result.env, args.timing, args.refresh_roofline);
  }

  install_interrupt_handler();
  {
    ProgressLine progress(!args.quiet);
    run_cases(registry, options, result, [&](std::size_t i, std::size_t n, const std::string& name) {
      progress.update(i, n, name);
    });
  }
  result.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  write_terminal_table(std::cout, result);
  write_outputs(args, result);
  if (result.interrupted) {
    std::cerr << "trainscale-bench: interrupted; results so far were written\n";
    if (abandoned_references_running()) {
      // A host reference still runs on a worker thread: end now rather than wait for it.
      std::cout.flush();
      std::cerr.flush();
      std::_Exit(kExitInterrupted);
    }
    return kExitInterrupted;
  }
  return result.any_failed() ? kExitFailure : kExitOk;
}

int roofline_command(const RooflineArgs& args) {
  if (!gpu_present()) throw Error("the roofline needs a CUDA device (none is visible, or this build lacks CUDA)");
  Environment env = capture_environment(true, args.gpu);
  env.command_line = args.command_line;
  const Roofline roofline = load_or_measure_roofline(env, args.timing, args.refresh);
  write_roofline_markdown(std::cout, roofline, env);
  if (!args.json.empty()) {
    write_json_file(args.json, {{"schema", "trainscale-roofline"}, {"schema_version", kSchemaVersion},
                                {"roofline", to_json(roofline)}, {"env", to_json(env)}});
  }
  if (!args.md.empty()) {
    write_text_file(args.md, [&](std::ostream& out) { write_roofline_markdown(out, roofline, env); });
  }
  return kExitOk;
}

int compare_command(const CompareArgs& args) {
  const RunResult old_run = load_run(args.old_path);
  const RunResult new_run = load_run(args.new_path);
  const Comparison comparison = compare_runs(old_run, new_run, args.threshold_pct / 100.0);
  write_comparison(std::cout, comparison, false);
  if (!args.md.empty()) {
    write_text_file(args.md, [&](std::ostream& out) { write_comparison(out, comparison, true); });
  }
  return comparison.regressed() ? kExitFailure : kExitOk;
}

int report_command(const ReportArgs& args) {
  if (!std::filesystem::is_directory(args.dir)) throw UsageError("no such directory: " + args.dir);
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(args.dir)) {
    if (entry.is_regular_file() && entry.path().extension() == ".json") files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  std::vector<std::pair<std::string, RunResult>> runs;
  for (const auto& file : files) {
    try {
      runs.emplace_back(file.stem().string(), run_result_from_json(read_json_file(file.string())));
    } catch (const Error& e) {
      std::cerr << "trainscale-bench: skipping " << file.string() << ": " << e.what() << '\n';
    }
  }
  if (runs.empty()) throw UsageError("no trainscale-bench result files in " + args.dir);
  if (args.out.empty()) {
    write_markdown_report(std::cout, runs);
  } else {
    write_text_file(args.out, [&](std::ostream& out) { write_markdown_report(out, runs); });
  }
  return kExitOk;
}

}  // namespace trainscale::bench::cli
