// 16-byte vector access: the widest load a thread can issue, and what keeps HBM saturated.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/dtype.cuh"

namespace trainscale::detail {

template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <class T>
inline constexpr int kVec16 = 16 / static_cast<int>(sizeof(T));

// N consecutive elements as raw storage: 16-byte loads when the vector is a multiple of 16
// bytes (p then 16-byte aligned), element loads otherwise. kStreaming: data read once
// (activations), a plain coherent load, which streams faster than ld.global.cs or ld.global.nc
// (docs/perf/README.md); otherwise the read-only cached path (weights re-read by many rows).
template <class T, int N, bool kStreaming = true>
__device__ __forceinline__ Vec<T, N> load_raw(const T* p) {
  Vec<T, N> out;
  if constexpr (sizeof(Vec<T, N>) % 16 == 0) {
    constexpr int kChunks = static_cast<int>(sizeof(Vec<T, N>) / 16);
    uint4 raw[kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const uint4* src = reinterpret_cast<const uint4*>(p) + c;
      raw[c] = kStreaming ? *src : __ldg(src);
    }
    memcpy(&out, raw, sizeof(out));
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) out.v[j] = p[j];
  }
  return out;
}

template <class T, int N>
__device__ __forceinline__ void store_raw(T* p, const Vec<T, N>& v) {
  if constexpr (sizeof(Vec<T, N>) % 16 == 0) {
#pragma unroll
    for (int c = 0; c < static_cast<int>(sizeof(Vec<T, N>) / 16); ++c) {
      reinterpret_cast<uint4*>(p)[c] = reinterpret_cast<const uint4*>(&v)[c];
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) p[j] = v.v[j];
  }
}

inline bool is_aligned(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

// Whether every row of `rows` rows starts `bytes`-aligned (a vector path of that width): the
// base is, and so is the row stride when there is more than one row.
inline bool rows_aligned(const void* data, std::int64_t rows, std::int64_t row_stride_bytes, std::size_t bytes) {
  return is_aligned(data, bytes) && (rows <= 1 || row_stride_bytes % static_cast<std::int64_t>(bytes) == 0);
}

inline bool rows_16_byte_aligned(const void* data, std::int64_t rows, std::int64_t row_stride_bytes) {
  return rows_aligned(data, rows, row_stride_bytes, 16);
}

}  // namespace trainscale::detail


namespace trainscale::detail {

template <class T, int N>
__device__ __forceinline__ void to_floats(const Vec<T, N>& v, float (&out)[N]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0) {
    // A bf16 is a float's high half: one shift or mask per element from the packed pair,
    // where __bfloat162float took a byte permute and a shift for every high half.
#pragma unroll
    for (int j = 0; j < N; j += 2) {
      std::uint32_t pair;
      memcpy(&pair, &v.v[j], sizeof(pair));
      out[j] = __uint_as_float(pair << 16);
      out[j + 1] = __uint_as_float(pair & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = to_float(v.v[j]);
  }
}

template <class T, int N, bool kStreaming = true>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[N]) {
  to_floats(load_raw<T, N, kStreaming>(p), out);
}

template <class T, int N>
__device__ __forceinline__ void store_floats(T* p, const float (&in)[N]) {
  Vec<T, N> v;
#pragma unroll
  for (int j = 0; j < N; ++j) v.v[j] = from_float<T>(in[j]);
  store_raw(p, v);
}

}  // namespace trainscale::detail
