// Between the fp8 quantize dispatcher (fp8_quantize.cu) and the translation units of its
// kernels (fp8_quantize_tiles.cu, fp8_quantize_rows.cu): the launch arguments and launchers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "trainscale/tensor.h"

namespace trainscale::ops::fp8 {

inline constexpr std::int64_t kMaxGrid = 1 << 30;  // grid-stride loops cover the rest

template <bool kE4M3>
inline constexpr float kFp8Max = kE4M3 ? 448.0f : 57344.0f;

// What a pass of the 128x128 tile kernel does.
enum class TileMode {
  kTile,         // 1x128 scales for q (and 128x1 for q_t), computed here
  kBlock,        // one scale for the tile, computed here
  kGivenRow,     // scales[row] for q, scales_t[col] for q_t: finalized by an earlier pass
  kGivenTensor,  // scales[0] for both
  kAmaxRow,      // amax bits of each row into scales (and of each column into scales_t)
};

struct TileArgs {
  const void* x;
  std::int64_t x_stride;
  std::uint8_t* q;
  std::int64_t q_stride;
  std::uint8_t* q_t;
  std::int64_t q_t_stride;
  float* scales;
  float* scales_t;
  std::int64_t rows, cols;             // M, N of x
  std::int64_t row_tiles, col_tiles;   // ceil(M / 128), ceil(N / 128)
  std::int64_t pitch, pitch_t;         // kTile m-major: align4(M), align4(N)
  bool m_major;
  bool pow2;
  bool x_vec, q_vec, q_vec16, q_t_vec;  // rows aligned for 16-byte x, 8- / 16-byte q, 16-byte q_t
};

struct RowArgs {
  const void* x;
  std::int64_t x_stride;
  std::uint8_t* q;
  std::int64_t q_stride;
  float* scales;
  std::int64_t rows, cols;
  bool pow2;
  bool x_vec, q_vec, q_vec16;
};

// Rows of up to 1024 * 4 chunks of 8 elements (32768 elements) stay in registers.
inline constexpr std::int64_t kMaxRegisterChunks = 1024 * 4;

// The 128x128 tile kernel in `mode`, x of `dtype`, codes e4m3 or e5m2, with or without the
// transposed copy (kTile only with it: without, launch_quantize_tile_rows).
void launch_quantize_tiles(const TileArgs& a, DType dtype, bool e4m3, TileMode mode,
                           bool transpose, cudaStream_t stream, const char* op);
// 1x128 scales without the transposed copy.
void launch_quantize_tile_rows(const TileArgs& a, DType dtype, bool e4m3, cudaStream_t stream,
                               const char* op);
// Per-row scales of rows of at most kMaxRegisterChunks chunks, without the transposed copy.
void launch_quantize_rows(const RowArgs& a, DType dtype, bool e4m3, cudaStream_t stream,
                          const char* op);

}  // namespace trainscale::ops::fp8
