// Persistent tile scheduler of the attention forward: a grid of at most one CTA per SM walking the
// tiles in the order of TileOrder (attention_heuristics.h: L2-sized head sections, heaviest query
// blocks first under a mask). CTA c starts with tile c. The producer warp decides each next tile
// (claim_next) when it starts the tile before; the consumers follow (next_for_consumers):
// - static (counter null): c + grid, c + 2 grid, ..., which the consumers compute themselves;
// - dynamic: grid + the value of a device counter (zero at launch) it increments, so CTAs whose
//   tiles cost less take more of them (AttentionSchedule::kDynamic); the producer hands the
//   claimed index to the consumers in shared memory with the tile's Q (attention_fwd_mainloop.cuh).
#pragma once

#include <cstdint>

#include "ops/attention/attention_heuristics.h"

namespace trainscale::ops::attention {

struct TileScheduler {
  TileOrder order;
  unsigned long long* counter = nullptr;  // dynamic when set

  __device__ __forceinline__ std::int64_t first() const { return blockIdx.x; }
  __device__ __forceinline__ bool valid(std::int64_t t) const { return t < order.tiles(); }
  __device__ __forceinline__ AttentionTile tile(std::int64_t t) const { return order.at(t); }
  // One thread per CTA (the producer's issuing lane) calls this once per tile t, in order.
  __device__ __forceinline__ std::int64_t claim_next(std::int64_t t) const {
    if (counter == nullptr) return t + gridDim.x;
    return static_cast<std::int64_t>(gridDim.x) + static_cast<std::int64_t>(atomicAdd(counter, 1ull));
  }
  // The consumers' next tile after t: `handed` is the shared-memory slot the producer wrote it to
  // before its arrival on the Q barrier of t, read after the consumers' wait on that barrier.
  __device__ __forceinline__ std::int64_t next_for_consumers(std::int64_t t, const std::int64_t& handed) const {
    if (counter == nullptr) return t + gridDim.x;
    asm volatile("" ::: "memory");  // the wait's asm does not order this read by itself
    return *reinterpret_cast<const volatile std::int64_t*>(&handed);
  }
};

}  // namespace trainscale::ops::attention
