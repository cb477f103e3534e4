#include "bench/engine.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "bench/gate.h"
#include "bench/gpu_timing.h"
#include "bench/interrupt.h"
#include "bench/reporters.h"
#include "bench/tensors.h"
#include "trainscale/error.h"

namespace trainscale::bench {

std::vector<Config> select_configs(const Registry& registry, const Selection& selection) {
  auto wanted = [](const auto& filter, const auto& value) {
    return filter.empty() || std::find(filter.begin(), filter.end(), value) != filter.end();
  };
  std::vector<Config> configs;
  auto seen = [&](const Config& c) {
    return std::any_of(configs.begin(), configs.end(), [&](const Config& o) {
      return o.op == c.op && o.shape == c.shape && o.dtype == c.dtype;
    });
  };
  for (const std::string& suite : selection.suites) {
    for (const Config& config : registry.suite(suite)) {
      if (wanted(selection.ops, config.op) && wanted(selection.dtypes, config.dtype) &&
          wanted(selection.configs, config.shape) && !seen(config)) {
        configs.push_back(config);
      }
    }
  }
  return configs;
}

std::uint64_t case_seed(std::uint64_t seed, const std::string& case_name) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char ch : case_name) h = (h ^ ch) * 1099511628211ull;
  return seed ^ h;
}

int cold_input_sets(std::int64_t set_bytes, std::int64_t l2_bytes, int batch) {
  const std::int64_t bytes = std::max<std::int64_t>(set_bytes, 1);
  const std::int64_t others = (2 * l2_bytes + bytes - 1) / bytes;
  return static_cast<int>(std::min<std::int64_t>(batch, others + 1));
}

double memory_ceiling_gbps(const Roofline& roofline, double read_share) {
  const double s = std::clamp(read_share, 0.0, 1.0);
  // At a measured mix exactly that ceiling (the interpolation could miss it by a rounding).
  const auto between = [s](double s0, double g0, double s1, double g1) {
    return s == s1 ? g1 : g0 + (g1 - g0) * (s - s0) / (s1 - s0);
  };
  // A ceiling not measured (an older cache) leaves the copy's.
  if (s <= 0.5 || roofline.read2_write1_gbps <= 0) return roofline.copy_gbps;
  if (s <= 2.0 / 3.0) return between(0.5, roofline.copy_gbps, 2.0 / 3.0, roofline.read2_write1_gbps);
  return between(2.0 / 3.0, roofline.read2_write1_gbps, 1.0, std::max(roofline.read_gbps, roofline.read2_write1_gbps));
}

std::optional<double> percent_of_roofline(const std::optional<Roofline>& roofline, Bound bound, double gbps,
                                          double tflops, double read_share) {
  if (!roofline) return std::nullopt;
  const double ceiling =
      bound == Bound::kMemory ? memory_ceiling_gbps(*roofline, read_share) : roofline->gemm_bf16_tflops;
  if (ceiling <= 0) return std::nullopt;
  // Divided first: the row that set a ceiling is then exactly 100 %, not 100 plus a rounding.
  return (bound == Bound::kMemory ? gbps : tflops) / ceiling * 100.0;
}

void raise_ceilings_to_rows(RunResult& result) {
  if (!result.roofline) return;
  Roofline& roofline = *result.roofline;
  struct Anchor {
    double read_share;
    double* gbps;
    const char* name;
  };
  const Anchor anchors[] = {{0.5, &roofline.copy_gbps, "copy"},
                            {2.0 / 3.0, &roofline.read2_write1_gbps, "2 reads per write"},
                            {1.0, &roofline.read_gbps, "read"}};
  const double dram_sized = 4.0 * static_cast<double>(result.env.l2_bytes);
  bool raised = false;
  for (const Anchor& anchor : anchors) {
    const Row* fastest = nullptr;
    for (const Row& row : result.rows) {
      if (row.status != Status::kOk || row.bound != Bound::kMemory || !row.cold || row.bytes < dram_sized ||
          row.bytes <= 0 || std::abs(row.bytes_read / row.bytes - anchor.read_share) > 0.005) {
        continue;
      }
      if (row.gbps > *anchor.gbps && (!fastest || row.gbps > fastest->gbps)) fastest = &row;
    }
    if (!fastest || *anchor.gbps <= 0) continue;
    roofline.raised_by.push_back(std::string(anchor.name) + ": " + format_fixed(fastest->gbps, 0) + " GB/s by " +
                                 fastest->case_name + " (" + fastest->impl + "); stream kernels " +
                                 format_fixed(*anchor.gbps, 0) + " GB/s");
    *anchor.gbps = fastest->gbps;
    raised = true;
  }
  if (!raised) return;
  for (Row& row : result.rows) {
    if (row.bound != Bound::kMemory || !row.pct_roofline || row.bytes <= 0) continue;
    row.pct_roofline =
        percent_of_roofline(result.roofline, row.bound, row.gbps, row.tflops, row.bytes_read / row.bytes);
  }
}

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Errors that mean "this implementation does not cover this case yet", not "it is wrong".
bool is_unsupported(const std::exception& e) {
  // A forced kernel variant (an opt-in implementation) that does not take this shape.
  if (dynamic_cast<const Unsupported*>(&e) || dynamic_cast<const UnsupportedVariantError*>(&e)) return true;
  const std::string what = e.what();
  return what.find("has only its CPU reference so far") != std::string::npos ||
         what.find("has no CUDA support") != std::string::npos;
}

