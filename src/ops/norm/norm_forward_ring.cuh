// kRing, the forward's persistent bulk-copy ring (sm_90; norm_plan.h's RingPlan): RMSNorm and
// LayerNorm without a residual. Included by norm_forward_launch.cuh.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/async_copy.cuh"
#include "ops/norm/norm_forward_kernels.cuh"

namespace trainscale::ops::norm {
namespace {

// A block walks rows blockIdx.x, + gridDim.x, ... (neighbouring blocks read neighbouring rows at
// a time, as a grid of one row per block does). Thread 0 keeps `stages` rows in flight: each
// row is one bulk copy into its stage of the ring, and a stage is refilled with the row `stages`
// ahead once every thread has read it, which the row reduction's barriers guarantee (a thread's
// shared loads feed its sums before it enters them). Each thread holds kVecs vectors of V
// columns (vector u = i * kRingThreads + threadIdx.x) and their weight and bias as floats, read
// once. W, B: the parameters' dtypes (GlobalParams).
template <class T, class W, class B, Kind kKind, int kVecs>
__global__ void __launch_bounds__(kRingThreads, 1) forward_ring_kernel(ForwardArgs a, int stages) {
  constexpr int V = detail::kVec16<T>;
  extern __shared__ __align__(128) uint4 ring[];
  __shared__ std::uint64_t landed[kMaxRingStages];
  __shared__ float scratch[kRingThreads / 32 * kSums<kKind>];
  const int t = threadIdx.x;
  const int n = static_cast<int>(a.cols);
  const int vecs = n / V;
  const auto row_bytes = static_cast<std::uint32_t>(n * sizeof(T));
  const std::int64_t first = blockIdx.x;  // the grid has at most one block per row
  const std::int64_t count = (a.rows - 1 - first) / gridDim.x + 1;
  const auto row_of = [&](std::int64_t k) { return first + k * gridDim.x; };
  const auto fetch = [&](std::int64_t k, int stage) {
    detail::arrive_expect_tx(&landed[stage], row_bytes);
    detail::bulk_copy_to_shared(ring + stage * vecs,
                                static_cast<const T*>(a.x) + row_of(k) * a.x_stride, row_bytes,
                                &landed[stage]);
  };
  if (t == 0) {
    for (int s = 0; s < stages; ++s) cuda::ptx::mbarrier_init(&landed[s], 1);
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
    for (int s = 0; s < stages && s < count; ++s) fetch(s, s);
  }
  using Params = GlobalParams<W, B, kKind, V>;
  float scale[kVecs][V], shift[kVecs][V] = {};
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int u = i * kRingThreads + t;
    if (u < vecs) Params::template scale_shift<false>(a, u * V, scale[i], shift[i]);
  }
  __syncthreads();  // the mbarriers are initialized before any thread waits on them

  for (std::int64_t k = 0; k < count; ++k) {
    const int stage = static_cast<int>(k % stages);
    detail::wait_parity(&landed[stage], static_cast<std::uint32_t>((k / stages) & 1));
    const uint4* row = ring + stage * vecs;
    Vec<T, V> held[kVecs];
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int u = i * kRingThreads + t;
      if (u < vecs) {
        const uint4 raw = row[u];
        memcpy(&held[i], &raw, sizeof(raw));
      }
    }
    float pivot = 0.f;
    if constexpr (kKind == Kind::kLayer) pivot = to_float(reinterpret_cast<const T*>(row)[0]);
    float sums[kSums<kKind>] = {};
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (i * kRingThreads + t >= vecs) continue;
      float v[V];
      detail::to_floats(held[i], v);
      accumulate<kKind, V>(v, pivot, sums);
    }
    row_sum<kRingThreads, kSums<kKind>>(sums, scratch);
    // Every thread has read this stage: refill it. The fence orders those generic-proxy reads
    // before the copy engine's writes.
    if (t == 0 && k + stages < count) {
      cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
      fetch(k + stages, stage);
    }
    const RowStats st = row_stats<kKind>(sums, n, a.eps);
    const std::int64_t r = row_of(k);
    T* y_row = static_cast<T*>(a.y) + r * a.y_stride;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int u = i * kRingThreads + t;
      if (u >= vecs) continue;
      float v[V];
      detail::to_floats(held[i], v);
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = normalize<kKind>(v[j], pivot, st, scale[i][j], shift[i][j]);
      store_floats<T, V>(y_row + u * V, v);
    }
    if (t == 0) {
      if (a.rstd) a.rstd[r] = st.rstd;
      if (a.mean) a.mean[r] = st.mean;
    }
  }
}

}  // namespace
}  // namespace trainscale::ops::norm
