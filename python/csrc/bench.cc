// The benchmark engine (src/bench) as the Python module trainscale._C: timing of a Python
// callable (used by trainscale's automatic selection), the registry's suites, and whole runs
// with PyTorch callables as baselines next to our entry points, reported by the same C++
// reporters as trainscale-bench (JSON, CSV, Markdown, terminal table).
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench/engine.h"
#include "bench/environment.h"
#include "bench/gpu_timing.h"
#include "bench/interrupt.h"
#include "bench/progress.h"
#include "bench/registry.h"
#include "bench/report_json.h"
#include "bench/reporters.h"
#include "bench/roofline.h"
#include "bench/timing.h"
#include "trainscale/error.h"

#if defined(TRAINSCALE_TORCH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace py = pybind11;
namespace tb = trainscale::bench;
using trainscale::DType;
using trainscale::TensorView;

namespace {

[[noreturn]] void arg_error(const char* fn, const char* arg, const std::string& what) {
  throw py::value_error(std::string("trainscale._C.") + fn + ": argument '" + arg + "': " + what);
}

std::string join(const std::vector<std::string>& items) {
  std::string s;
  for (const auto& item : items) s += (s.empty() ? "" : ", ") + item;
  return s;
}

// Timing options from a dict of the StoppingRule / TimingOptions fields (missing keys keep the
// engine's defaults; unknown keys are an error).
tb::TimingOptions timing_from(const py::dict& d, const char* fn) {
  tb::TimingOptions t;
  for (const auto& [key_obj, value] : d) {
    const std::string key = py::str(key_obj);
    if (key == "target_rel_noise") t.stop.target_rel_noise = value.cast<double>();
    else if (key == "min_samples") t.stop.min_samples = value.cast<std::int64_t>();
    else if (key == "min_time_ms") t.stop.min_time_ms = value.cast<double>();
    else if (key == "timeout_ms") t.stop.timeout_ms = value.cast<double>();
    else if (key == "max_samples") t.stop.max_samples = value.cast<std::int64_t>();
    else if (key == "warmup_ms") t.warmup_ms = value.cast<double>();
    else if (key == "warmup_min") t.warmup_min = value.cast<std::int64_t>();
    else if (key == "flush_l2") t.flush_l2 = value.cast<bool>();
    else if (key == "rotate") t.rotate = value.cast<int>();
    else if (key == "batch") t.batch = value.cast<int>();
    else arg_error(fn, "timing", "unknown option '" + key + "'");
  }
  if (t.stop.min_samples < 1 || t.stop.max_samples < t.stop.min_samples || t.stop.timeout_ms <= 0 ||
      t.rotate < 1 || t.batch < 0) {
    arg_error(fn, "timing", "expected min_samples >= 1, max_samples >= min_samples, timeout_ms > 0, "
                            "rotate >= 1, batch >= 0");
  }
  return t;
}

// A Python exception raised inside the engine: NotImplementedError means "this implementation
// does not cover the case" (an UNSUPPORTED row); KeyboardInterrupt stops the run like Ctrl-C in
// the CLI; anything else fails the row with Python's message.
template <class F>
void call_python(F&& f) {
  try {
    f();
  } catch (py::error_already_set& e) {
    if (e.matches(PyExc_KeyboardInterrupt)) tb::request_interrupt();
    if (e.matches(PyExc_NotImplementedError)) throw tb::Unsupported(e.what());
    throw std::runtime_error(e.what());
  }
}

#if defined(TRAINSCALE_TORCH_CUDA)
// One engine context (stream, L2 flush buffer, clock monitor) per device for the whole process;
// never destroyed, since the CUDA runtime may be gone by the time static destructors run.
tb::GpuContext& gpu_context(int device) {
  static std::map<int, tb::GpuContext*> contexts;
  tb::GpuContext*& ctx = contexts[device];
  if (!ctx) {
    c10::cuda::CUDAGuard keep_current_device(static_cast<c10::DeviceIndex>(device));
    ctx = new tb::GpuContext(device);
  }
  return *ctx;
}

// Makes the engine's stream PyTorch's current stream while a callable runs, so the work it
// launches is what the engine's events enclose.
struct OnEngineStream {
  c10::cuda::CUDAStreamGuard guard;
  OnEngineStream(cudaStream_t stream, int device)
      : guard(c10::cuda::getStreamFromExternal(stream, static_cast<c10::DeviceIndex>(device))) {}
};
#endif

py::dict summary_dict(const tb::SampleSet& samples, const std::string& timer) {
  const tb::Summary s = tb::summarize(samples.ms);
  py::dict d;
  d["count"] = s.count;
  d["median"] = s.median;
  d["mean"] = s.mean;
  d["std"] = s.std;
  d["min"] = s.min;
  d["max"] = s.max;
  d["p5"] = s.p5;
  d["p95"] = s.p95;
  d["p99"] = s.p99;
  d["rel_noise"] = s.rel_noise;
  d["stop_reason"] = tb::stop_reason_name(samples.reason);
  d["timer"] = timer;
  d["sm_mhz_min"] = samples.sm_mhz_min;
  d["sm_mhz_max"] = samples.sm_mhz_max;
  d["throttled"] = samples.throttled;
  d["throttle_retakes"] = samples.throttle_retakes;
  d["throttle_reasons"] = samples.throttle_reasons;
  return d;
}

// Times fn() (milliseconds per call) with the engine's sampling loop: on CUDA device `device`
// with events around each call on the engine's stream, L2 flushed before each sample when
// timing["flush_l2"] (the default), no CUDA graphs (PyTorch allocates); on the host clock when
// device < 0.
py::dict time_callable(const py::function& fn, int device, const py::dict& timing) {
  tb::TimingOptions options = timing_from(timing, "time_callable");
  tb::SampleSet samples;
  // Python exceptions pass through the engine unchanged, back to the caller.
  auto call = [&] { fn(); };
  if (device < 0) {
    tb::HostSampleSource source([&](int) { call(); }, 1);
    samples = tb::collect_samples(source, options, nullptr);
    return summary_dict(samples, "host");
  }
#if defined(TRAINSCALE_TORCH_CUDA)
  if (device >= static_cast<int>(c10::cuda::device_count())) {
    arg_error("time_callable", "device", "no CUDA device " + std::to_string(device));
  }
  tb::GpuContext& gpu = gpu_context(device);
  // The callable's inputs were written on the caller's stream.
  c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).synchronize();
  options.batch = 1;
  auto timed = gpu.make_source([&](int, cudaStream_t stream) {
    OnEngineStream on(stream, device);
    call();
  }, options, 1);
  samples = tb::collect_samples(*timed.source, options, &gpu.clock_monitor());
  gpu.synchronize();
  return summary_dict(samples, timed.timer());
#else
  arg_error("time_callable", "device", "this build of trainscale has no CUDA support");
#endif
}

