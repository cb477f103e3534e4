// CUDA timing: events per sample on the implementation's stream, L2 flushed before cold
// samples (a device buffer of 2x the L2 size cleared with cudaMemsetAsync, outside the timed
// events), and a batch mode that captures K launches in a CUDA graph and times replays.
#pragma once

#if TRAINSCALE_HAVE_CUDA
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "bench/timing.h"

namespace trainscale::bench {

// Launches one run of the implementation on input set `set` on `stream`.
using GpuLaunch = std::function<void(int set, cudaStream_t stream)>;

class GpuContext {
 public:
  explicit GpuContext(int device_index);
  ~GpuContext();
  GpuContext(const GpuContext&) = delete;
  GpuContext& operator=(const GpuContext&) = delete;

  int device_index() const { return device_index_; }
  cudaStream_t stream() const { return stream_; }
  void synchronize() const;
  std::int64_t free_memory() const;
  // NVML when present, else the clock64()/globaltimer probe kernel.
  ClockMonitor& clock_monitor() { return *monitor_; }
  const char* clock_source() const;

  struct Timed {
    std::unique_ptr<SampleSource> source;
    std::string timer;  // "cuda-events" or "cuda-graph"
    int batch = 1;
  };
  // Picks plain event timing or graph batches (options.batch; 0 = automatic: batches when
  // one launch takes under 20 us) and returns the source to sample.
  Timed make_source(const GpuLaunch& launch, const TimingOptions& options);

  // Clears the flush buffer on the stream (evicts the L2).
  void flush_l2() const;

 private:
  int device_index_;
  cudaStream_t stream_ = nullptr;
  void* flush_buffer_ = nullptr;
  std::size_t flush_bytes_ = 0;
  std::unique_ptr<ClockMonitor> monitor_;
};

// Milliseconds between two events recorded around `body` on `stream`.
double time_on_stream_ms(cudaStream_t stream, const std::function<void()>& body);

}  // namespace trainscale::bench
#endif
