#include <array>
#include <mutex>

#include "common/cuda_check.h"
#include "core/check.h"

namespace trainscale::detail {

const DeviceInfo& current_device_info() {
  constexpr int kMaxDevices = 64;
  static std::array<DeviceInfo, kMaxDevices> cache{};
  static std::array<std::once_flag, kMaxDevices> once;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "device_info", "cudaGetDevice");
  std::call_once(once[device % kMaxDevices], [device] {
    cudaDeviceProp prop{};
    check_cuda(cudaGetDeviceProperties(&prop, device), "device_info", "cudaGetDeviceProperties");
    DeviceInfo& info = cache[device % kMaxDevices];
    info.device = device;
    info.major = prop.major;
    info.minor = prop.minor;
    info.sm_count = prop.multiProcessorCount;
    info.max_threads_per_sm = prop.maxThreadsPerMultiProcessor;
    info.shared_memory_per_block_optin = prop.sharedMemPerBlockOptin;
    info.l2_bytes = static_cast<std::size_t>(prop.l2CacheSize);
  });
  return cache[device % kMaxDevices];
}

void require_current_device(std::string_view op, Device device) {
  int current = 0;
  check_cuda(cudaGetDevice(&current), op, "cudaGetDevice");
  if (device.index != current) {
    throw_op_error(op, "tensors are on " + device.str() + " but the current CUDA device is cuda:" +
                           std::to_string(current) + " (call cudaSetDevice first)");
  }
}

}  // namespace trainscale::detail
