// Reductions across the threads that share a row: lanes of a warp segment, then warps via
// shared memory, then (ClusterRowReduce) the blocks of a thread-block cluster that split the
// row. Each call reduces kCount values at once so one barrier serves all of them. Every
// combine is commutative bit for bit, and the butterflies pair values in a fixed pattern, so
// every participating thread ends with the same bits, run after run.
#pragma once

#include <cooperative_groups.h>
#include <cuda/ptx>

#include <cstdint>
#include <type_traits>

namespace trainscale::detail {

// Elementwise sums (float, or double where a long sum needs it).
struct SumOp {
  template <class F, int kCount>
  static __device__ __forceinline__ void combine(F (&a)[kCount], const F (&b)[kCount]) {
#pragma unroll
    for (int c = 0; c < kCount; ++c) a[c] += b[c];
  }
};

// Elementwise maxima; NaN is skipped as fmaxf does (a row's NaN reaches its output elsewhere).
struct MaxOp {
  template <class F, int kCount>
  static __device__ __forceinline__ void combine(F (&a)[kCount], const F (&b)[kCount]) {
#pragma unroll
    for (int c = 0; c < kCount; ++c) a[c] = fmax(a[c], b[c]);
  }
};

// Elementwise maxima of unsigned words: fp8's amax, taken over the bit patterns of |x| so that a
// NaN wins (ops/fp8/fp8_quantize_device.cuh). A whole warp's maximum is one redux.sync.
struct BitsMaxOp {
  template <class F, int kCount>
  static __device__ __forceinline__ void combine(F (&a)[kCount], const F (&b)[kCount]) {
    static_assert(std::is_same_v<F, unsigned>);
#pragma unroll
    for (int c = 0; c < kCount; ++c) a[c] = max(a[c], b[c]);
  }
  static __device__ __forceinline__ unsigned warp(unsigned v) { return __reduce_max_sync(0xffffffffu, v); }
};

inline constexpr float kLog2e = 1.4426950408889634f;

// 2^x in one MUFU instruction (relative error 2^-22; results under 2^-126 flush to 0), where
// exp2f adds a denormal range fix-up: the row kernels take one or two per element.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// exp(x - m), the difference taken first: exact for nearby x and m, where x log2e - m log2e
// loses |m| log2e ulps.
__device__ __forceinline__ float exp_minus(float x, float m) { return exp2_approx((x - m) * kLog2e); }

// exp(m_part - m) for a partial maximum m_part <= m: 1 when equal, so a part of only -inf
// (sum 0) or of +inf (sum NaN) merges without forming inf - inf.
__device__ __forceinline__ float online_rescale(float m_part, float m) {
  return m_part == m ? 1.f : exp_minus(m_part, m);
}

// Online-softmax statistics: v[0] a running maximum m, v[1] a sum of exp(x - m) over the same
// elements, v[2..] plain sums carried along (cross-entropy's sum of logits and target logit).
// The merged sum is s_a e^(m_a - m) + s_b e^(m_b - m) rounded in that order without an FMA,
// so merging a into b gives the bits of merging b into a.
struct OnlineSoftmaxOp {
  template <class F, int kCount>
  static __device__ __forceinline__ void combine(F (&a)[kCount], const F (&b)[kCount]) {
    static_assert(kCount >= 2 && std::is_same_v<F, float>);
    const float m = fmaxf(a[0], b[0]);
    a[1] = __fadd_rn(__fmul_rn(a[1], online_rescale(a[0], m)),
                     __fmul_rn(b[1], online_rescale(b[0], m)));
    a[0] = m;
#pragma unroll
    for (int c = 2; c < kCount; ++c) a[c] += b[c];
  }
};

// Combines over groups of kWidth consecutive lanes (kWidth a power of two <= 32); a whole warp
// in one instruction per value where Op has one (Op::warp).
template <int kWidth, class Op, class F, int kCount>
__device__ __forceinline__ void warp_segment_reduce(F (&v)[kCount]) {
  if constexpr (kWidth == 32 && requires(F x) { Op::warp(x); }) {
#pragma unroll
    for (int c = 0; c < kCount; ++c) v[c] = Op::warp(v[c]);
  } else {
#pragma unroll
    for (int offset = kWidth / 2; offset > 0; offset /= 2) {
      F other[kCount];
#pragma unroll
      for (int c = 0; c < kCount; ++c) other[c] = __shfl_xor_sync(0xffffffffu, v[c], offset);
      Op::combine(v, other);
    }
  }
}

// Combines over kThreads consecutive threads (a power of two); when kThreads > 32 they are
// whole warps and `scratch` holds kThreads / 32 * kCount values. Every participating thread
// gets the result. Callers that loop must not reuse `scratch` before all threads have read
// it: the leading barrier of the next call takes care of that, or, without it
// (kLeadingBarrier false), scratch alternating between two buffers call by call (a thread
// writes buffer p for call k + 2 only after every thread passed call k + 1's barrier, hence
// finished reading buffer p for call k).
template <int kThreads, class Op, bool kLeadingBarrier = true, class F, int kCount>
__device__ __forceinline__ void row_reduce(F (&v)[kCount], F* scratch) {
  warp_segment_reduce<(kThreads < 32 ? kThreads : 32), Op>(v);
  if constexpr (kThreads > 32) {
    constexpr int kWarps = kThreads / 32;
    const int lane = threadIdx.x % 32;
    const int warp = (threadIdx.x % kThreads) / 32;
    F* row_scratch = scratch + (threadIdx.x / kThreads) * kWarps * kCount;
    if constexpr (kLeadingBarrier) __syncthreads();
    if (lane == 0) {
#pragma unroll
      for (int c = 0; c < kCount; ++c) row_scratch[warp * kCount + c] = v[c];
    }
    __syncthreads();
    // Every warp combines the partials with shuffles: kCount shared loads per thread, where a
    // serial loop issued all kWarps * kCount of them at once (96 registers at 1024 threads).
#pragma unroll
    for (int c = 0; c < kCount; ++c) v[c] = row_scratch[(lane % kWarps) * kCount + c];
    warp_segment_reduce<kWarps, Op>(v);
  }
}

template <int kThreads, int kCount>
__device__ __forceinline__ void row_sum(float (&v)[kCount], float* scratch) {
  row_reduce<kThreads, SumOp>(v, scratch);
}

// Combines across the blocks of a cluster that share a row, without a cluster barrier per row:
// each block sends its totals by st.async into a slot of every block's shared memory, which
// completes that block's mbarrier once all kCluster slots have landed. (A cluster.sync() per
// row would be a cluster-scope release and acquire: it waits for the thread's outstanding
// global stores and invalidates L1, dropping lines a kernel prefetched or keeps there, like a
// weight read through L1; the mbarrier wait is CTA-scoped.) Lane l of each warp then takes the
// totals of rank l % kCluster and the lanes combine them by a butterfly, so every block and thread
// holds bitwise the same totals. Two slot buffers and mbarriers alternate by row: block A writes
// buffer p of block B for row k + 2 only after it received row k + 1 from every block, B
// included, and B sends a row only after its threads passed row_sum's barriers for it, hence
// finished reading buffer p for row k. Lives in shared memory; every thread calls start(), then
// wait_started() before its first reduce(), then reduce() once per row, the same rows in every
// block of the cluster.
template <int kCluster, int kSums, class Op = SumOp>
struct ClusterRowReduce {
  static_assert(kCluster > 0 && kCluster <= 32 && (kCluster & (kCluster - 1)) == 0);
  static_assert(kSums <= 4, "a block's totals travel as one 16-byte st.async");
  float4 slots[2][kCluster];
  std::uint64_t landed[2];

