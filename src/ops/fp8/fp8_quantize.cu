// FP8 quantize kernels (dequantize: fp8_dequantize.cu). The arithmetic is fixed by
// include/trainscale/fp8.h and matched bit for bit: amax over |x| as float, r = amax / fmax as an
// IEEE float32 division (__fdiv_rn; the library is built without fast math, so no flush to
// zero), q = x / s as the same division's result, computed per element without dividing (fp8_quotient.h:
// RN(1/s) once per group, then a multiply and two FMAs; groups whose scale is out of that range
// divide), and the saturating round-to-nearest-even fp8 cast (cvt.rn.satfinite.{e4m3,e5m2}x2.f32).
//
// amax is taken as the unsigned maximum of the bit patterns of |x|: for non-negative floats the
// integer order is the numeric order, and every NaN (sign cleared) compares above +Inf, so a NaN
// in a group wins whatever the order, as the contract requires. The same property makes a
// cross-block amax an atomicMax on those bits.
//
// Kernels:
//   tile_kernel  one 128x128 tile of x per 256-thread block (each thread an 8x8 sub-block, rows
//                read as 16-byte vectors): 1x128 tiles with the transposed copy,
//                128x128 blocks, the quantize pass of the per-tensor scale, and the amax and
//                quantize passes of per-row scales with the transposed copy. The transposed copy
//                goes through a swizzled 16 KB shared-memory tile of fp8 codes, written as 16-byte
//                rows of q_t.
//   tile_rows_kernel  1x128 scales without the transposed copy: 8 lanes per row, 4 tiles each,
//                16 elements per lane and tile (16-byte code stores).
//   tensor_amax_kernel  the per-tensor amax pass: a streaming read of x.
//   row_kernel   per-row scales without the transposed copy: the row in registers, one read.
// Global amax (per tensor; per row / column with the transposed copy; rows too long for the
// registers): the scales tensors themselves are the scratch. memset to 0, an amax pass that
// atomicMax-es the amax bits into them, a finalize kernel that turns each amax into its scale in
// place, then the quantize pass reads the scales. No allocation, no host synchronization, and
// the result does not depend on the order of the atomics (max is exact).
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/dtype.cuh"
#include "common/elementwise.cuh"
#include "common/vec.cuh"
#include "ops/fp8/fp8_cuda.h"
#include "ops/fp8/fp8_internal.h"
#include "ops/fp8/fp8_quotient.h"

namespace trainscale::ops::fp8 {
namespace {

using detail::load_raw;
using detail::to_float;
using detail::Vec;

constexpr int kTileThreads = 256;          // 16 x 16 threads, each an 8 x 8 sub-block
constexpr std::int64_t kMaxGrid = 1 << 30;  // grid-stride loops cover the rest
constexpr unsigned kFullMask = 0xffffffffu;

template <bool kE4M3>
inline constexpr float kFp8Max = kE4M3 ? 448.0f : 57344.0f;

__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// The contract's scale for an amax given by its bit pattern (NaN and Inf included).
__device__ __forceinline__ float scale_from_amax(unsigned amax_bits, float fmax, bool pow2) {
  const float r = __fdiv_rn(__uint_as_float(amax_bits), fmax);
  if (r == 0.0f) return 1.0f;  // amax == 0, or r underflowed
  const unsigned b = __float_as_uint(r);
  if (!pow2 || b >= 0x7f800000u) return r;  // r >= 0 here: Inf and NaN have bits >= 0x7f800000
  const unsigned exponent = b >> 23, mantissa = b & 0x7fffffu;
  if (exponent != 0) {
    // The next power of two above a normal r; r < 2^120 since amax <= FLT_MAX and fmax >= 448,
    // so exponent + 1 never reaches the Inf exponent.
    return mantissa == 0 ? r : __uint_as_float((exponent + 1) << 23);
  }
  // Subnormal r = mantissa * 2^-149: the next power of two of the integer mantissa (2^23 is the
  // smallest normal, 2^-126).
  return (mantissa & (mantissa - 1)) == 0 ? r : __uint_as_float(1u << (32 - __clz(mantissa)));
}

// A group's scale s with r = RN(1/s) where the division-free quotient is exact for s, else 0.
struct GroupScale {
  float s, r;
};

__device__ __forceinline__ GroupScale group_scale(float s) {
  return {s, reciprocal_quotient_is_exact(s) ? nearest_reciprocal(s) : 0.0f};
}

// Scales of kGroups groups whose amax bits every lane of a kLanes-lane group (aligned within the
// warp) holds: lane l computes group l % kGroups and the others take it by shuffle, so a group
// costs one division and one reciprocal per lane group, not per lane. `own` gets lane l's group's
// scale (to store it).
template <int kLanes, int kGroups>
__device__ __forceinline__ void lane_group_scales(const unsigned (&amax)[kGroups], float fmax,
                                                  bool pow2, GroupScale (&g)[kGroups], float& own) {
  static_assert(kGroups <= kLanes && 32 % kLanes == 0);
  const int lane = threadIdx.x & (kLanes - 1);
  unsigned mine = amax[0];
#pragma unroll
  for (int k = 1; k < kGroups; ++k) mine = lane % kGroups == k ? amax[k] : mine;
  own = scale_from_amax(mine, fmax, pow2);
  const GroupScale computed = group_scale(own);
  if constexpr (kGroups == 1) {
    g[0] = computed;
  } else {
    const int first = threadIdx.x & 31 & ~(kLanes - 1);
#pragma unroll
    for (int k = 0; k < kGroups; ++k) {
      g[k].s = __shfl_sync(kFullMask, computed.s, first | k);
      g[k].r = __shfl_sync(kFullMask, computed.r, first | k);
    }
  }
}

template <bool kE4M3>
__device__ __forceinline__ unsigned encode2(float a, float b) {
  // x.x lands in the low byte.
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kE4M3 ? __NV_E4M3 : __NV_E5M2);
}

// Codes of 8 values of one group, value k in byte k: the float32 quotient, then the cast.
template <bool kE4M3>
__device__ __forceinline__ uint2 quantize8(const float (&v)[8], GroupScale g) {
  float q[8];
  if (g.r != 0.0f) {
#pragma unroll
    for (int k = 0; k < 8; ++k) q[k] = reciprocal_quotient(v[k], g.s, g.r);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) q[k] = __fdiv_rn(v[k], g.s);
  }
  unsigned w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = encode2<kE4M3>(q[2 * k], q[2 * k + 1]);
  return make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
}

