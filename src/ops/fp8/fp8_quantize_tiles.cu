// FP8 quantize, the 128x128 tile kernel: one tile of x per 256-thread block (each thread an 8x8
// sub-block, rows read as 16-byte vectors), in every TileMode (fp8_quantize.h): 1x128 tiles with
// the transposed copy, 128x128 blocks, the quantize pass of the per-tensor scale, and the amax
// and quantize passes of per-row scales with the transposed copy. The transposed copy goes
// through a swizzled 16 KB shared-memory tile of fp8 codes, written as 16-byte rows of q_t.
#include <algorithm>
#include <cstdint>

#include "common/cuda_check.h"
#include "ops/fp8/fp8_quantize_device.cuh"

namespace trainscale::ops::fp8 {
namespace {

constexpr int kTileThreads = 256;  // 16 x 16 threads, each an 8 x 8 sub-block

// Byte transpose of an 8x8 block: out[c] byte r = in[r] byte c.
__device__ __forceinline__ void transpose8x8(const uint2 (&in)[8], uint2 (&out)[8]) {
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const unsigned b = c & 3;
    const unsigned sel = b | ((b + 4) << 4);  // byte 0 from the first word, byte 1 from the second
    unsigned half[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int r = 2 * p;
      half[p] = __byte_perm(c < 4 ? in[r].x : in[r].y, c < 4 ? in[r + 1].x : in[r + 1].y, sel);
    }
    out[c].x = __byte_perm(half[0], half[1], 0x5410);
    out[c].y = __byte_perm(half[2], half[3], 0x5410);
  }
}

// Left to itself, ptxas fits the 16-bit 128x128 kernel with the transposed copy into 64 registers
// and spills (16 bytes a thread, 1-byte-per-sector local traffic in ncu); three blocks per SM
// lets it take 72. 0 leaves the others to ptxas's own choice.
template <class T, TileMode kMode, bool kTranspose>
constexpr int kTileMinBlocks = kMode == TileMode::kBlock && kTranspose && sizeof(T) == 2 ? 3 : 0;

template <class T, bool kE4M3, TileMode kMode, bool kTranspose>
__global__ void __launch_bounds__(kTileThreads, (kTileMinBlocks<T, kMode, kTranspose>))
    tile_kernel(TileArgs a) {
  constexpr bool kAmaxOnly = kMode == TileMode::kAmaxRow;
  constexpr bool kRowAmax = kMode == TileMode::kTile || kMode == TileMode::kAmaxRow;
  constexpr bool kColAmax = kTranspose && kRowAmax;
  constexpr bool kWholeAmax = kMode == TileMode::kBlock;
  // q and q_t quantize each element with the same scale: q_t is the transpose of q's codes.
  constexpr bool kSameScale = kMode == TileMode::kBlock || kMode == TileMode::kGivenTensor;
  constexpr bool kStage = kTranspose && !kAmaxOnly;
  constexpr bool kGivenScale = kMode == TileMode::kGivenRow || kMode == TileMode::kGivenTensor;
  constexpr float kMax = kFp8Max<kE4M3>;

  __shared__ unsigned col_amax[kColAmax ? kTileThreads / 32 : 1][128];
  // Column jl's scale at (jl % 8) * 16 + jl / 8: the 16 lanes reading column c of their 8 read
  // 16 consecutive entries (with jl = cg * 8 + c, the plain order is an 8-way bank conflict).
  __shared__ GroupScale col_scale[kMode == TileMode::kTile && kTranspose ? 128 : 1];
  // q_t's 128 x 128 codes: row jl (a column of x) holds 16 chunks of 8 codes (8 rows of x);
  // logical chunk L sits at physical chunk L ^ ((jl / 8) % 16), so that both the 8-byte writes
  // (16 lanes: 16 columns groups, one chunk each) and the 16-byte reads are conflict free.
  __shared__ uint2 qt_tile[kStage ? 128 * 16 : 1];
  __shared__ unsigned warp_amax[kTileThreads / 32];

  const int tid = threadIdx.x;
  const int cg = tid & 15, rg = tid >> 4, warp = tid >> 5, lane = tid & 31;
  const T* x = static_cast<const T*>(a.x);
  const std::int64_t tiles = a.row_tiles * a.col_tiles;

  for (std::int64_t step = blockIdx.x; step < tiles; step += gridDim.x) {
    // The quantize pass after a separate amax pass walks the tiles last to first: the amax
    // pass's last reads are still in L2.
    const std::int64_t tile = kGivenScale ? tiles - 1 - step : step;
    const std::int64_t bi = tile / a.col_tiles, bj = tile - bi * a.col_tiles;
    const std::int64_t r0 = bi * 128 + rg * 8;  // this thread's rows r0 .. r0 + 7
    const std::int64_t c0 = bj * 128 + cg * 8;  // and columns c0 .. c0 + 7

    // All 8 loads in flight before the first use.
    Chunk<T> raw[8];
    if (a.x_vec && r0 + 8 <= a.rows && c0 + 8 <= a.cols) {
#pragma unroll
      for (int r = 0; r < 8; ++r) raw[r] = load_chunk_vec(x + (r0 + r) * a.x_stride + c0);
    } else {
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const std::int64_t row = r0 + r;
        raw[r] = row < a.rows ? load_chunk(x + row * a.x_stride, c0, a.cols, a.x_vec) : Chunk<T>{};
      }
    }

    unsigned ra[8], ca[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) ra[k] = ca[k] = 0;
    if constexpr (!kGivenScale) {
#pragma unroll
      for (int r = 0; r < 8; ++r) {
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const unsigned b = abs_bits(chunk_value(raw[r], c));
          ra[r] = max(ra[r], b);
          if constexpr (kColAmax) ca[c] = max(ca[c], b);
        }
      }
    }

