// Pieces shared by the norm forward and backward kernels.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/reduce.cuh"
#include "common/vec.cuh"
#include "ops/norm/norm_cuda.h"

namespace trainscale::ops::norm {

enum class Kind { kRms, kLayer };

// Rows whose 16-byte vectors fit this many per row keep the whole row in registers
// (bf16: N <= 32768, fp32: N <= 16384); longer rows take the two-pass kernel.
inline constexpr std::int64_t kMaxRegisterVecs = 4096;
inline constexpr int kTwoPassThreads = 512;

// Threads per row (a power of two) and 16-byte vectors per thread for a row of `vecs`
// vectors: enough vectors per thread to keep several loads in flight, enough threads to
// cover the row. fn(std::integral_constant<int, threads>, std::integral_constant<int, vecs>).
template <class Fn>
void with_register_config(std::int64_t vecs, Fn&& fn) {
  using std::integral_constant;
  if (vecs <= 32) return fn(integral_constant<int, 32>{}, integral_constant<int, 1>{});
  if (vecs <= 64) return fn(integral_constant<int, 32>{}, integral_constant<int, 2>{});
  if (vecs <= 128) return fn(integral_constant<int, 32>{}, integral_constant<int, 4>{});
  if (vecs <= 256) return fn(integral_constant<int, 64>{}, integral_constant<int, 4>{});
  if (vecs <= 512) return fn(integral_constant<int, 128>{}, integral_constant<int, 4>{});
  if (vecs <= 1024) return fn(integral_constant<int, 256>{}, integral_constant<int, 4>{});
  if (vecs <= 2048) return fn(integral_constant<int, 512>{}, integral_constant<int, 4>{});
  return fn(integral_constant<int, 1024>{}, integral_constant<int, 4>{});
}

// Rows of `elem_bytes` elements starting at p with `stride` elements between rows can be
// read with 16-byte vectors.
inline bool rows_vectorizable(const void* p, std::int64_t stride, std::size_t elem_bytes) {
  return p == nullptr ||
         (detail::is_aligned(p, 16) && (stride * static_cast<std::int64_t>(elem_bytes)) % 16 == 0);
}

// Whether the register kernels apply: aligned rows and a row short enough.
inline bool use_registers(NormVariant variant, bool aligned, std::int64_t vecs) {
  if (variant == NormVariant::kTwoPass) return false;
  const bool fits = aligned && vecs <= kMaxRegisterVecs;
  if (variant == NormVariant::kRegisters && !fits) {
    throw Error("trainscale norm: the register variant needs 16-byte aligned rows of at most " +
                std::to_string(kMaxRegisterVecs) + " vectors");
  }
  return fits;
}

inline std::int64_t blocks_for(std::int64_t work_items, std::int64_t per_sm) {
  const auto& info = detail::current_device_info();
  return std::max<std::int64_t>(1, std::min<std::int64_t>(work_items, info.sm_count * per_sm));
}

}  // namespace trainscale::ops::norm