// 8 consecutive elements kept as the loaded words (one uint4 for 16-bit T, two for float): 4 or 8
// registers per chunk instead of one per element, unpacked only where used. Zero-initialized
// is +0 for every T.
template <class T>
struct Chunk {
  uint4 w[sizeof(T) / 2];
};

template <class T>
__device__ __forceinline__ float chunk_value(const Chunk<T>& c, int k) {
  constexpr int kPerWord = 4 / static_cast<int>(sizeof(T));
  const int j = k / kPerWord;  // 32-bit word j of the chunk
  const uint4& w = c.w[j / 4];
  const unsigned word = (j & 2) ? ((j & 1) ? w.w : w.z) : ((j & 1) ? w.y : w.x);
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(word);
  } else {
    const unsigned short bits = static_cast<unsigned short>(word >> (16 * (k & 1)));
    T t;
    memcpy(&t, &bits, sizeof(t));
    return to_float(t);
  }
}

template <class T>
__device__ __forceinline__ void chunk_floats(const Chunk<T>& c, float (&v)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = chunk_value(c, k);
}

// A complete, 16-byte aligned chunk.
template <class T>
__device__ __forceinline__ Chunk<T> load_chunk_vec(const T* p) {
  Chunk<T> c;
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(T) / 2); ++i) c.w[i] = reinterpret_cast<const uint4*>(p)[i];
  return c;
}

// Elements [col, col + 8) of a row (those at or past `cols` read as 0): vector loads when the row
// is vector-aligned and the chunk complete, element loads otherwise. The kernels call this only
// on their edge path: a branch per chunk keeps the compiler from issuing the next chunk's load
// before this one's data is used (one load in flight per thread), so interior tiles take
// load_chunk_vec for all their chunks back to back.
template <class T>
__device__ __forceinline__ Chunk<T> load_chunk(const T* row, std::int64_t col, std::int64_t cols,
                                               bool vec_ok) {
  if (vec_ok && col + 8 <= cols) return load_chunk_vec(row + col);
  T v[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = col + k < cols ? row[col + k] : detail::from_float<T>(0.0f);
  Chunk<T> c;
  memcpy(&c, v, sizeof(c));
  return c;
}

// 8 codes to p = row + col; only those before `cols`.
__device__ __forceinline__ void store_codes8(std::uint8_t* p, uint2 c, std::int64_t col,
                                             std::int64_t cols, bool vec_ok) {
  if (vec_ok && col + 8 <= cols) {
    *reinterpret_cast<uint2*>(p) = c;
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    if (col + k < cols) p[k] = static_cast<std::uint8_t>((k < 4 ? c.x : c.y) >> (8 * (k & 3)));
  }
}

// 16 codes to p = row + col; only those before `cols`. vec16 / vec8: rows aligned for 16- / 8-byte
// stores.
__device__ __forceinline__ void store_codes16(std::uint8_t* p, uint4 c, std::int64_t col,
                                              std::int64_t cols, bool vec8, bool vec16) {
  if (col + 16 <= cols && vec16) {
    *reinterpret_cast<uint4*>(p) = c;
    return;
  }
  if (col + 16 <= cols && vec8) {
    reinterpret_cast<uint2*>(p)[0] = make_uint2(c.x, c.y);
    reinterpret_cast<uint2*>(p)[1] = make_uint2(c.z, c.w);
    return;
  }
  const unsigned w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    if (col + k < cols) p[k] = static_cast<std::uint8_t>(w[k / 4] >> (8 * (k & 3)));
  }
}

