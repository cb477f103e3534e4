// CUDA error handling for host code: every runtime call and every launch is checked and a
// failure becomes a trainscale::Error naming the op.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "trainscale/error.h"

namespace trainscale::detail {

inline void check_cuda(cudaError_t status, std::string_view op, std::string_view what) {
  if (status != cudaSuccess) {
    std::string msg = "trainscale::";
    msg.append(op).append(": ").append(what).append(" failed: ").append(cudaGetErrorString(status));
    throw Error(msg);
  }
}

// After a launch: configuration errors surface here, asynchronous faults at the next sync.
inline void check_launch(std::string_view op) { check_cuda(cudaGetLastError(), op, "kernel launch"); }

// One block per tile of `per_block` work items, capped only by the launch limit: streaming
// kernels reach more of HBM with a grid as large as the work than with one resident wave looping
// over it (docs/perf/README.md). Kernels still loop, so any grid covers everything.
inline std::int64_t grid_for_tiles(std::int64_t items, std::int64_t per_block) {
  const std::int64_t tiles = (items + per_block - 1) / per_block;
  return std::clamp<std::int64_t>(tiles, 1, std::numeric_limits<int>::max());
}

struct DeviceInfo {
  int device = 0;
  int major = 0, minor = 0;  // compute capability
  int sm_count = 0;
  int max_threads_per_sm = 0;
  std::size_t shared_memory_per_block_optin = 0;
  std::size_t l2_bytes = 0;
};

// Properties of the current device, read once per device.
const DeviceInfo& current_device_info();

}  // namespace trainscale::detail
