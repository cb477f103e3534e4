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

namespace trainscale::ops::norm {

enum class Kind { kRms, kLayer };

// Threads per row (a power of two, 1 ... kMaxThreads) and 16-byte vectors per thread for a row
// of `vecs` vectors (at most kMaxThreads * kVecsPerThread): kVecsPerThread vectors per thread,
// so that each thread keeps that many loads in flight, and as few threads as cover the row.
// Short rows share a warp (kThreads < 32): with one vector per thread, LayerNorm at bf16 N =
// 256 was bound by the latency of a row's load and its shuffle chain. Rows of at most 4
// vectors take one thread per vector: a block then covers 256 / kThreads rows, and 131072 rows
// of 8 bf16 fit in one wave (4 threads per row took four; one thread holding 2-4 vectors was
// slower than a thread per vector, its loads striding the row). Returns
// fn(std::integral_constant<int, threads>, std::integral_constant<int, vecs per thread>).
template <int kVecsPerThread, int kMaxThreads = 1024, int kThreads = 1, class Fn>
auto with_register_config(std::int64_t vecs, Fn&& fn) {
  static_assert(kVecsPerThread == 1 || kVecsPerThread == 2 || kVecsPerThread == 4);
  constexpr int kPerThread = kThreads < 4 ? 1 : kVecsPerThread;
  using Per = std::integral_constant<int, kPerThread>;
  if constexpr (kThreads == kMaxThreads) {
    return fn(std::integral_constant<int, kThreads>{}, Per{});
  } else {
    if (vecs <= kThreads * kPerThread) return fn(std::integral_constant<int, kThreads>{}, Per{});
    return with_register_config<kVecsPerThread, kMaxThreads, kThreads * 2>(vecs,
                                                                           std::forward<Fn>(fn));
  }
}

// Longest row (in 16-byte vectors) the register kernels take; longer rows use two passes.
template <int kVecsPerThread>
inline constexpr std::int64_t kMaxRegisterVecs = 1024 * kVecsPerThread;
inline constexpr int kForwardVecsPerThread = 4;
inline constexpr int kTwoPassThreads = 512;

// Rows of `elem_bytes` elements starting at p with `stride` elements between rows can be
// read with 16-byte vectors.
inline bool rows_vectorizable(const void* p, std::int64_t stride, std::size_t elem_bytes) {
  return p == nullptr ||
         (detail::is_aligned(p, 16) && (stride * static_cast<std::int64_t>(elem_bytes)) % 16 == 0);
}

inline const char* variant_name(NormVariant variant) {
  switch (variant) {
    case NormVariant::kAuto: return "auto";
    case NormVariant::kRegisters: return "register";
    case NormVariant::kTwoPass: return "two-pass";
    case NormVariant::kRows: return "rows";
    case NormVariant::kPipelined: return "pipelined";
  }
  return "unknown";
}

// Whether the whole-row register kernels apply: aligned rows and a row short enough. Forcing
// one (kRegisters, kRows, kPipelined) where it does not apply throws.
inline bool use_registers(NormVariant variant, bool aligned, std::int64_t vecs,
                          std::int64_t max_vecs) {
  if (variant == NormVariant::kTwoPass) return false;
  const bool fits = aligned && vecs <= max_vecs;
  if (variant != NormVariant::kAuto && !fits) {
    throw UnsupportedVariantError(std::string("trainscale norm: the ") + variant_name(variant) +
                                  " variant needs 16-byte aligned rows of at most " +
                                  std::to_string(max_vecs) + " vectors");
  }
  return fits;
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
