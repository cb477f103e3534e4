// The split of an SM's unified L1 / shared memory (256 KB on an H100) asked for a kernel.
// Without a preference the driver picks the split, and its pick varies with the process: a
// kernel that re-reads its parameters from L1 then runs at a speed set by whatever else the
// process did; asking makes it independent of that (docs/perf/norm.md).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <mutex>
#include <set>
#include <string_view>
#include <utility>

#include "common/cuda_check.h"

namespace trainscale::detail {

// Asks for the smallest shared-memory configuration holding `blocks_per_sm` blocks of `kernel`
// with `dynamic_smem` bytes each (plus its static shared memory and the per-block reservation);
// the rest of the SM stays L1. The kernel's dynamic shared-memory limit must allow dynamic_smem.
template <class... Params>
void prefer_l1_carveout(void (*kernel)(Params...), int blocks_per_sm, std::size_t dynamic_smem,
                        std::string_view op) {
  int device = 0, per_sm = 0, reserved = 0;
  check_cuda(cudaGetDevice(&device), op, "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device),
             op, "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device), op,
             "cudaDeviceGetAttribute");
  cudaFuncAttributes attributes{};
  check_cuda(cudaFuncGetAttributes(&attributes, kernel), op, "cudaFuncGetAttributes");
  const std::size_t need = static_cast<std::size_t>(blocks_per_sm) *
                           (dynamic_smem + attributes.sharedSizeBytes + static_cast<std::size_t>(reserved));
  // In percent of the SM's shared memory, rounded up (the driver rounds up to a configuration).
  const auto percent = static_cast<int>(std::min<std::size_t>(
      100, (need * 100 + static_cast<std::size_t>(per_sm) - 1) / static_cast<std::size_t>(per_sm)));
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, percent), op,
             "cudaFuncSetAttribute (carveout)");
}

// prefer_l1_carveout for as many blocks of `block` threads as the kernel's occupancy allows, once
// per (device, kernel): the attribute and occupancy calls cost microseconds of host time per
// launch otherwise. A kernel must always be launched with the same `dynamic_smem` here.
template <class... Params>
void prefer_l1_at_full_occupancy(void (*kernel)(Params...), int block, std::size_t dynamic_smem,
                                 std::string_view op) {
  static std::mutex mutex;
  static std::set<std::pair<int, void (*)(Params...)>> done;
  int device = 0;
  check_cuda(cudaGetDevice(&device), op, "cudaGetDevice");
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, kernel);
  if (done.contains(key)) return;  // per launch: a lookup, no allocation
  int blocks = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, block, dynamic_smem), op,
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  prefer_l1_carveout(kernel, std::max(blocks, 1), dynamic_smem, op);
  done.insert(key);  // only once it took: a failure is reported again at the next launch
}

}  // namespace trainscale::detail
