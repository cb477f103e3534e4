// 16-byte vector access: the widest load a thread can issue, and what keeps HBM saturated.
#pragma once

#include <cstdint>

#include "common/dtype.cuh"

namespace trainscale::detail {

template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <class T>
inline constexpr int kVec16 = 16 / static_cast<int>(sizeof(T));

// Read-only, not kept in L1: data touched once.
template <class T, int N>
__device__ __forceinline__ Vec<T, N> load_vec_stream(const T* p) {
  static_assert(sizeof(Vec<T, N>) == 16 || N == 1);
  Vec<T, N> out;
  if constexpr (sizeof(Vec<T, N>) == 16) {
    const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(p));
    out = *reinterpret_cast<const Vec<T, N>*>(&raw);
  } else {
    out.v[0] = *p;
  }
  return out;
}

// Read-only through the non-coherent path and kept (weights re-read by many rows).
template <class T, int N>
__device__ __forceinline__ Vec<T, N> load_vec_cached(const T* p) {
  Vec<T, N> out;
  if constexpr (sizeof(Vec<T, N>) == 16) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
    out = *reinterpret_cast<const Vec<T, N>*>(&raw);
  } else {
    out.v[0] = *p;
  }
  return out;
}

template <class T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  if constexpr (sizeof(Vec<T, N>) == 16) {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&v);
  } else {
    *p = v.v[0];
  }
}

inline bool is_aligned(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

}  // namespace trainscale::detail


namespace trainscale::detail {

// N consecutive elements of T as floats; p is 16-byte aligned whenever N * sizeof(T) is a
// multiple of 16 (the vector path), otherwise elements are read one by one.
template <class T, int N>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[N]) {
  if constexpr (N * sizeof(T) % 16 == 0) {
    constexpr int kPer = kVec16<T>;
#pragma unroll
    for (int c = 0; c < N / kPer; ++c) {
      const Vec<T, kPer> v = load_vec_stream<T, kPer>(p + c * kPer);
#pragma unroll
      for (int j = 0; j < kPer; ++j) out[c * kPer + j] = to_float(v.v[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = to_float(p[j]);
  }
}

template <class T, int N>
__device__ __forceinline__ void store_floats(T* p, const float (&in)[N]) {
  if constexpr (N * sizeof(T) % 16 == 0) {
    constexpr int kPer = kVec16<T>;
#pragma unroll
    for (int c = 0; c < N / kPer; ++c) {
      Vec<T, kPer> v;
#pragma unroll
      for (int j = 0; j < kPer; ++j) v.v[j] = from_float<T>(in[c * kPer + j]);
      store_vec<T, kPer>(p + c * kPer, v);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) p[j] = from_float<T>(in[j]);
  }
}

}  // namespace trainscale::detail
