// Column sums of per-block partial rows inside the launch that wrote them, bitwise the same run
// after run: the weight gradients of the row kernels (a norm's dw and db) without a second
// launch.
//
// Every block of a grid writes one partial row per summed array (array a, block p at
// partial[(a * parts + p) * cols]); after a grid-wide barrier (the launch must be cooperative:
// launch_cooperative in cluster_launch.h), every block takes tiles of 32 columns and sums them
// over all partial rows in a fixed order that depends only on the block size and the number of
// partial rows, so every element of the result has the same bits on every run. The sums run on
// all SMs at once: one block adding 264 partial rows of 4096 columns (4.3 MB) would take tens
// of microseconds at one SM's L2 bandwidth, where 264 blocks take about one L2 round trip per
// 16-32 partial rows.
#pragma once

#include <cooperative_groups.h>

#include <cstdint>

namespace trainscale::detail {

// Columns of one tile: a warp reads 32 consecutive floats (128 bytes) of a partial row.
inline constexpr int kGridReduceTile = 32;

// Shared memory of reduce_partial_rows: one float per warp and lane (+1 against bank conflicts).
template <int kBlock>
struct GridReduceScratch {
  float sums[kBlock / 32][kGridReduceTile + 1];
};

// Waits until every block of the (cooperative) grid got here, with its global writes visible.
__device__ __forceinline__ void grid_barrier() { cooperative_groups::this_grid().sync(); }

// Sums arrays x cols columns over `parts` partial rows and hands each total to
// store(array, col, total). Warp w of a block adds partial rows w, w + kWarps, ... of its lane's
// column (4 loads in flight per thread), then warp 0 adds the kWarps results in warp order.
// Call after grid_barrier(), from every thread of every block.
template <int kBlock, class Store>
__device__ __forceinline__ void reduce_partial_rows(const float* partial, int parts, std::int64_t cols,
                                                    int arrays, GridReduceScratch<kBlock>& scratch,
                                                    Store&& store) {
  constexpr int kWarps = kBlock / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warp = static_cast<int>(threadIdx.x / 32);
  const std::int64_t tiles_per_array = (cols + kGridReduceTile - 1) / kGridReduceTile;
  const std::int64_t tiles = tiles_per_array * arrays;
  for (std::int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int array = static_cast<int>(tile / tiles_per_array);
    const std::int64_t col = (tile % tiles_per_array) * kGridReduceTile + lane;
    float sum = 0.f;
    if (col < cols) {
      const float* column = partial + static_cast<std::int64_t>(array) * parts * cols + col;
#pragma unroll 4
      for (int p = warp; p < parts; p += kWarps) sum += column[static_cast<std::int64_t>(p) * cols];
    }
    __syncthreads();  // the previous tile's results were read
    scratch.sums[warp][lane] = sum;
    __syncthreads();
    if (warp == 0 && col < cols) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total += scratch.sums[w][lane];
      store(array, col, total);
    }
  }
}

}  // namespace trainscale::detail