// Codes of two consecutive chunks of one group: 16 bytes, value k in byte k.
template <bool kE4M3, class T>
__device__ __forceinline__ uint4 quantize16(const Chunk<T> (&c)[2], GroupScale g) {
  float v[8];
  chunk_floats(c[0], v);
  const uint2 lo = quantize8<kE4M3>(v, g);
  chunk_floats(c[1], v);
  const uint2 hi = quantize8<kE4M3>(v, g);
  return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

// ---------------------------------------------------------------------------------------------
// 128x128 tiles.

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
      whole = __reduce_max_sync(kFullMask, whole);
      if (lane == 0) warp_amax[warp] = whole;
      __syncthreads();
#pragma unroll
      for (int w = 0; w < kTileThreads / 32; ++w) whole = max(whole, warp_amax[w]);
    }
    if constexpr (kRowAmax) {
      // A tile row is held by the 16 lanes of one half warp.
#pragma unroll
      for (int r = 0; r < 8; ++r) {
#pragma unroll
        for (int offset = 8; offset > 0; offset /= 2) {
          ra[r] = max(ra[r], __shfl_xor_sync(kFullMask, ra[r], offset));
        }
      }
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
#pragma unroll
        for (int offset = kLanes / 2; offset > 0; offset /= 2) {
          m[k] = max(m[k], __shfl_xor_sync(kFullMask, m[k], offset));
        }
      }
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

// ---------------------------------------------------------------------------------------------
// Whole rows in registers (per-row scales, no transposed copy).

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
    if constexpr (kThreads < 32) {
#pragma unroll
      for (int offset = kThreads / 2; offset > 0; offset /= 2) {
        m = max(m, __shfl_xor_sync(kFullMask, m, offset));
      }
    } else {
      m = __reduce_max_sync(kFullMask, m);
      if constexpr (kThreads > 32) {
        // warp_amax holds kRowsPerBlock rows of kThreads / 32 warps each.
        __syncthreads();  // the previous row's readers are done with warp_amax
        if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = m;
        __syncthreads();
#pragma unroll
        for (int w = 0; w < kThreads / 32; ++w) m = max(m, warp_amax[slot * (kThreads / 32) + w]);
      }
    }
    const float s = scale_from_amax(m, kFp8Max<kE4M3>, a.pow2);
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

// Rows of up to 1024 * 4 chunks (32768 elements) stay in registers.
constexpr std::int64_t kMaxRegisterChunks = 1024 * 4;

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

// ---------------------------------------------------------------------------------------------
// Per-tensor amax: a plain streaming read (the elementwise walk: 16-byte units, kAmaxUnroll
// loads in flight per thread, a grid as large as the work), a warp max, one atomicMax per block.

constexpr int kAmaxThreads = 256;
constexpr int kAmaxUnroll = 4;