bool is_cpu_reference_only(const Row& row) {
  return row.status == Status::kUnsupported && row.message.find("has only its CPU reference so far") != std::string::npos;
}

std::int64_t case_bytes(const Case& c) {
  std::int64_t total = 0;
  for (const TensorSpec& spec : c.tensors) total += tensor_bytes(spec.dtype, spec.shape);
  return total;
}

std::int64_t output_bytes(const Case& c) {
  std::int64_t total = 0;
  for (const TensorSpec& spec : c.tensors) {
    if (spec.role != Role::kInput) total += tensor_bytes(spec.dtype, spec.shape);
  }
  return total;
}

std::int64_t host_available_bytes() {
  return static_cast<std::int64_t>(sysconf(_SC_AVPHYS_PAGES)) * sysconf(_SC_PAGESIZE);
}

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GiB", bytes / kGiB);
  return buf;
}

// One full set of a case's tensors on `device`.
std::vector<OwnedTensor> allocate_set(const Case& c, Device device) {
  std::vector<OwnedTensor> set;
  for (const TensorSpec& spec : c.tensors) set.emplace_back(spec.dtype, spec.shape, device);
  return set;
}

std::vector<TensorView> views_of(const std::vector<OwnedTensor>& set) {
  std::vector<TensorView> views;
  for (const auto& t : set) views.push_back(t.view());
  return views;
}

Row base_row(const Case& c, const Implementation& impl, const RunOptions& options) {
  Row row;
  row.case_name = c.name();
  row.op = c.op;
  row.family = c.family;
  row.shape = c.shape_str();
  row.dtype = dtype_name(c.dtype);
  row.impl = impl.name;
  row.baseline = impl.baseline;
  row.device = impl.on_gpu ? "cuda" : "cpu";
  row.bytes = c.bytes;
  row.bytes_read = std::min(c.bytes, c.bytes_read());
  row.flops = c.flops;
  row.bound = c.bound;
  row.rotate = options.timing.rotate;
  return row;
}

void fill_timing(Row& row, const SampleSet& samples, const std::optional<Roofline>& roofline) {
  row.ms = summarize(samples.ms);
  row.stop_reason = stop_reason_name(samples.reason);
  row.sm_mhz_min = samples.sm_mhz_min;
  row.sm_mhz_max = samples.sm_mhz_max;
  row.throttle_retakes = samples.throttle_retakes;
  row.throttled = samples.throttled;
  row.throttle_reasons = samples.throttle_reasons;
  if (row.ms.median > 0) {
    const double seconds = row.ms.median * 1e-3;
    row.gbps = row.bytes / seconds / 1e9;
    row.tflops = row.flops / seconds / 1e12;
  }
  row.pct_roofline = percent_of_roofline(roofline, row.bound, row.gbps, row.tflops,
                                         row.bytes > 0 ? row.bytes_read / row.bytes : 0.5);
  if (samples.reason == StopReason::kInterrupted) {
    row.status = Status::kInterrupted;
    row.message = "interrupted after " + std::to_string(samples.ms.size()) + " samples";
  }
}

// Everything a case's implementations share on one device.
struct Runner {
  const RunOptions& options;
  const std::optional<Roofline>& roofline;
#if TRAINSCALE_HAVE_CUDA
  std::unique_ptr<GpuContext> gpu;
#endif

  void synchronize() const {
#if TRAINSCALE_HAVE_CUDA
    if (gpu) gpu->synchronize();
#endif
  }
  cudaStream_t stream() const {
#if TRAINSCALE_HAVE_CUDA
    if (gpu) return gpu->stream();
#endif
    return nullptr;
  }
  std::int64_t free_device_memory() const {
#if TRAINSCALE_HAVE_CUDA
    if (gpu) return gpu->free_memory();
#endif
    return host_available_bytes();
  }

