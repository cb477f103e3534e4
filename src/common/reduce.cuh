// Sums across the threads that share a row: lanes of a warp segment, then warps via shared
// memory, then (cluster_row_sum) the blocks of a thread-block cluster that split the row.
// Each call reduces kCount values at once so one barrier serves all of them.
#pragma once

#include <cooperative_groups.h>

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

// Sums across the blocks of a cluster that share a row: every block sends its totals to every
// block, then each adds them in rank order, so all blocks hold bitwise the same totals. Two
// buffers alternate by row: a block writes buffer p for row r only after every block passed the
// barrier of row r - 1, hence finished reading buffer p (used by row r - 2). v holds the block's
// totals in every thread, as row_sum leaves them.
template <int kCluster, int kSums>
__device__ __forceinline__ void cluster_row_sum(float (&v)[kSums],
                                                float (&exchange)[2][kCluster][kSums],
                                                int& parity) {
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const unsigned rank = cluster.block_rank();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int r = 0; r < kCluster; ++r) {
      float* dst = cluster.map_shared_rank(&exchange[parity][rank][0], r);
#pragma unroll
      for (int c = 0; c < kSums; ++c) dst[c] = v[c];
    }
  }
  cluster.sync();
#pragma unroll
  for (int c = 0; c < kSums; ++c) {
    float s = 0.f;
#pragma unroll
    for (int r = 0; r < kCluster; ++r) s += exchange[parity][r][c];
    v[c] = s;
  }
  parity ^= 1;
}

}  // namespace trainscale::detail