std::vector<py::tuple> suite_configs(const std::vector<std::string>& suites) {
  const tb::Registry& registry = tb::Registry::global();
  tb::Selection selection;
  selection.suites.clear();
  for (const auto& suite : suites) {
    if (!registry.has_suite(suite)) {
      arg_error("suite_configs", "suites", "unknown suite '" + suite + "' (known: " + join(registry.suite_names()) + ")");
    }
    selection.suites.push_back(suite);
  }
  std::vector<py::tuple> out;
  for (const tb::Config& c : tb::select_configs(registry, selection)) {
    out.push_back(py::make_tuple(c.op, py::tuple(py::cast(c.shape)), trainscale::dtype_name(c.dtype)));
  }
  return out;
}

std::vector<py::tuple> op_infos() {
  const tb::Registry& registry = tb::Registry::global();
  std::vector<py::tuple> out;
  for (const auto& name : registry.op_names()) {
    const tb::OpInfo* op = registry.find_op(name);
    out.push_back(py::make_tuple(op->name, op->family, op->shape_doc));
  }
  return out;
}

at::ScalarType scalar_type_of(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return at::kDouble;
    case DType::kFloat32: return at::kFloat;
    case DType::kFloat16: return at::kHalf;
    case DType::kBFloat16: return at::kBFloat16;
    case DType::kFloat8E4M3: return at::kFloat8_e4m3fn;
    case DType::kFloat8E5M2: return at::kFloat8_e5m2;
    case DType::kInt32: return at::kInt;
    case DType::kInt64: return at::kLong;
  }
  throw std::runtime_error("trainscale._C: unknown dtype");
}

