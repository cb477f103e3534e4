// Thread-block clusters from the host: whether a configuration fits the device, and its launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string_view>
#include <tuple>
#include <utility>

#include "common/cuda_check.h"

namespace trainscale::detail {

// A launch configuration of `grid` 1-D blocks of `block` threads with `smem` bytes of dynamic
// shared memory and one launch attribute (`attribute`, which must outlive the configuration;
// none when `with_attribute` is false).
inline cudaLaunchConfig_t launch_config(std::int64_t grid, int block, std::size_t smem, cudaStream_t stream,
                                        cudaLaunchAttribute& attribute, bool with_attribute) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(grid));
  config.blockDim = dim3(static_cast<unsigned>(block));
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = with_attribute ? 1 : 0;
  return config;
}

// A launch configuration of `grid` blocks (a multiple of `cluster`) in clusters of `cluster`
// along x (no cluster attribute when `cluster` is 1: a plain launch); `attribute` must outlive
// the configuration.
inline cudaLaunchConfig_t cluster_config(std::int64_t grid, int block, int cluster,
                                         std::size_t smem, cudaStream_t stream,
                                         cudaLaunchAttribute& attribute) {
  attribute = {};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = static_cast<unsigned>(cluster);
  attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
  return launch_config(grid, block, smem, stream, attribute, cluster > 1);
}

// The largest portable cluster; larger ones need cudaFuncAttributeNonPortableClusterSizeAllowed.
inline constexpr int kPortableClusterSize = 8;

// Raises `kernel`'s dynamic shared-memory limit on the current device to at least `smem` (the
// default 48 KiB also counts the kernel's static shared memory). The limit only grows: callers
// cache what fits per configuration, so a launch that needs more must not be undone by a later
// one that needs less.
template <class... Params>
void allow_dynamic_smem(void (*kernel)(Params...), std::size_t smem, std::string_view op) {
  if (smem == 0) return;
  static std::mutex mutex;
  static std::map<std::pair<int, void (*)(Params...)>, std::size_t> raised;
  int device = 0;
  check_cuda(cudaGetDevice(&device), op, "cudaGetDevice");
  const std::lock_guard<std::mutex> lock(mutex);
  std::size_t& limit = raised[{device, kernel}];
  if (smem <= limit) return;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem)),
             op, "cudaFuncSetAttribute (dynamic shared memory)");
  limit = smem;
}

// Blocks of `block` threads with `smem` bytes of dynamic shared memory of `kernel` resident at
// once on the whole current device (0: none fits); raises the kernel's dynamic shared-memory
// limit to `smem`. Asked once per device and configuration.
template <class... Params>
int max_resident_blocks(void (*kernel)(Params...), int block, std::size_t smem, std::string_view op) {
  using Key = std::tuple<int, void (*)(Params...), int, std::size_t>;
  static std::mutex mutex;
  static std::map<Key, int> cache;
  int device = 0;
  check_cuda(cudaGetDevice(&device), op, "cudaGetDevice");
  const Key key{device, kernel, block, smem};
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = cache.find(key); it != cache.end()) return it->second;
  allow_dynamic_smem(kernel, smem, op);
  int per_sm = 0, sms = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block, smem), op,
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), op,
             "cudaDeviceGetAttribute");
  cache.emplace(key, per_sm * sms);
  return per_sm * sms;
}

// Clusters of `cluster` blocks of `kernel` resident at once on the current device (0: the
// configuration does not fit it; sizes beyond the portable 8 are asked for, and a device or
// driver that refuses them counts as fitting none). Asked once per device and configuration:
// the occupancy query costs microseconds of host time per launch otherwise. Raises the
// kernel's dynamic shared-memory limit to `smem`.
template <class... Params>
int max_active_clusters(void (*kernel)(Params...), int block, int cluster, std::size_t smem,
                        std::string_view op) {
  using Key = std::tuple<int, void (*)(Params...), int, int, std::size_t>;
  static std::mutex mutex;
  static std::map<Key, int> cache;
  int device = 0;
  check_cuda(cudaGetDevice(&device), op, "cudaGetDevice");
  const Key key{device, kernel, block, cluster, smem};
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = cache.find(key); it != cache.end()) return it->second;
  allow_dynamic_smem(kernel, smem, op);
  int count = 0;
  const bool non_portable = cluster > kPortableClusterSize;
  if (non_portable && cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed,
                                           1) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; a later launch check must not see it
  } else {
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config =
        cluster_config(cluster, block, cluster, smem, nullptr, attribute);
    const cudaError_t status = cudaOccupancyMaxActiveClusters(&count, kernel, &config);
    if (non_portable && status != cudaSuccess) {
      (void)cudaGetLastError();
      count = 0;
    } else {
      check_cuda(status, op, "cudaOccupancyMaxActiveClusters");
    }
  }
  cache.emplace(key, count);
  return count;
}

// Launches `kernel` on `grid` blocks (a multiple of `cluster`) in clusters of `cluster`.
template <class... Params, class... Args>
void launch_in_clusters(void (*kernel)(Params...), std::int64_t grid, int block, int cluster,
                        std::size_t smem, cudaStream_t stream, std::string_view op,
                        Args&&... args) {
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = cluster_config(grid, block, cluster, smem, stream, attribute);
  check_cuda(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), op,
             "cudaLaunchKernelEx");
}

// Whether the current device runs cooperative launches (grid-wide barriers); asked once per
// device.
inline bool cooperative_launch_supported(std::string_view op) {
  static std::mutex mutex;
  static std::map<int, bool> cache;
  int device = 0;
  check_cuda(cudaGetDevice(&device), op, "cudaGetDevice");
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = cache.find(device); it != cache.end()) return it->second;
  int supported = 0;
  check_cuda(cudaDeviceGetAttribute(&supported, cudaDevAttrCooperativeLaunch, device), op,
             "cudaDeviceGetAttribute");
  cache.emplace(device, supported != 0);
  return supported != 0;
}

// Launches `kernel` on `grid` blocks that must all be resident at once (a cooperative launch:
// its blocks may wait on each other, grid_barrier() in grid_reduce.cuh). Returns false,
// launching nothing and leaving no error behind, where the device cannot hold the grid at once
// (cudaErrorCooperativeLaunchTooLarge: fewer SMs than the occupancy query assumed, as under
// MPS); other errors throw.
template <class... Params, class... Args>
bool launch_cooperative(void (*kernel)(Params...), std::int64_t grid, int block, std::size_t smem,
                        cudaStream_t stream, std::string_view op, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeCooperative;
  attribute.val.cooperative = 1;
  const cudaLaunchConfig_t config = launch_config(grid, block, smem, stream, attribute, true);
  const cudaError_t status = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (status == cudaErrorCooperativeLaunchTooLarge) {
    (void)cudaGetLastError();  // not sticky
    return false;
  }
  check_cuda(status, op, "cudaLaunchKernelEx (cooperative)");
  return true;
}

}  // namespace trainscale::detail