template <class T, int V>
__global__ void __launch_bounds__(kAmaxThreads)
    tensor_amax_kernel(const T* x, std::int64_t x_stride, const detail::UnitWalk w,
                       unsigned* amax) {
  unsigned m = 0;
  for (detail::UnitPos p = detail::walk_start<kAmaxThreads, kAmaxUnroll>(w); p.i < w.rows;) {
    detail::UnitPos at[kAmaxUnroll];
    detail::tile_positions(w, p, at);
    Vec<T, V> v[kAmaxUnroll];
#pragma unroll
    for (int k = 0; k < kAmaxUnroll; ++k) {
      if (at[k].i < w.rows) v[k] = load_raw<T, V>(x + at[k].i * x_stride + at[k].j * V);
    }
#pragma unroll
    for (int k = 0; k < kAmaxUnroll; ++k) {
      if (at[k].i >= w.rows) continue;
#pragma unroll
      for (int e = 0; e < V; ++e) m = max(m, abs_bits(to_float(v[k].v[e])));
    }
    p = at[kAmaxUnroll - 1];
    detail::advance(p, w.grid_step, w.units);
  }
  if constexpr (V > 1) {  // the last cols % V elements of every row
    const std::int64_t count = w.rows * w.tail, first = w.units * V;
    for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kAmaxThreads + threadIdx.x;
         t < count; t += static_cast<std::int64_t>(gridDim.x) * kAmaxThreads) {
      const std::int64_t i = t / w.tail;
      m = max(m, abs_bits(to_float(x[i * x_stride + first + (t - i * w.tail)])));
    }
  }
  __shared__ unsigned warp_amax[kAmaxThreads / 32];
  m = __reduce_max_sync(kFullMask, m);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < kAmaxThreads / 32; ++k) m = max(m, warp_amax[k]);
    if (m != 0) atomicMax(amax, m);
  }
}

template <class T>
void launch_tensor_amax(const TileArgs& a, cudaStream_t stream, const char* op) {
  const detail::ElementwisePlan plan = detail::plan_elementwise(
      a.rows, a.cols, std::array{detail::StridedRows{const_cast<void*>(a.x), a.x_stride}},
      sizeof(T));
  // plan.rows == 1 when the rows are contiguous: then the stride is never applied.
  const auto go = [&](auto vec) {
    constexpr int V = decltype(vec)::value;
    const std::int64_t units = plan.rows * (plan.cols / V);
    const std::int64_t grid = detail::grid_for_tiles(units, kAmaxThreads * kAmaxUnroll);
    const detail::UnitWalk w =
        detail::make_walk(plan.rows, plan.cols, V, grid, kAmaxThreads, kAmaxUnroll);
    tensor_amax_kernel<T, V><<<static_cast<unsigned>(grid), kAmaxThreads, 0, stream>>>(
        static_cast<const T*>(a.x), a.x_stride, w, reinterpret_cast<unsigned*>(a.scales));
    detail::check_launch(op);
  };
  if (plan.vectorized) {
    go(std::integral_constant<int, detail::kVec16<T>>{});
  } else {
    go(std::integral_constant<int, 1>{});
  }
}

// ---------------------------------------------------------------------------------------------
// Global amax -> scale, in place.

// s[k] holds amax bits; becomes the scale. `copy` (optional) receives the same n values.
__global__ void finalize_kernel(float* s, std::int64_t n, float fmax, bool pow2, float* copy) {
  for (std::int64_t k = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float v = scale_from_amax(__float_as_uint(s[k]), fmax, pow2);
    s[k] = v;
    if (copy) copy[k] = v;
  }
}

void finalize(float* s, std::int64_t n, float fmax, bool pow2, float* copy, cudaStream_t stream,
              const char* op) {
  if (n == 0) return;
  const std::int64_t grid = std::min<std::int64_t>(1024, (n + 255) / 256);
  finalize_kernel<<<static_cast<unsigned>(grid), 256, 0, stream>>>(s, n, fmax, pow2, copy);
  detail::check_launch(op);
}

void zero(float* s, std::int64_t n, cudaStream_t stream, const char* op) {
  if (n == 0) return;
  detail::check_cuda(cudaMemsetAsync(s, 0, static_cast<std::size_t>(n) * sizeof(float), stream),
                     op, "cudaMemsetAsync");
}

// ---------------------------------------------------------------------------------------------
// Quantize launcher.

template <class T, bool kE4M3, TileMode kMode, bool kTranspose>
void launch_tiles(const TileArgs& a, cudaStream_t stream, const char* op) {
  const std::int64_t grid = std::min(kMaxGrid, a.row_tiles * a.col_tiles);
  tile_kernel<T, kE4M3, kMode, kTranspose><<<static_cast<unsigned>(grid), kTileThreads, 0, stream>>>(a);
  detail::check_launch(op);
}

template <class T, bool kE4M3, TileMode kMode>
void launch_tiles(const TileArgs& a, bool transpose, cudaStream_t stream, const char* op) {
  if (transpose) {
    launch_tiles<T, kE4M3, kMode, true>(a, stream, op);
  } else {
    launch_tiles<T, kE4M3, kMode, false>(a, stream, op);
  }
}

