// FP8 quantize without the transposed copy, a row at a time:
//   tile_rows_kernel  1x128 scales: 8 lanes per row, 4 tiles each, 16 elements per lane and tile
//                     (16-byte code stores).
//   row_kernel        per-row scales: the row in registers, one read.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/cuda_check.h"
#include "ops/fp8/fp8_quantize_device.cuh"

namespace trainscale::ops::fp8 {
namespace {

// ---------------------------------------------------------------------------------------------
// 1x128 tiles without the transposed copy: 8 lanes per row and kTiles consecutive tiles of it,
// each lane 16 consecutive elements of every tile (columns (t0 + k) * 128 + l * 16 .. + 15, two
// chunks), so that its codes leave as one 16-byte store; 32 rows per block. grid.x walks tile
// groups and grid.y row groups, so that blocks scheduled together read consecutive columns of
// the same rows (with rows first they read 1 KB from each of many rows 16 KB apart).
template <class T, bool kE4M3, int kTiles>
__global__ void __launch_bounds__(256) tile_rows_kernel(TileArgs a) {
  constexpr int kLanes = 8, kRowsPerBlock = 256 / kLanes;
  const int lane = threadIdx.x & (kLanes - 1), slot = threadIdx.x / kLanes;
  const T* x = static_cast<const T*>(a.x);
  const std::int64_t last_group = (a.rows - 1) / kRowsPerBlock;
  for (std::int64_t rb = blockIdx.y; rb <= last_group; rb += gridDim.y) {
    const std::int64_t row = rb * kRowsPerBlock + slot;
    const bool valid = row < a.rows;  // every lane group runs the shuffles either way
    const T* x_row = x + row * a.x_stride;
    for (std::int64_t sb = blockIdx.x; sb * kTiles < a.col_tiles; sb += gridDim.x) {
      const std::int64_t t0 = sb * kTiles;
      const std::int64_t first = t0 * 128 + lane * 16;  // tile k's chunks: first + k * 128 (+ 8)
      // All 2 * kTiles loads in flight before the first use.
      Chunk<T> raw[kTiles][2];
      if (valid && a.x_vec && first + (kTiles - 1) * 128 + 16 <= a.cols) {
#pragma unroll
        for (int k = 0; k < kTiles; ++k) {
#pragma unroll
          for (int h = 0; h < 2; ++h) raw[k][h] = load_chunk_vec(x_row + first + k * 128 + h * 8);
        }
      } else {
#pragma unroll
        for (int k = 0; k < kTiles; ++k) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const std::int64_t col = first + k * 128 + h * 8;
            raw[k][h] = valid ? load_chunk(x_row, col, a.cols, a.x_vec) : Chunk<T>{};
          }
        }
      }
      unsigned m[kTiles];
#pragma unroll
      for (int k = 0; k < kTiles; ++k) {
        m[k] = 0;
#pragma unroll
        for (int e = 0; e < 16; ++e) m[k] = max(m[k], abs_bits(chunk_value(raw[k][e / 8], e % 8)));
      }
      detail::warp_segment_reduce<kLanes, detail::BitsMaxOp>(m);
      GroupScale g[kTiles];
      float own;
      lane_group_scales<kLanes>(m, kFp8Max<kE4M3>, a.pow2, g, own);
      if (valid && lane < kTiles && t0 + lane < a.col_tiles) {
        const std::int64_t t = t0 + lane;
        a.scales[a.m_major ? t * a.pitch + row : row * a.col_tiles + t] = own;
      }
#pragma unroll
      for (int k = 0; k < kTiles; ++k) {
        const std::int64_t col = first + k * 128;
        if (!valid || t0 + k >= a.col_tiles || col >= a.cols) continue;
        store_codes16(a.q + row * a.q_stride + col, quantize16<kE4M3>(raw[k], g[k]), col, a.cols,
                      a.q_vec, a.q_vec16);
      }
      // m-major zero padding, rows M .. align4(M) - 1 of each tile column.
      if (a.m_major && rb == last_group && threadIdx.x < a.pitch - a.rows) {
#pragma unroll
        for (int k = 0; k < kTiles; ++k) {
          if (t0 + k < a.col_tiles) a.scales[(t0 + k) * a.pitch + a.rows + threadIdx.x] = 0.0f;
        }
      }
    }
  }
}

template <class T, bool kE4M3>
void launch_tile_rows(const TileArgs& a, cudaStream_t stream, const char* op) {
  const std::int64_t row_groups = std::min<std::int64_t>(65535, (a.rows + 31) / 32);
  auto go = [&](auto tiles) {
    constexpr int kTiles = decltype(tiles)::value;
    const std::int64_t tile_groups = std::min<std::int64_t>(kMaxGrid, (a.col_tiles + kTiles - 1) / kTiles);
    const dim3 grid(static_cast<unsigned>(tile_groups), static_cast<unsigned>(row_groups));
    tile_rows_kernel<T, kE4M3, kTiles><<<grid, 256, 0, stream>>>(a);
  };
  if (a.col_tiles >= 4) {
    go(std::integral_constant<int, 4>{});
  } else {
    go(std::integral_constant<int, 1>{});
  }
  detail::check_launch(op);
}