    unsigned whole = 0;
    if constexpr (kWholeAmax) {
#pragma unroll
      for (int r = 0; r < 8; ++r) whole = max(whole, ra[r]);
      // No leading barrier: the barrier that ends each tile keeps the previous tile's readers.
      unsigned tile_max[1] = {whole};
      detail::row_reduce<kTileThreads, detail::BitsMaxOp, false>(tile_max, warp_amax);
      whole = tile_max[0];
    }
    if constexpr (kRowAmax) {
      // A tile row is held by the 16 lanes of one half warp.
      detail::warp_segment_reduce<16, detail::BitsMaxOp>(ra);
    }
    if constexpr (kMode == TileMode::kAmaxRow) {
      if (cg == 0) {
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          if (r0 + r < a.rows && ra[r] != 0) {
            atomicMax(reinterpret_cast<unsigned*>(a.scales) + r0 + r, ra[r]);
          }
        }
      }
    }

    if constexpr (kColAmax) {
      // Column amax: the thread's 8 rows, the other half warp, then the 8 warps.
#pragma unroll
      for (int c = 0; c < 8; ++c) ca[c] = max(ca[c], __shfl_xor_sync(kFullMask, ca[c], 16));
      if (lane < 16) {
        uint4* dst = reinterpret_cast<uint4*>(&col_amax[warp][cg * 8]);
        dst[0] = make_uint4(ca[0], ca[1], ca[2], ca[3]);
        dst[1] = make_uint4(ca[4], ca[5], ca[6], ca[7]);
      }
      __syncthreads();
      if (tid < 128) {
        unsigned m = 0;
#pragma unroll
        for (int w = 0; w < kTileThreads / 32; ++w) m = max(m, col_amax[w][tid]);
        const std::int64_t j = bj * 128 + tid;
        if constexpr (kMode == TileMode::kAmaxRow) {
          if (j < a.cols && m != 0) atomicMax(reinterpret_cast<unsigned*>(a.scales_t) + j, m);
        } else {
          const float s = scale_from_amax(m, kMax, a.pow2);
          col_scale[(tid & 7) * 16 + (tid >> 3)] = group_scale(s);
          // scales_t is the 1x128 grid of x^T: row j, tile bi.
          if (j < a.cols) a.scales_t[a.m_major ? bi * a.pitch_t + j : j * a.row_tiles + bi] = s;
        }
      }
      if constexpr (kMode == TileMode::kTile) __syncthreads();  // col_scale
    }

    if constexpr (!kAmaxOnly) {
      // Row scales for q.
      GroupScale rs[8];
      if constexpr (kMode == TileMode::kTile) {
        float own;
        lane_group_scales<16>(ra, kMax, a.pow2, rs, own);
        const std::int64_t row = r0 + cg;
        if (cg < 8 && row < a.rows) {
          a.scales[a.m_major ? bj * a.pitch + row : row * a.col_tiles + bj] = own;
        }
        if (a.m_major) {  // zero padding of the m-major layouts: rows M .. align4(M) - 1
          if (bi == a.row_tiles - 1 && tid < a.pitch - a.rows) {
            a.scales[bj * a.pitch + a.rows + tid] = 0.0f;
          }
          if (kTranspose && bj == a.col_tiles - 1 && tid < a.pitch_t - a.cols) {
            a.scales_t[bi * a.pitch_t + a.cols + tid] = 0.0f;
          }
        }
      } else if constexpr (kMode == TileMode::kBlock) {
        const float s = scale_from_amax(whole, kMax, a.pow2);
        const GroupScale g = group_scale(s);
#pragma unroll
        for (int r = 0; r < 8; ++r) rs[r] = g;
        if (tid == 0) {
          a.scales[bi * a.col_tiles + bj] = s;
          if (kTranspose) a.scales_t[bj * a.row_tiles + bi] = s;
        }
      } else if constexpr (kMode == TileMode::kGivenRow) {
#pragma unroll
        for (int r = 0; r < 8; ++r) rs[r] = group_scale(r0 + r < a.rows ? a.scales[r0 + r] : 1.0f);
      } else {  // kGivenTensor
        const GroupScale g = group_scale(a.scales[0]);
#pragma unroll
        for (int r = 0; r < 8; ++r) rs[r] = g;
      }

      uint2 qc[8];
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        float v[8];
        chunk_floats(raw[r], v);
        qc[r] = quantize8<kE4M3>(v, rs[r]);
        const std::int64_t row = r0 + r;
        if (row < a.rows) store_codes8(a.q + row * a.q_stride + c0, qc[r], c0, a.cols, a.q_vec);
      }

      if constexpr (kTranspose) {
        uint2 tc[8];
        if constexpr (kSameScale) {
          transpose8x8(qc, tc);
        } else {
#pragma unroll
          for (int c = 0; c < 8; ++c) {
            GroupScale s;
            if constexpr (kMode == TileMode::kTile) {
              s = col_scale[c * 16 + cg];
            } else {  // kGivenRow
              s = group_scale(c0 + c < a.cols ? a.scales_t[c0 + c] : 1.0f);
            }
            float v[8];
#pragma unroll
            for (int r = 0; r < 8; ++r) v[r] = chunk_value(raw[r], c);
            tc[c] = quantize8<kE4M3>(v, s);
          }
        }
#pragma unroll
        for (int c = 0; c < 8; ++c) qt_tile[(cg * 8 + c) * 16 + (rg ^ cg)] = tc[c];
        __syncthreads();
        // 128 rows of q_t x 8 pieces of 16 codes.
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int p = tid + kTileThreads * k;
          const int jl = p >> 3, m = p & 7, swz = (jl >> 3) & 15;
          uint4 v = reinterpret_cast<const uint4*>(qt_tile + jl * 16)[m ^ (swz >> 1)];
          if (swz & 1) v = make_uint4(v.z, v.w, v.x, v.y);
          const std::int64_t j = bj * 128 + jl, i = bi * 128 + 16 * m;
          if (j < a.cols) store_codes16(a.q_t + j * a.q_t_stride + i, v, i, a.rows, a.q_t_vec, a.q_t_vec);
        }
      }
    }
    __syncthreads();  // shared memory is reused by the next tile
  }
}

