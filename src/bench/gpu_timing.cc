#include "bench/gpu_timing.h"

#if TRAINSCALE_HAVE_CUDA
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <vector>

#include "bench/cuda_util.h"
#include "bench/gpu_kernels.h"
#include "bench/nvml.h"
#include "bench/statistics.h"

namespace trainscale::bench {
namespace {

// Without NVML: the SM clock from the probe kernel, at most every 200 ms (it costs ~1 ms);
// throttling is unknown then.
class ProbeClockMonitor : public ClockMonitor {
 public:
  explicit ProbeClockMonitor(cudaStream_t stream) : stream_(stream) {}
  std::optional<ClockObservation> observe() override {
    const auto now = std::chrono::steady_clock::now();
    if (now - last_ < std::chrono::milliseconds(200)) return std::nullopt;
    last_ = now;
    ClockObservation o;
    o.sm_mhz = probe_sm_clock_mhz(stream_);
    return o;
  }

 private:
  cudaStream_t stream_;
  std::chrono::steady_clock::time_point last_{};
};

class Events {
 public:
  Events() {
    cuda_check(cudaEventCreate(&start_), "cudaEventCreate");
    cuda_check(cudaEventCreate(&stop_), "cudaEventCreate");
  }
  ~Events() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;

  // `queued` runs once both events and the body are queued, before the wait.
  double time_ms(cudaStream_t stream, const std::function<void()>& body,
                 const std::function<void()>& queued = nullptr) {
    cuda_check(cudaEventRecord(start_, stream), "cudaEventRecord");
    body();
    cuda_check(cudaEventRecord(stop_, stream), "cudaEventRecord");
    if (queued) queued();
    cuda_check(cudaEventSynchronize(stop_), "kernel (cudaEventSynchronize)");
    float ms = 0;
    cuda_check(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime");
    return ms;
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// How long the hold waits for the host to queue a sample before it assumes the call waits for
// the stream itself.
constexpr unsigned long long kHoldTimeoutNs = 1'000'000'000ull;

}  // namespace

// One sample at a time on a context's stream: hold, time, release.
class StreamHold {
 public:
  explicit StreamHold(const GpuContext& gpu) : gpu_(gpu) {}

  // One timed sample of `body`; held unless an earlier sample found the call waiting for its
  // stream (then `unheld` stays set and the sample is taken again unheld).
  double sample_ms(Events& events, const std::function<void()>& body) {
    if (unheld) return events.time_ms(gpu_.stream(), body);
    std::atomic_ref<int> release(gpu_.hold_flags_[0]), timed_out(gpu_.hold_flags_[1]);
    release.store(0);
    timed_out.store(0);
    launch_hold_stream(gpu_.hold_flags_device_, gpu_.hold_flags_device_ + 1, kHoldTimeoutNs, gpu_.stream());
    const double ms = events.time_ms(gpu_.stream(), body, [&] { release.store(1); });
    if (timed_out.load() == 0) return ms;
    unheld = true;
    return events.time_ms(gpu_.stream(), body);
  }

  bool unheld = false;

 private:
  const GpuContext& gpu_;
};

namespace {

// One launch per sample, input sets in turn.
class EventSource : public SampleSource {
 public:
  EventSource(const GpuContext& gpu, GpuLaunch launch, const TimingOptions& options)
      : gpu_(gpu), launch_(std::move(launch)), rotate_(options.rotate), flush_(options.flush_l2), hold_(gpu) {}
  double sample_ms() override {
    const int set = static_cast<int>(count_++ % rotate_);
    if (flush_) gpu_.flush_l2();
    return hold_.sample_ms(events_, [&] { launch_(set, gpu_.stream()); });
  }
  const bool* unheld() const { return &hold_.unheld; }

 private:
  const GpuContext& gpu_;
  GpuLaunch launch_;
  int rotate_;
  bool flush_;
  std::int64_t count_ = 0;
  Events events_;
  StreamHold hold_;
};

// K launches (cycling through the input sets) captured once; a sample is one replay / K.
class GraphSource : public SampleSource {
 public:
  GraphSource(const GpuContext& gpu, const GpuLaunch& launch, const TimingOptions& options, int batch)
      : gpu_(gpu), batch_(batch), flush_(options.flush_l2), hold_(gpu) {
    cudaGraph_t graph = nullptr;
    cuda_check(cudaStreamBeginCapture(gpu.stream(), cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    try {
      for (int k = 0; k < batch; ++k) launch(k % options.rotate, gpu.stream());
    } catch (...) {
      cudaStreamEndCapture(gpu.stream(), &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    cuda_check(cudaStreamEndCapture(gpu.stream(), &graph), "cudaStreamEndCapture");
    const cudaError_t status = cudaGraphInstantiate(&exec_, graph, 0);
    cudaGraphDestroy(graph);
    cuda_check(status, "cudaGraphInstantiate");
  }
  ~GraphSource() override { cudaGraphExecDestroy(exec_); }
  GraphSource(const GraphSource&) = delete;
  GraphSource& operator=(const GraphSource&) = delete;

  double sample_ms() override {
    if (flush_) gpu_.flush_l2();
    return hold_.sample_ms(events_, [&] { cuda_check(cudaGraphLaunch(exec_, gpu_.stream()), "cudaGraphLaunch"); }) /
           batch_;
  }
  const bool* unheld() const { return &hold_.unheld; }

 private:
  const GpuContext& gpu_;
  int batch_;
  bool flush_;
  cudaGraphExec_t exec_ = nullptr;
  Events events_;
  StreamHold hold_;
};

// Launches shorter than this are batched in graphs when options.batch is 0 (automatic): event
// resolution and launch overhead would otherwise dominate.
constexpr double kTinyKernelMs = 0.02;
constexpr double kBatchTargetMs = 0.5;
constexpr int kMaxBatch = 200;

}  // namespace

double time_on_stream_ms(cudaStream_t stream, const std::function<void()>& body) {
  Events events;
  return events.time_ms(stream, body);
}

GpuContext::GpuContext(int device_index) : device_index_(device_index) {
  cuda_check(cudaSetDevice(device_index), "cudaSetDevice");
  cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  int l2 = 0;
  cuda_check(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device_index), "cudaDeviceGetAttribute (L2)");
  flush_bytes_ = 2 * static_cast<std::size_t>(std::max(l2, 1 << 20));
  cuda_check(cudaMalloc(&flush_buffer_, flush_bytes_), "cudaMalloc (L2 flush buffer)");
  void* flags = nullptr;
  cuda_check(cudaHostAlloc(&flags, 2 * sizeof(int), cudaHostAllocMapped), "cudaHostAlloc (stream hold flags)");
  hold_flags_ = static_cast<int*>(flags);
  hold_flags_[0] = hold_flags_[1] = 0;
  void* flags_device = nullptr;
  cuda_check(cudaHostGetDevicePointer(&flags_device, flags, 0), "cudaHostGetDevicePointer (stream hold flags)");
  hold_flags_device_ = static_cast<int*>(flags_device);
  Nvml* nvml = Nvml::get();
  char bus_id[32] = {};
  cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, device_index);
  const auto handle = nvml ? nvml->device(bus_id, device_index) : std::nullopt;
  if (handle) {
    monitor_ = make_nvml_clock_monitor(*nvml, *handle);
  } else {
    monitor_ = std::make_unique<ProbeClockMonitor>(stream_);
  }
}

GpuContext::~GpuContext() {
  cudaFree(flush_buffer_);
  cudaFreeHost(hold_flags_);
  cudaStreamDestroy(stream_);
}

const char* GpuContext::clock_source() const {
  return dynamic_cast<const ProbeClockMonitor*>(monitor_.get()) ? "probe" : "nvml";
}

void GpuContext::synchronize() const { cuda_check(cudaStreamSynchronize(stream_), "kernel (cudaStreamSynchronize)"); }

std::int64_t GpuContext::free_memory() const {
  std::size_t free = 0, total = 0;
  cuda_check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return static_cast<std::int64_t>(free);
}

void GpuContext::flush_l2() const {
  cuda_check(cudaMemsetAsync(flush_buffer_, 0, flush_bytes_, stream_), "cudaMemsetAsync (L2 flush)");
}

int GpuContext::choose_batch(const GpuLaunch& launch, const TimingOptions& options) {
  if (options.batch > 0) return options.batch;
  TimingOptions one_set = options;
  one_set.rotate = 1;
  EventSource probe(*this, launch, one_set);
  std::vector<double> ms;
  for (int i = 0; i < 5; ++i) ms.push_back(probe.sample_ms());
  std::sort(ms.begin(), ms.end());
  const double typical = percentile_sorted(ms, 50.0);
  return typical < kTinyKernelMs
             ? std::clamp(static_cast<int>(std::ceil(kBatchTargetMs / std::max(typical, 1e-4))), 2, kMaxBatch)
             : 1;
}

std::string GpuContext::Timed::timer() const { return held() ? base_ : base_ + "-unheld"; }
bool GpuContext::Timed::held() const { return !unheld_ || !*unheld_; }

GpuContext::Timed GpuContext::make_source(const GpuLaunch& launch, const TimingOptions& options, int batch) {
  Timed timed;
  if (batch > 1) {
    try {
      auto graph = std::make_unique<GraphSource>(*this, launch, options, batch);
      timed.unheld_ = graph->unheld();
      timed.source = std::move(graph);
      timed.base_ = "cuda-graph";
      timed.batch = batch;
      return timed;
    } catch (const Error&) {
      (void)cudaGetLastError();  // not capturable: time plain launches instead
    }
  }
  auto events = std::make_unique<EventSource>(*this, launch, options);
  timed.unheld_ = events->unheld();
  timed.source = std::move(events);
  timed.base_ = "cuda-events";
  return timed;
}

}  // namespace trainscale::bench
#endif