  // Gate, then time. `gate_impl` makes the gated call: `impl` itself, or the same
  // implementation made for the gate's prefix problem. Every failure ends up in the row, never
  // as an exception.
  Row run(const Case& c, const Implementation& impl, const Implementation& gate_impl, const GateData& gate) {
    Row row = base_row(c, impl, options);
    const Device device = impl.on_gpu ? Device::cuda(options.device_index) : Device::cpu();
    std::vector<std::vector<OwnedTensor>> sets;
    try {
      sets.push_back(allocate_set(c, device));
      gate.load_inputs(sets[0]);
      const std::int64_t free_after_alloc = impl.on_gpu ? free_device_memory() : 0;
      const auto memory_kept = [&] {
        return impl.on_gpu ? std::max<std::int64_t>(0, free_after_alloc - free_device_memory()) : 0;
      };
      (gate_impl.gate_run ? gate_impl.gate_run : gate_impl.run)(gate.gated_views(sets[0]), stream());
      synchronize();
      std::int64_t kept = memory_kept();
      const GateResult check = gate.check(sets[0]);
      row.rel_l2 = check.rel_l2;
      row.max_abs_err = check.max_abs;
      row.tolerance = check.tolerance;
      row.rows_checked = check.rows_checked;
      row.rows_total = check.rows_total;
      row.rows_coverage = check.coverage;
      row.gate_scope = check.scope;
      if (check.passed && &gate_impl != &impl) {
        // The gated call solved a smaller problem: the memory kept is the full problem's.
        impl.run(views_of(sets[0]), stream());
        synchronize();
        kept = std::max(kept, memory_kept());
      }
      row.peak_memory_bytes = output_bytes(c) + impl.workspace_bytes + kept;
      row.extra_memory_bytes = c.scratch_bytes() + impl.workspace_bytes + kept;
      if (!check.passed) {
        row.status = Status::kFailed;
        row.message = check.message;
        return row;
      }
    } catch (const GateInterrupted& e) {
      row.status = Status::kInterrupted;
      row.message = e.what();
      return row;
    } catch (const std::exception& e) {
      row.status = is_unsupported(e) ? Status::kUnsupported : Status::kFailed;
      row.message = e.what();
      return row;
    }

    try {
      TimingOptions timing = options.timing;
      std::vector<std::vector<TensorView>> set_views;
      const auto add_sets = [&](int count) {
        while (static_cast<int>(sets.size()) < count) {
          sets.push_back(allocate_set(c, device));
          gate.load_inputs(sets.back());
        }
        set_views.clear();
        for (const auto& set : sets) set_views.push_back(views_of(set));
      };
      add_sets(timing.rotate);
      row.cold = impl.on_gpu && timing.flush_l2;
      SampleSet samples;
#if TRAINSCALE_HAVE_CUDA
      if (impl.on_gpu) {
        if (!impl.capturable) timing.batch = 1;
        const GpuLaunch launch = [&](int set, cudaStream_t stream) { impl.run(set_views[set], stream); };
        const int batch = gpu->choose_batch(launch, timing);
        if (batch > 1 && timing.flush_l2) {
          // Only a replay's first launch follows the flush: the others must each find their own
          // inputs and outputs evicted, so consecutive launches cycle through enough sets.
          timing.rotate = std::max(timing.rotate, cold_input_sets(case_bytes(c), gpu->l2_bytes(), batch));
          if (static_cast<double>(case_bytes(c)) * timing.rotate > 0.9 * static_cast<double>(free_device_memory())) {
            throw std::runtime_error("the " + std::to_string(timing.rotate) +
                                     " input sets that keep every launch of a batch cold do not fit in device memory");
          }
          add_sets(timing.rotate);
        }
        row.rotate = timing.rotate;
        auto timed = gpu->make_source(launch, timing, batch);
        samples = collect_samples(*timed.source, timing, &gpu->clock_monitor());
        row.timer = timed.timer();
        row.batch = timed.batch;
      }
#endif
      if (!impl.on_gpu) {
        HostSampleSource source([&](int set) { impl.run(set_views[set], nullptr); }, timing.rotate);
        row.timer = "host";
        samples = collect_samples(source, timing, nullptr);
      }
      fill_timing(row, samples, roofline);
    } catch (const std::exception& e) {
      row.status = Status::kFailed;
      row.message = std::string("while timing: ") + e.what();
    }
    return row;
  }

