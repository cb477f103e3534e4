// Persistent tile scheduler of the attention forward: a grid of at most one CTA per SM walking the
// tiles in the order of TileOrder (attention_heuristics.h: L2-sized head sections, heaviest query
// blocks first under a mask). CTA c starts with tile c. The producer warp decides each next tile
// (claim_next) when it starts the tile before, and hands it to the consumers in shared memory with
// that tile's Q (attention_fwd_mainloop.cuh), so both walk the same sequence:
// - static (counter null): c + grid, c + 2 grid, ...;
// - dynamic: grid + the value of a device counter (zero at launch) it increments, so CTAs whose
//   tiles cost less take more of them (AttentionSchedule::kDynamic).
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
};

}  // namespace trainscale::ops::attention