// A non-owning tensor over an engine buffer.
at::Tensor tensor_of(const TensorView& v) {
  const auto device = v.is_cuda() ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(v.device.index))
                                  : at::Device(at::kCPU);
  return at::from_blob(v.data, at::IntArrayRef(v.shape.data(), v.ndim), at::IntArrayRef(v.strides.data(), v.ndim),
                       at::TensorOptions().dtype(scalar_type_of(v.dtype)).device(device));
}

// A PyTorch baseline: make(op, shape, dtype) returns None (does not apply) or
// setup(inputs: dict name -> Tensor) -> run, where run() returns the case's outputs (its
// output and in/out tensors, in the case's order). setup runs once per input set, untimed
// (compilation, the forward pass a backward needs); run() is what is timed. The gate copies
// run()'s results into the case's output tensors; timed calls keep them as PyTorch returns them.
struct PythonBaseline {
  std::string name;
  py::object make;
};

// `device`: the CUDA device of the run, -1 on the CPU.
tb::BaselineFactory python_factory(const PythonBaseline& baseline, int device) {
  return [baseline, device](const tb::Case& c) -> std::optional<tb::Implementation> {
    const bool on_gpu = device >= 0;
    py::object setup;
    try {
      call_python([&] { setup = baseline.make(c.op, py::tuple(py::cast(c.shape)), trainscale::dtype_name(c.dtype)); });
    } catch (const std::exception& e) {
      // The engine asks for baselines outside its per-row error handling: report it in the row.
      const std::string what = e.what();
      const bool unsupported = dynamic_cast<const tb::Unsupported*>(&e) != nullptr;
      tb::Implementation failing;
      failing.on_gpu = on_gpu;
      failing.run = [what, unsupported](tb::CaseTensors, cudaStream_t) {
        if (unsupported) throw tb::Unsupported(what);
        throw std::runtime_error("setting up the baseline: " + what);
      };
      return failing;
    }
    if (setup.is_none()) return std::nullopt;
    struct State {
      py::object setup;
      std::map<void*, py::object> runs;  // per input set, keyed by its first tensor's address
    };
    auto state = std::make_shared<State>(State{setup, {}});
    const std::vector<tb::TensorSpec> specs = c.tensors;
    std::size_t expected = 0;
    for (const auto& spec : specs) expected += tb::is_checked_output(spec.role) ? 1 : 0;
    auto run_of = [state, specs](tb::CaseTensors t) -> py::object& {
      py::object& run = state->runs[t.all()[0].data];
      if (!run) {
        py::dict inputs;
        for (std::size_t i = 0; i < specs.size(); ++i) {
          if (tb::has_input_data(specs[i].role)) inputs[py::str(specs[i].name)] = tensor_of(t.all()[i]);
        }
        call_python([&] { run = state->setup(inputs); });
      }
      return run;
    };
    auto on_stream = [device](cudaStream_t stream, const std::function<void()>& body) {
#if defined(TRAINSCALE_TORCH_CUDA)
      if (device >= 0) {
        OnEngineStream on(stream, device);
        body();
        return;
      }
#endif
      body();
    };
    tb::Implementation impl;
    impl.on_gpu = on_gpu;
    impl.capturable = false;
    impl.run = [=](tb::CaseTensors t, cudaStream_t stream) {
      on_stream(stream, [&] { call_python([&] { run_of(t)(); }); });
    };
    impl.gate_run = [=, name = baseline.name](tb::CaseTensors t, cudaStream_t stream) {
      on_stream(stream, [&] {
        call_python([&] {
          py::object result = run_of(t)();
          py::tuple outs = py::isinstance<py::tuple>(result) ? result.cast<py::tuple>() : py::make_tuple(result);
          if (outs.size() != expected) {
            throw std::runtime_error("baseline '" + name + "' returned " + std::to_string(outs.size()) +
                                     " outputs, the case has " + std::to_string(expected));
          }
          std::size_t k = 0;
          for (std::size_t i = 0; i < specs.size(); ++i) {
            if (tb::is_checked_output(specs[i].role)) tensor_of(t.all()[i]).copy_(outs[k++].cast<at::Tensor>());
          }
        });
      });
    };
    return impl;
  };
}