  // Sets up the mbarriers and arrives on the cluster barrier, without waiting.
  __device__ __forceinline__ void start() {
    if (threadIdx.x == 0) {
      cuda::ptx::mbarrier_init(&landed[0], 1);
      cuda::ptx::mbarrier_init(&landed[1], 1);
      cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
    }
    cuda::ptx::barrier_cluster_arrive(cuda::ptx::sem_relaxed);
  }

  // Returns once every block of the cluster has started, so its mbarriers may be signalled.
  // An acquire at cluster scope (it invalidates L1): call it before prefetching into L1.
  __device__ __forceinline__ void wait_started() { cuda::ptx::barrier_cluster_wait(); }

  // v: the block's totals in every thread, as row_reduce leaves them; replaced by the
  // cluster's. row: this thread's count of rows reduced so far, advanced.
  __device__ __forceinline__ void reduce(float (&v)[kSums], int& row) {
    const int p = row & 1;
    const std::uint32_t phase = (row >> 1) & 1;
    ++row;
    if (threadIdx.x == 0) {
      cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta,
                                           cuda::ptx::space_shared, &landed[p],
                                           kCluster * sizeof(float4));
      float totals[4] = {};
#pragma unroll
      for (int c = 0; c < kSums; ++c) totals[c] = v[c];
      cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
      float* const slot = &slots[p][cluster.block_rank()].x;
      // One destination at a time: unrolled, the remote addresses of all of them were live at
      // once and spilled at 64 registers.
#pragma unroll 1
      for (int r = 0; r < kCluster; ++r) {
        cuda::ptx::st_async(cluster.map_shared_rank(slot, r), totals,
                            cluster.map_shared_rank(&landed[p], r));
      }
    }
    while (!cuda::ptx::mbarrier_try_wait_parity(&landed[p], phase)) {
    }
    const float4 got = slots[p][threadIdx.x % kCluster];
    const float lanes[4] = {got.x, got.y, got.z, got.w};
#pragma unroll
    for (int c = 0; c < kSums; ++c) v[c] = lanes[c];
    warp_segment_reduce<kCluster, Op>(v);
  }
};

template <int kCluster, int kSums>
using ClusterRowSum = ClusterRowReduce<kCluster, kSums, SumOp>;

}  // namespace trainscale::detail
