// Static persistent tile scheduler of the attention forward: a grid of at most one CTA per SM,
// CTA c taking tiles c, c + grid, c + 2 grid, ... in the order of TileOrder (attention_heuristics.h:
// L2-sized head sections, heaviest query blocks first under a causal mask). Producer and consumers
// walk the same sequence independently, so they need no communication to agree on the next tile.
#pragma once

#include <cstdint>

#include "ops/attention/attention_heuristics.h"

namespace trainscale::ops::attention {

struct StaticTileScheduler {
  TileOrder order;

  __device__ __forceinline__ std::int64_t first() const { return blockIdx.x; }
  __device__ __forceinline__ std::int64_t next(std::int64_t t) const { return t + gridDim.x; }
  __device__ __forceinline__ bool valid(std::int64_t t) const { return t < order.tiles(); }
  __device__ __forceinline__ AttentionTile tile(std::int64_t t) const { return order.at(t); }
};

}  // namespace trainscale::ops::attention