// kThreads threads per row (16 ... 1024), each kChunks chunks of 8 elements in runs of kRun
// consecutive chunks (2 when there are several, so that the codes leave as 16-byte stores): run
// r of lane l covers columns (r * kThreads + l) * 8 * kRun .. + 8 * kRun - 1.
template <class T, bool kE4M3, int kThreads, int kChunks>
__global__ void __launch_bounds__(kThreads < 256 ? 256 : kThreads) row_kernel(RowArgs a) {
  constexpr int kBlock = kThreads < 256 ? 256 : kThreads;
  constexpr int kRowsPerBlock = kBlock / kThreads;
  constexpr int kRun = kChunks > 1 ? 2 : 1;
  constexpr int kRuns = kChunks / kRun;
  static_assert(kChunks % kRun == 0);
  __shared__ unsigned warp_amax[kBlock / 32];
  const int lane = threadIdx.x % kThreads, slot = threadIdx.x / kThreads;
  const T* x = static_cast<const T*>(a.x);
  const auto run_col = [lane](int r) {
    return (static_cast<std::int64_t>(r) * kThreads + lane) * (8 * kRun);
  };

  // Every thread runs the same iterations: the reduction below has barriers.
  for (std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock; base < a.rows;
       base += static_cast<std::int64_t>(gridDim.x) * kRowsPerBlock) {
    const std::int64_t row = base + slot;
    const bool valid = row < a.rows;
    const T* x_row = x + row * a.x_stride;
    // All kChunks loads in flight before the first use.
    Chunk<T> raw[kRuns][kRun];
    if (valid && a.x_vec && run_col(kRuns - 1) + 8 * kRun <= a.cols) {
#pragma unroll
      for (int r = 0; r < kRuns; ++r) {
#pragma unroll
        for (int h = 0; h < kRun; ++h) raw[r][h] = load_chunk_vec(x_row + run_col(r) + 8 * h);
      }
    } else {
#pragma unroll
      for (int r = 0; r < kRuns; ++r) {
#pragma unroll
        for (int h = 0; h < kRun; ++h) {
          raw[r][h] = valid ? load_chunk(x_row, run_col(r) + 8 * h, a.cols, a.x_vec) : Chunk<T>{};
        }
      }
    }
    unsigned m = 0;
#pragma unroll
    for (int r = 0; r < kRuns; ++r) {
#pragma unroll
      for (int e = 0; e < 8 * kRun; ++e) m = max(m, abs_bits(chunk_value(raw[r][e / 8], e % 8)));
    }
    // warp_amax holds kRowsPerBlock rows of kThreads / 32 warps each (used beyond a warp; its
    // leading barrier keeps the previous row's readers).
    unsigned row_max[1] = {m};
    detail::row_reduce<kThreads, detail::BitsMaxOp>(row_max, warp_amax);
    const float s = scale_from_amax(row_max[0], kFp8Max<kE4M3>, a.pow2);
    if (!valid) continue;
    if (lane == 0) a.scales[row] = s;
    const GroupScale g = group_scale(s);
    std::uint8_t* q_row = a.q + row * a.q_stride;
#pragma unroll
    for (int r = 0; r < kRuns; ++r) {
      const std::int64_t col = run_col(r);
      if (col >= a.cols) continue;
      if constexpr (kRun == 2) {
        store_codes16(q_row + col, quantize16<kE4M3>(raw[r], g), col, a.cols, a.q_vec, a.q_vec16);
      } else {
        float v[8];
        chunk_floats(raw[r][0], v);
        store_codes8(q_row + col, quantize8<kE4M3>(v, g), col, a.cols, a.q_vec);
      }
    }
  }
}

template <class T, bool kE4M3>
void launch_rows(const RowArgs& a, cudaStream_t stream) {
  const std::int64_t chunks = (a.cols + 7) / 8;
  auto go = [&](auto threads, auto per_thread) {
    constexpr int kThreads = decltype(threads)::value;
    constexpr int kBlock = kThreads < 256 ? 256 : kThreads;
    constexpr int kRowsPerBlock = kBlock / kThreads;
    const std::int64_t grid = std::min(kMaxGrid, (a.rows + kRowsPerBlock - 1) / kRowsPerBlock);
    row_kernel<T, kE4M3, kThreads, decltype(per_thread)::value>
        <<<static_cast<unsigned>(grid), kBlock, 0, stream>>>(a);
  };
  using std::integral_constant;
  if (chunks <= 16) {
    go(integral_constant<int, 16>{}, integral_constant<int, 1>{});
  } else if (chunks <= 32) {
    go(integral_constant<int, 32>{}, integral_constant<int, 1>{});
  } else if (chunks <= 128) {
    go(integral_constant<int, 32>{}, integral_constant<int, 4>{});
  } else if (chunks <= 512) {
    go(integral_constant<int, 128>{}, integral_constant<int, 4>{});
  } else if (chunks <= 1024) {
    go(integral_constant<int, 256>{}, integral_constant<int, 4>{});
  } else if (chunks <= 2048) {
    go(integral_constant<int, 512>{}, integral_constant<int, 4>{});
  } else {
    go(integral_constant<int, 1024>{}, integral_constant<int, 4>{});
  }
}

}  // namespace

void launch_quantize_tile_rows(const TileArgs& a, DType dtype, bool e4m3, cudaStream_t stream,
                               const char* op) {
  with_quantize_types(dtype, e4m3, op, [&](auto tag, auto format) {
    launch_tile_rows<typename decltype(tag)::type, decltype(format)::value>(a, stream, op);
  });
}

void launch_quantize_rows(const RowArgs& a, DType dtype, bool e4m3, cudaStream_t stream,
                          const char* op) {
  with_quantize_types(dtype, e4m3, op, [&](auto tag, auto format) {
    launch_rows<typename decltype(tag)::type, decltype(format)::value>(a, stream);
  });
  detail::check_launch(op);
}

}  // namespace trainscale::ops::fp8