// A run without rows yet: this machine's environment, the timing options and, on a GPU, the
// roofline (cached or measured).
tb::RunResult new_run(const std::string& suite, bool use_gpu, int device, const tb::TimingOptions& timing,
                      std::uint64_t seed, bool roofline, const std::string& command_line) {
  tb::RunResult result;
  result.suite = suite;
  result.timing = timing;
  result.env = tb::capture_environment(use_gpu, device);
  result.env.seed = seed;
  result.env.command_line = command_line;
  if (use_gpu && roofline) result.roofline = tb::load_or_measure_roofline(result.env, timing, false);
  return result;
}

// new_run as JSON text, for rows measured in Python (python -m trainscale.bench --suite flce).
std::string empty_run(const std::string& suite, bool use_gpu, int device, const py::dict& timing,
                      std::uint64_t seed, bool roofline, const std::string& command_line) {
#if !defined(TRAINSCALE_TORCH_CUDA)
  if (use_gpu) arg_error("empty_run", "use_gpu", "this build of trainscale has no CUDA support");
#endif
  return tb::to_json(new_run(suite, use_gpu, device, timing_from(timing, "empty_run"), seed, roofline,
                             command_line)).dump(2);
}

// A whole benchmark run; returns the result as JSON text (docs/bench-json.md).
std::string run_bench(const std::vector<std::string>& suites, const std::vector<std::string>& ops,
                      const std::vector<std::string>& dtypes, const std::vector<std::string>& configs,
                      const std::vector<std::string>& impls, const std::vector<std::pair<std::string, py::object>>& baselines,
                      bool use_gpu, int device, const py::dict& timing, std::uint64_t seed, bool roofline,
                      const std::string& command_line, bool progress) {
  const char* fn = "run_bench";
  tb::Registry registry = tb::Registry::global();  // a copy: the Python baselines are this run's
  tb::RunOptions options;
  options.selection.suites.clear();
  for (const auto& suite : suites) {
    if (!registry.has_suite(suite)) {
      arg_error(fn, "suites", "unknown suite '" + suite + "' (known: " + join(registry.suite_names()) + ")");
    }
    options.selection.suites.push_back(suite);
  }
  if (options.selection.suites.empty()) arg_error(fn, "suites", "names no suite");
  for (const auto& op : ops) {
    if (!registry.find_op(op)) arg_error(fn, "ops", "unknown op '" + op + "' (known: " + join(registry.op_names()) + ")");
    options.selection.ops.push_back(op);
  }
  for (const auto& name : dtypes) {
    const auto dtype = tb::parse_dtype(name);
    if (!dtype) arg_error(fn, "dtypes", "unknown dtype '" + name + "' (known: fp32, fp16, bf16, e4m3, e5m2, fp64)");
    options.selection.dtypes.push_back(*dtype);
  }
  for (const auto& text : configs) {
    const auto shape = tb::parse_shape(text);
    if (!shape) arg_error(fn, "configs", "bad entry '" + text + "' (expected sizes joined by 'x', e.g. 32768x4096)");
    options.selection.configs.push_back(*shape);
  }
#if !defined(TRAINSCALE_TORCH_CUDA)
  if (use_gpu) arg_error(fn, "use_gpu", "this build of trainscale has no CUDA support");
#endif
  for (const auto& [name, make] : baselines) {
    for (const auto& op : registry.op_names()) {
      registry.add_baseline(op, name, python_factory({name, make}, use_gpu ? device : -1), use_gpu);
    }
  }
  std::vector<std::string> known = {tb::kOursGpu, tb::kOursCpu};
  for (const auto& name : registry.baseline_names()) known.push_back(name);
  for (const auto& name : registry.opt_in_names()) known.push_back(name);
  for (const auto& impl : impls) {
    if (std::find(known.begin(), known.end(), impl) == known.end()) {
      arg_error(fn, "impls", "unknown implementation '" + impl + "' (known: " + join(known) + ")");
    }
    options.selection.impls.push_back(impl);
  }
  options.use_gpu = use_gpu;
  options.device_index = device;
  options.timing = timing_from(timing, fn);
  options.seed = seed;

  const auto started = std::chrono::steady_clock::now();
  tb::RunResult result = new_run(join(suites), use_gpu, device, options.timing, seed, roofline, command_line);
  tb::clear_interrupt();
  // Ctrl-C only sets Python's flag while C++ runs: the engine asks for it while it waits.
  tb::set_interrupt_poll([] {
    if (PyErr_CheckSignals() == 0) return false;
    PyErr_Clear();
    return true;
  });
  {
    struct ClearPoll {
      ~ClearPoll() { tb::set_interrupt_poll(nullptr); }
    } clear_poll;
    tb::ProgressLine line(progress);
    tb::run_cases(registry, options, result,
                  [&](std::size_t i, std::size_t n, const std::string& name) { line.update(i, n, name); });
  }
  tb::clear_interrupt();
  result.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return tb::to_json(result).dump(2);
}

