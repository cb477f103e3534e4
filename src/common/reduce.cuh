// Sums across the threads that share a row: lanes of a warp segment, then warps via shared
// memory. Each call reduces kCount values at once so one barrier serves all of them.
#pragma once

namespace trainscale::detail {

// Sum over groups of kWidth consecutive lanes (kWidth a power of two <= 32).
template <int kWidth, int kCount>
__device__ __forceinline__ void warp_segment_sum(float (&v)[kCount]) {
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int c = 0; c < kCount; ++c) v[c] += __shfl_xor_sync(0xffffffffu, v[c], offset);
  }
}

// Sum over kThreads consecutive threads (a power of two); when kThreads > 32 they are whole
// warps and `scratch` holds kThreads / 32 * kCount floats. Every participating thread gets
// the total. Callers that loop must not reuse `scratch` before all threads have read it: the
// leading barrier of the next call takes care of that.
template <int kThreads, int kCount>
__device__ __forceinline__ void row_sum(float (&v)[kCount], float* scratch) {
  warp_segment_sum<(kThreads < 32 ? kThreads : 32), kCount>(v);
  if constexpr (kThreads > 32) {
    constexpr int kWarps = kThreads / 32;
    const int lane = threadIdx.x % 32;
    const int warp = (threadIdx.x % kThreads) / 32;
    float* row_scratch = scratch + (threadIdx.x / kThreads) * kWarps * kCount;
    __syncthreads();
    if (lane == 0) {
#pragma unroll
      for (int c = 0; c < kCount; ++c) row_scratch[warp * kCount + c] = v[c];
    }
    __syncthreads();
    // Every warp sums the partials with shuffles: kCount shared loads per thread, where a
    // serial sum issued all kWarps * kCount of them at once (96 registers at 1024 threads).
    // The butterfly gives every lane the same bits (each step adds the same pair).
#pragma unroll
    for (int c = 0; c < kCount; ++c) v[c] = row_scratch[(lane % kWarps) * kCount + c];
    warp_segment_sum<kWarps, kCount>(v);
  }
}

}  // namespace trainscale::detail
