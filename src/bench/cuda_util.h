// CUDA error checks and device buffers for the engine (only in TRAINSCALE_HAVE_CUDA builds).
#pragma once

#if TRAINSCALE_HAVE_CUDA
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "trainscale/error.h"

namespace trainscale::bench {

inline void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(std::string("trainscale-bench: ") + what + ": " + cudaGetErrorString(status));
  }
}

// Device memory owned for the life of the object (none for 0 bytes); `what` names it in errors.
struct DeviceBuffer {
  void* data = nullptr;
  DeviceBuffer(std::int64_t bytes, const char* what) {
    if (bytes > 0) cuda_check(cudaMalloc(&data, static_cast<std::size_t>(bytes)), what);
  }
  ~DeviceBuffer() { cudaFree(data); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// Number of visible CUDA devices; 0 when the driver or a device is missing.
inline int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return count;
}

}  // namespace trainscale::bench
#endif
