// Pieces shared by the norm forward and backward kernels.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "common/cuda_check.h"
#include "common/reduce.cuh"
#include "common/vec.cuh"
#include "ops/norm/norm_cuda.h"
#include "ops/norm/norm_plan.h"

namespace trainscale::ops::norm {

using detail::from_float;
using detail::load_floats;
using detail::load_param;
using detail::row_sum;
using detail::store_floats;
using detail::to_float;

// Rows of `elem_bytes` elements starting at p with `stride` elements between rows can be
// read with 16-byte vectors.
inline bool rows_vectorizable(const void* p, std::int64_t stride, std::size_t elem_bytes) {
  return p == nullptr ||
         (detail::is_aligned(p, 16) && (stride * static_cast<std::int64_t>(elem_bytes)) % 16 == 0);
}

// The factor a normalized element is multiplied by: weight (+ offset for RMSNorm; an absent
// weight counts as ones). Args: the kernel's argument struct.
template <class T, Kind kKind, class Args>
__device__ __forceinline__ float load_scale(const Args& a, std::int64_t col) {
  const float w = a.weight ? detail::load_param<T>(a.weight, a.weight_f32, col) : 1.f;
  return kKind == Kind::kRms ? w + a.weight_offset : w;
}

inline std::int64_t blocks_for(std::int64_t work_items, std::int64_t per_sm) {
  const auto& info = detail::current_device_info();
  return std::max<std::int64_t>(1, std::min<std::int64_t>(work_items, info.sm_count * per_sm));
}

// A persistent grid of at most one resident wave whose blocks all loop the same number of times
// (but the last): with the full wave, 32768 rows of 2 per group over 528 blocks take 32 passes
// of which the last has 32 of 1056 rows; 512 blocks take 32 full passes. It measured no faster
// (the tail is not the limit) but costs nothing.
inline std::int64_t balanced_blocks_for(std::int64_t work_items, std::int64_t per_sm) {
  const std::int64_t wave = blocks_for(work_items, per_sm);
  const std::int64_t passes = (work_items + wave - 1) / wave;
  return std::max<std::int64_t>(1, (work_items + passes - 1) / passes);
}

}  // namespace trainscale::ops::norm
