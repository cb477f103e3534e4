// Pieces shared by the norm forward and backward kernels.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/reduce.cuh"
#include "common/vec.cuh"
#include "ops/norm/norm_cuda.h"

namespace trainscale::ops::norm {

enum class Kind { kRms, kLayer };

// Threads per row (a power of two, 32 ... 1024) and 16-byte vectors per thread for a row of
// `vecs` vectors: enough vectors per thread to keep several loads in flight, enough threads to
// cover the row, and few enough values per thread to stay in registers (the forward: 4).
// Returns fn(std::integral_constant<int, threads>, std::integral_constant<int, vecs per thread>).
template <int kVecsPerThread, class Fn>
auto with_register_config(std::int64_t vecs, Fn&& fn) {
  static_assert(kVecsPerThread == 2 || kVecsPerThread == 4);
  using std::integral_constant;
  using Per = integral_constant<int, kVecsPerThread>;
  if (vecs <= 32) return fn(integral_constant<int, 32>{}, integral_constant<int, 1>{});
  if (vecs <= 64) return fn(integral_constant<int, 32>{}, integral_constant<int, 2>{});
  if (vecs <= 32 * kVecsPerThread) return fn(integral_constant<int, 32>{}, Per{});
  if (vecs <= 64 * kVecsPerThread) return fn(integral_constant<int, 64>{}, Per{});
  if (vecs <= 128 * kVecsPerThread) return fn(integral_constant<int, 128>{}, Per{});
  if (vecs <= 256 * kVecsPerThread) return fn(integral_constant<int, 256>{}, Per{});
  if (vecs <= 512 * kVecsPerThread) return fn(integral_constant<int, 512>{}, Per{});
  return fn(integral_constant<int, 1024>{}, Per{});
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

}  // namespace trainscale::ops::norm
