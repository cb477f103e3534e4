// CUDA error handling for host code: every runtime call and every launch is checked and a
// failure becomes a trainscale::Error naming the op.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
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

// Blocks of `kernel` resident per SM at `block` threads (the grid is one full wave).
template <class Kernel>
int resident_blocks_per_sm(Kernel kernel, int block, std::string_view op) {
  int n = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, block, 0), op,
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return std::max(n, 1);
}

struct DeviceInfo {
  int sm_count = 0;
  int max_threads_per_sm = 0;
  std::size_t shared_memory_per_block_optin = 0;
  std::size_t l2_bytes = 0;
};

// Properties of the current device, read once per device.
const DeviceInfo& current_device_info();

}  // namespace trainscale::detail