template <class T, bool kE4M3, TileMode kMode, bool kTranspose>
void launch(const TileArgs& a, cudaStream_t stream, const char* op) {
  const std::int64_t grid = std::min(kMaxGrid, a.row_tiles * a.col_tiles);
  tile_kernel<T, kE4M3, kMode, kTranspose><<<static_cast<unsigned>(grid), kTileThreads, 0, stream>>>(a);
  detail::check_launch(op);
}

template <class T, bool kE4M3, TileMode kMode>
void launch(const TileArgs& a, bool transpose, cudaStream_t stream, const char* op) {
  if (transpose) {
    launch<T, kE4M3, kMode, true>(a, stream, op);
  } else if constexpr (kMode == TileMode::kTile) {
    detail::throw_op_error(op, "1x128 tiles without the transposed copy are "
                               "launch_quantize_tile_rows's");
  } else {
    launch<T, kE4M3, kMode, false>(a, stream, op);
  }
}

}  // namespace

void launch_quantize_tiles(const TileArgs& a, DType dtype, bool e4m3, TileMode mode,
                           bool transpose, cudaStream_t stream, const char* op) {
  with_quantize_types(dtype, e4m3, op, [&](auto tag, auto format) {
    using T = typename decltype(tag)::type;
    constexpr bool kE4M3 = decltype(format)::value;
    switch (mode) {
      case TileMode::kTile: return launch<T, kE4M3, TileMode::kTile>(a, transpose, stream, op);
      case TileMode::kBlock: return launch<T, kE4M3, TileMode::kBlock>(a, transpose, stream, op);
      case TileMode::kGivenRow:
        return launch<T, kE4M3, TileMode::kGivenRow>(a, transpose, stream, op);
      case TileMode::kGivenTensor:
        return launch<T, kE4M3, TileMode::kGivenTensor>(a, transpose, stream, op);
      case TileMode::kAmaxRow:
        return launch<T, kE4M3, TileMode::kAmaxRow>(a, transpose, stream, op);
    }
  });
}

}  // namespace trainscale::ops::fp8
