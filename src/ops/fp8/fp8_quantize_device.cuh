// Device pieces of the fp8 quantize kernels (fp8_quantize*.cu). The arithmetic is fixed by
// include/trainscale/fp8.h and matched bit for bit: amax over |x| as float, r = amax / fmax as an
// IEEE float32 division (__fdiv_rn; the library is built without fast math, so no flush to
// zero), q = x / s as the same division's result, computed per element without dividing (fp8_quotient.h:
// RN(1/s) once per group, then a multiply and two FMAs; groups whose scale is out of that range
// divide), and the saturating round-to-nearest-even fp8 cast (cvt.rn.satfinite.{e4m3,e5m2}x2.f32).
//
// amax is taken as the unsigned maximum of the bit patterns of |x|: for non-negative floats the
// integer order is the numeric order, and every NaN (sign cleared) compares above +Inf, so a NaN
// in a group wins whatever the order, as the contract requires. The same property makes a
// cross-block amax an atomicMax on those bits.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "common/vec.cuh"
#include "ops/fp8/fp8_quantize.h"
#include "ops/fp8/fp8_quotient.h"

namespace trainscale::ops::fp8 {
namespace {

using detail::to_float;

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// The contract's scale for an amax given by its bit pattern (NaN and Inf included).
__device__ __forceinline__ float scale_from_amax(unsigned amax_bits, float fmax, bool pow2) {
  const float r = __fdiv_rn(__uint_as_float(amax_bits), fmax);
  if (r == 0.0f) return 1.0f;  // amax == 0, or r underflowed
  const unsigned b = __float_as_uint(r);
  if (!pow2 || b >= 0x7f800000u) return r;  // r >= 0 here: Inf and NaN have bits >= 0x7f800000
  const unsigned exponent = b >> 23, mantissa = b & 0x7fffffu;
  if (exponent != 0) {
    // The next power of two above a normal r; r < 2^120 since amax <= FLT_MAX and fmax >= 448,
    // so exponent + 1 never reaches the Inf exponent.
    return mantissa == 0 ? r : __uint_as_float((exponent + 1) << 23);
  }
  // Subnormal r = mantissa * 2^-149: the next power of two of the integer mantissa (2^23 is the
  // smallest normal, 2^-126).
  return (mantissa & (mantissa - 1)) == 0 ? r : __uint_as_float(1u << (32 - __clz(mantissa)));
}

// A group's scale s with r = RN(1/s) where the division-free quotient is exact for s, else 0.
struct GroupScale {
  float s, r;
};

__device__ __forceinline__ GroupScale group_scale(float s) {
  return {s, reciprocal_quotient_is_exact(s) ? nearest_reciprocal(s) : 0.0f};
}

// Scales of kGroups groups whose amax bits every lane of a kLanes-lane group (aligned within the
// warp) holds: lane l computes group l % kGroups and the others take it by shuffle, so a group
// costs one division and one reciprocal per lane group, not per lane. `own` gets lane l's group's
// scale (to store it).
template <int kLanes, int kGroups>
__device__ __forceinline__ void lane_group_scales(const unsigned (&amax)[kGroups], float fmax,
                                                  bool pow2, GroupScale (&g)[kGroups], float& own) {
  static_assert(kGroups <= kLanes && 32 % kLanes == 0);
  const int lane = threadIdx.x & (kLanes - 1);
  unsigned mine = amax[0];
#pragma unroll
  for (int k = 1; k < kGroups; ++k) mine = lane % kGroups == k ? amax[k] : mine;
  own = scale_from_amax(mine, fmax, pow2);
  const GroupScale computed = group_scale(own);
  if constexpr (kGroups == 1) {
    g[0] = computed;
  } else {
    const int first = threadIdx.x & 31 & ~(kLanes - 1);
#pragma unroll
    for (int k = 0; k < kGroups; ++k) {
      g[k].s = __shfl_sync(kFullMask, computed.s, first | k);
      g[k].r = __shfl_sync(kFullMask, computed.r, first | k);
    }
  }
}

template <bool kE4M3>
__device__ __forceinline__ unsigned encode2(float a, float b) {
  // x.x lands in the low byte.
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kE4M3 ? __NV_E4M3 : __NV_E5M2);
}

// Codes of 8 values of one group, value k in byte k: the float32 quotient, then the cast.
template <bool kE4M3>
__device__ __forceinline__ uint2 quantize8(const float (&v)[8], GroupScale g) {
  float q[8];
  if (g.r != 0.0f) {
#pragma unroll
    for (int k = 0; k < 8; ++k) q[k] = reciprocal_quotient(v[k], g.s, g.r);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) q[k] = __fdiv_rn(v[k], g.s);
  }
  unsigned w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = encode2<kE4M3>(q[2 * k], q[2 * k + 1]);
  return make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
}