template <class T, bool kE4M3>
void quantize(const TensorView& x, TensorView q, TensorView scales, TensorView q_t,
              TensorView scales_t, const Fp8QuantizeOptions& options, cudaStream_t stream) {
  const char* op = "fp8_quantize";
  const auto xr = detail::row_layout(x);
  const std::int64_t M = xr.rows, N = xr.cols;
  const bool transpose = q_t.defined();
  constexpr float kMax = kFp8Max<kE4M3>;
  const bool pow2 = options.power_of_two_scales;
  float* s = scales.ptr<float>();
  float* s_t = transpose ? scales_t.ptr<float>() : nullptr;

  if (M == 0 || N == 0) {
    // Groups over no elements: amax 0, scale 1 (only tensor and row scales are non-empty here;
    // m-major and block grids have no entries).
    const std::int64_t n = scale_grid(options, M, N).storage_size();
    zero(s, n, stream, op);
    finalize(s, n, kMax, pow2, nullptr, stream, op);
    if (transpose) {
      const std::int64_t n_t = scale_grid(options, N, M).storage_size();
      zero(s_t, n_t, stream, op);
      finalize(s_t, n_t, kMax, pow2, nullptr, stream, op);
    }
    return;
  }

  TileArgs a{};
  a.x = x.data;
  a.x_stride = xr.row_stride;
  a.q = static_cast<std::uint8_t*>(q.data);
  a.q_stride = detail::row_layout(q).row_stride;
  a.scales = s;
  a.scales_t = s_t;
  a.rows = M;
  a.cols = N;
  a.row_tiles = ceil_div(M, kGroupEdge);
  a.col_tiles = ceil_div(N, kGroupEdge);
  a.m_major = options.scales_m_major;
  a.pitch = ceil_div(M, 4) * 4;
  a.pitch_t = ceil_div(N, 4) * 4;
  a.pow2 = pow2;
  const auto elem = static_cast<std::int64_t>(sizeof(T));
  a.x_vec = detail::rows_aligned(a.x, M, a.x_stride * elem, 16);
  a.q_vec = detail::rows_aligned(a.q, M, a.q_stride, 8);
  a.q_vec16 = detail::rows_aligned(a.q, M, a.q_stride, 16);
  if (transpose) {
    a.q_t = static_cast<std::uint8_t*>(q_t.data);
    a.q_t_stride = detail::row_layout(q_t).row_stride;
    a.q_t_vec = detail::rows_aligned(a.q_t, N, a.q_t_stride, 16);
  }

  switch (options.granularity) {
    case Fp8Granularity::kTile1x128:
      if (transpose) {
        launch_tiles<T, kE4M3, TileMode::kTile, true>(a, stream, op);
      } else {
        launch_tile_rows<T, kE4M3>(a, stream, op);
      }
      return;
    case Fp8Granularity::kBlock128x128:
      launch_tiles<T, kE4M3, TileMode::kBlock>(a, transpose, stream, op);
      return;
    case Fp8Granularity::kRow:
      if (!transpose && (N + 7) / 8 <= kMaxRegisterChunks) {
        const RowArgs r{a.x, a.x_stride, a.q,   a.q_stride, s,
                        M,   N,          pow2,  a.x_vec,    a.q_vec, a.q_vec16};
        launch_rows<T, kE4M3>(r, stream);
        detail::check_launch(op);
        return;
      }
      zero(s, M, stream, op);
      if (transpose) zero(s_t, N, stream, op);
      launch_tiles<T, kE4M3, TileMode::kAmaxRow>(a, transpose, stream, op);
      finalize(s, M, kMax, pow2, nullptr, stream, op);
      if (transpose) finalize(s_t, N, kMax, pow2, nullptr, stream, op);
      launch_tiles<T, kE4M3, TileMode::kGivenRow>(a, transpose, stream, op);
      return;
    case Fp8Granularity::kTensor:
      zero(s, 1, stream, op);
      launch_tensor_amax<T>(a, stream, op);
      finalize(s, 1, kMax, pow2, s_t, stream, op);
      launch_tiles<T, kE4M3, TileMode::kGivenTensor>(a, transpose, stream, op);
      return;
  }
}

}  // namespace

void fp8_quantize_cuda(const TensorView& x, TensorView q, TensorView scales, TensorView q_t,
                       TensorView scales_t, const Fp8QuantizeOptions& options,
                       cudaStream_t stream) {
  detail::dispatch_activation_dtype(x.dtype, "fp8_quantize", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (q.dtype == DType::kFloat8E4M3) {
      quantize<T, true>(x, q, scales, q_t, scales_t, options, stream);
    } else {
      quantize<T, false>(x, q, scales, q_t, scales_t, options, stream);
    }
  });
}

}  // namespace trainscale::ops::fp8
