// CUDA timing: events per sample on the implementation's stream, L2 flushed before cold
// samples (a device buffer of 2x the L2 size cleared with cudaMemsetAsync, outside the timed
// events), and a batch mode that captures K launches in a CUDA graph and times replays.
// Device time only: before each sample a kernel holds the stream until the host has queued the
// start event, the launches and the stop event, so host work inside the call (a PyTorch
// callable's Python, Dynamo's guards) does not fall between the events. A call that waits for
// its own stream (it would deadlock behind the hold) is detected by the hold's timeout and then
// timed unheld, which its row's timer says ("cuda-events-unheld").
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

  std::int64_t l2_bytes() const { return static_cast<std::int64_t>(flush_bytes_ / 2); }

  // Launches per sample: options.batch, or when it is 0, a batch when one launch takes under
  // 20 us (timed on input set 0).
  int choose_batch(const GpuLaunch& launch, const TimingOptions& options);

  class Timed {
   public:
    std::unique_ptr<SampleSource> source;
    int batch = 1;
    // "cuda-events", "cuda-graph", or with "-unheld" when the stream could not be held.
    std::string timer() const;
    bool held() const;

   private:
    friend class GpuContext;
    std::string base_;
    const bool* unheld_ = nullptr;  // owned by the source
  };
  // The source to sample: plain event timing (batch 1) or CUDA-graph replays of `batch` launches
  // cycling through options.rotate input sets.
  Timed make_source(const GpuLaunch& launch, const TimingOptions& options, int batch);

  // Clears the flush buffer on the stream (evicts the L2).
  void flush_l2() const;

 private:
  int device_index_;
  cudaStream_t stream_ = nullptr;
  void* flush_buffer_ = nullptr;
  std::size_t flush_bytes_ = 0;
  int* hold_flags_ = nullptr;  // host-mapped: [0] release, [1] timed out
  int* hold_flags_device_ = nullptr;
  friend class StreamHold;
  std::unique_ptr<ClockMonitor> monitor_;
};

// Milliseconds between two events recorded around `body` on `stream` (not held).
double time_on_stream_ms(cudaStream_t stream, const std::function<void()>& body);

}  // namespace trainscale::bench
#endif