// 8 consecutive elements kept as the loaded words (one uint4 for 16-bit T, two for float): 4 or 8
// registers per chunk instead of one per element, unpacked only where used. Zero-initialized
// is +0 for every T.
template <class T>
struct Chunk {
  uint4 w[sizeof(T) / 2];
};

template <class T>
__device__ __forceinline__ float chunk_value(const Chunk<T>& c, int k) {
  constexpr int kPerWord = 4 / static_cast<int>(sizeof(T));
  const int j = k / kPerWord;  // 32-bit word j of the chunk
  const uint4& w = c.w[j / 4];
  const unsigned word = (j & 2) ? ((j & 1) ? w.w : w.z) : ((j & 1) ? w.y : w.x);
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(word);
  } else {
    const unsigned short bits = static_cast<unsigned short>(word >> (16 * (k & 1)));
    T t;
    memcpy(&t, &bits, sizeof(t));
    return to_float(t);
  }
}

template <class T>
__device__ __forceinline__ void chunk_floats(const Chunk<T>& c, float (&v)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = chunk_value(c, k);
}

// A complete, 16-byte aligned chunk.
template <class T>
__device__ __forceinline__ Chunk<T> load_chunk_vec(const T* p) {
  Chunk<T> c;
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(T) / 2); ++i) c.w[i] = reinterpret_cast<const uint4*>(p)[i];
  return c;
}

// Elements [col, col + 8) of a row (those at or past `cols` read as 0): vector loads when the row
// is vector-aligned and the chunk complete, element loads otherwise. The kernels call this only
// on their edge path: a branch per chunk keeps the compiler from issuing the next chunk's load
// before this one's data is used (one load in flight per thread), so interior tiles take
// load_chunk_vec for all their chunks back to back.
template <class T>
__device__ __forceinline__ Chunk<T> load_chunk(const T* row, std::int64_t col, std::int64_t cols,
                                               bool vec_ok) {
  if (vec_ok && col + 8 <= cols) return load_chunk_vec(row + col);
  T v[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = col + k < cols ? row[col + k] : detail::from_float<T>(0.0f);
  Chunk<T> c;
  memcpy(&c, v, sizeof(c));
  return c;
}

// 8 codes to p = row + col; only those before `cols`.
__device__ __forceinline__ void store_codes8(std::uint8_t* p, uint2 c, std::int64_t col,
                                             std::int64_t cols, bool vec_ok) {
  if (vec_ok && col + 8 <= cols) {
    *reinterpret_cast<uint2*>(p) = c;
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    if (col + k < cols) p[k] = static_cast<std::uint8_t>((k < 4 ? c.x : c.y) >> (8 * (k & 3)));
  }
}

// 16 codes to p = row + col; only those before `cols`. vec16 / vec8: rows aligned for 16- / 8-byte
// stores.
__device__ __forceinline__ void store_codes16(std::uint8_t* p, uint4 c, std::int64_t col,
                                              std::int64_t cols, bool vec8, bool vec16) {
  if (col + 16 <= cols && vec16) {
    *reinterpret_cast<uint4*>(p) = c;
    return;
  }
  if (col + 16 <= cols && vec8) {
    reinterpret_cast<uint2*>(p)[0] = make_uint2(c.x, c.y);
    reinterpret_cast<uint2*>(p)[1] = make_uint2(c.z, c.w);
    return;
  }
  const unsigned w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    if (col + k < cols) p[k] = static_cast<std::uint8_t>(w[k / 4] >> (8 * (k & 3)));
  }
}

// Codes of two consecutive chunks of one group: 16 bytes, value k in byte k.
template <bool kE4M3, class T>
__device__ __forceinline__ uint4 quantize16(const Chunk<T> (&c)[2], GroupScale g) {
  float v[8];
  chunk_floats(c[0], v);
  const uint2 lo = quantize8<kE4M3>(v, g);
  chunk_floats(c[1], v);
  const uint2 hi = quantize8<kE4M3>(v, g);
  return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

// fn(TypeTag<T>, std::bool_constant<e4m3>) for x's dtype and the code format.
template <class Fn>
void with_quantize_types(DType dtype, bool e4m3, const char* op, Fn&& fn) {
  detail::dispatch_activation_dtype(dtype, op, [&](auto tag) {
    if (e4m3) {
      fn(tag, std::true_type{});
    } else {
      fn(tag, std::false_type{});
    }
  });
}

}  // namespace
}  // namespace trainscale::ops::fp8