  // Why a case cannot run here, or empty.
  std::string does_not_fit(const Case& c) const {
    const double needed = static_cast<double>(case_bytes(c)) * options.timing.rotate;
    const double free = static_cast<double>(free_device_memory());
    if (needed > 0.9 * free) {
      return std::string("does not fit in ") + (options.use_gpu ? "device" : "host") + " memory (needs " +
             gib(needed) + ", " + gib(free) + " free)";
    }
    return {};
  }
};

std::vector<Implementation> implementations(const Registry& registry, const Case& c, const RunOptions& options) {
  std::vector<Implementation> impls;
  Implementation ours;
  ours.name = options.use_gpu ? kOursGpu : kOursCpu;
  ours.on_gpu = options.use_gpu;
  ours.run = c.entry;
  impls.push_back(std::move(ours));
  // Baselines of the run's device: CUDA ones on a GPU; the Python front-end also adds PyTorch
  // baselines on the CPU. Opt-in implementations only when the selection names them.
  const auto& filter = options.selection.impls;
  for (auto& b : registry.baselines_for(c, options.use_gpu, filter)) impls.push_back(std::move(b));
  if (!filter.empty()) {
    std::erase_if(impls, [&](const Implementation& i) {
      return std::find(filter.begin(), filter.end(), i.name) == filter.end();
    });
  }
  return impls;
}

}  // namespace

void run_cases(const Registry& registry, const RunOptions& options, RunResult& result,
               const ProgressCallback& progress) {
  Runner runner{options, result.roofline};
#if TRAINSCALE_HAVE_CUDA
  if (options.use_gpu) runner.gpu = std::make_unique<GpuContext>(options.device_index);
#endif
  const std::vector<Config> configs = select_configs(registry, options.selection);
  for (std::size_t i = 0; i < configs.size(); ++i) {
    const Config& config = configs[i];
    const OpInfo* op = registry.find_op(config.op);
    const std::string label = config.op + " " + shape_str(config.shape) + " " + dtype_name(config.dtype);
    if (interrupt_requested()) {
      result.interrupted = true;
      result.skipped.push_back({label, "not run: interrupted"});
      continue;
    }
    if (progress) progress(i, configs.size(), label);
    if (!op) {
      result.skipped.push_back({label, "no op registered under this name"});
      continue;
    }
    std::optional<Case> c;
    try {
      c = op->make(config.shape, config.dtype);
    } catch (const std::exception& e) {
      result.skipped.push_back({label, e.what()});
      continue;
    }
    if (const std::string why = runner.does_not_fit(*c); !why.empty()) {
      result.skipped.push_back({label, why});
      continue;
    }
    const std::vector<Implementation> impls = implementations(registry, *c, options);
    if (impls.empty()) continue;
    std::unique_ptr<GateData> gate;
    std::string reference_error;
    try {
      gate = std::make_unique<GateData>(*c, case_seed(options.seed, c->name()), options.gate);
    } catch (const std::exception& e) {
      reference_error = std::string("reference failed: ") + e.what();
    }
    // A prefix gate calls implementations made for the prefix problem (baselines plan per shape).
    std::vector<Implementation> prefix_impls;
    if (gate && gate->coverage() == RowCoverage::kPrefix) {
      prefix_impls = implementations(registry, gate->gated_case(), options);
    }
    for (const Implementation& impl : impls) {
      const Implementation* gate_impl = &impl;
      if (gate && gate->coverage() == RowCoverage::kPrefix) {
        const auto it = std::find_if(prefix_impls.begin(), prefix_impls.end(),
                                     [&](const Implementation& p) { return p.name == impl.name; });
        gate_impl = it == prefix_impls.end() ? nullptr : &*it;
      }
      if (!gate || !gate_impl) {
        Row row = base_row(*c, impl, options);
        row.status = gate ? Status::kUnsupported : Status::kFailed;
        row.message = gate ? "no " + impl.name + " implementation of the gate's prefix problem " +
                                 gate->gated_case().shape_str()
                           : reference_error;
        result.rows.push_back(std::move(row));
        continue;
      }
      Row row = runner.run(*c, impl, *gate_impl, *gate);
      if (!impl.baseline && is_cpu_reference_only(row)) {
        // No kernel of ours to compare: the baselines are not run (nor the reference computed).
        result.skipped.push_back({label, kCpuReferenceOnly});
        break;
      }
      result.rows.push_back(std::move(row));
      if (interrupt_requested()) break;
    }
    result.interrupted = result.interrupted || interrupt_requested();
  }
  raise_ceilings_to_rows(result);
}

}  // namespace trainscale::bench