// The C++ reporters over a result's JSON text: "terminal", "csv" or "markdown".
std::string report(const std::string& json_text, const std::string& format) {
  const tb::RunResult result = tb::run_result_from_json(nlohmann::json::parse(json_text));
  std::ostringstream out;
  if (format == "terminal") tb::write_terminal_table(out, result);
  else if (format == "csv") tb::write_csv(out, result);
  else if (format == "markdown") tb::write_markdown(out, result);
  else arg_error("report", "format", "expected 'terminal', 'csv' or 'markdown', got '" + format + "'");
  return out.str();
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "trainscale's benchmark engine (src/bench); the ops are in torch.ops.trainscale";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const trainscale::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
  m.def("time_callable", &time_callable, py::arg("fn"), py::arg("device") = -1, py::arg("timing") = py::dict(),
        "Times fn() with the engine (CUDA events on device >= 0, the host clock on -1); returns the statistics in ms.");
  m.def("summarize", [](const std::vector<double>& ms) {
        if (ms.empty()) arg_error("summarize", "samples", "at least one sample");
        tb::SampleSet samples;
        samples.ms = ms;
        return summary_dict(samples, "");
      }, py::arg("samples"),
        "The engine's statistics (median, its 95% CI noise, percentiles) of samples timed elsewhere, in ms.");
  m.def("suite_names", [] { return tb::Registry::global().suite_names(); });
  m.def("ops", &op_infos, "(name, family, shape doc) of every registered op");
  m.def("suite_configs", &suite_configs, py::arg("suites"), "(op, shape, dtype) of the suites' configs, in order");
  m.def("run_bench", &run_bench, py::arg("suites"), py::arg("ops"), py::arg("dtypes"), py::arg("configs"),
        py::arg("impls"), py::arg("baselines"), py::arg("use_gpu"), py::arg("device"), py::arg("timing"),
        py::arg("seed"), py::arg("roofline"), py::arg("command_line"), py::arg("progress"));
  m.def("empty_run", &empty_run, py::arg("suite"), py::arg("use_gpu"), py::arg("device"), py::arg("timing"),
        py::arg("seed"), py::arg("roofline"), py::arg("command_line"),
        "JSON text of a run without rows (environment, timing options, roofline on a GPU)");
  m.def("report", &report, py::arg("json"), py::arg("format"));
  m.attr("has_cuda") =
#if defined(TRAINSCALE_TORCH_CUDA)
      true;
#else
      false;
#endif
}
