// Warp-group GEMM on Hopper's wgmma through CuTe's SM90 GMMA atoms (needs the CUTLASS headers):
// one call issues every k-block of a tile as one asynchronous batch. Operands come from
// `thr_mma.partition_fragment_A/B` (shared-memory descriptors, or registers for A) and the
// accumulator from `partition_fragment_C`.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

namespace trainscale::detail {

// C (+)= A B over all k-blocks. kZeroInit: C = A B (C's old values are ignored). kWait: the number
// of wgmma batches left in flight on return (-1: do not wait; the caller waits with
// cute::warpgroup_wait<N>() before it reads C).
template <bool kZeroInit, int kWait = 0, class TiledMma, class TensorA, class TensorB, class TensorC>
__device__ __forceinline__ void warpgroup_gemm(TiledMma& mma, const TensorA& a, const TensorB& b,
                                               TensorC& c) {
  using namespace cute;
  // A from registers (RS) or shared-memory descriptors (SS).
  constexpr bool kARegisters =
      !is_same_v<typename std::decay_t<TensorA>::iterator, GMMA::DescriptorIterator>;
  if constexpr (kARegisters) warpgroup_fence_operand(const_cast<TensorA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(c);
  if constexpr (kARegisters) warpgroup_fence_operand(const_cast<TensorA&>(a));
}

// Two floats rounded to a pair of adjacent elements (one 32-bit word for 16-bit Element).
template <class Element>
__device__ __forceinline__ cutlass::Array<Element, 2> round_pair(float a, float b) {
  cutlass::NumericArrayConverter<Element, float, 2> convert;
  cutlass::Array<float, 2> pair;
  pair[0] = a;
  pair[1] = b;
  return convert(pair);
}

// One round of transpose_quad: lanes that differ in bit kBit of their quad lane trade the
// entries whose index differs in that bit (the lane with the bit set gives its entry with the bit
// clear, and takes its partner's entry with the bit set into the same place).
template <int kBit>
__device__ __forceinline__ void exchange_quad_entries(std::uint32_t (&w)[4], int quad_lane) {
  const bool high = quad_lane & kBit;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (i & kBit) continue;
    const std::uint32_t taken = __shfl_xor_sync(0xffffffffu, high ? w[i] : w[i | kBit], kBit);
    if (high) {
      w[i] = taken;
    } else {
      w[i | kBit] = taken;
    }
  }
}

// w[k] of quad lane q, its value for group k (of four), becomes lane k's value for group q: a 4 x 4
// transpose across the quad's lanes, swapping lane and index bit 0, then bit 1. Every lane of the
// warp calls it.
__device__ __forceinline__ void transpose_quad(std::uint32_t (&w)[4], int quad_lane) {
  exchange_quad_entries<1>(w, quad_lane);
  exchange_quad_entries<2>(w, quad_lane);
}

// Row r of a wgmma accumulator in its (rows, cols) view, times `scale`, rounded to Element and
// written with 16-byte stores. In that view a thread holds pairs of adjacent columns, (r, 2c) and
// (r, 2c + 1), one pair in each group of 8 columns, and the four threads of a quad (lanes 4i to
// 4i + 3) hold one row's four pairs of a group. The quad transposes its pairs of 4 groups
// (transpose_quad), so that each thread holds one group's 8 columns and stores them at once: a
// quarter of the store instructions of one store per pair, and a warp's store covers 64
// contiguous bytes of each of its 8 rows instead of 16. row: the address of the row's column 0,
// with every 8th column 16-byte aligned; column_of(c): the column of element (r, c). Every lane of
// the warp calls it (the shuffles); `write` false only skips the store.
template <class Element, class Fragment, class ColumnOf>
__device__ __forceinline__ void store_accumulator_row(Element* row, const Fragment& o, int r, ColumnOf column_of,
                                                      float scale, bool write) {
  using namespace cute;
  constexpr int kCols = decltype(size<1>(o))::value;
  static_assert(kCols % 8 == 0, "a quad's 16-byte stores take 4 groups of 8 columns at a time");
  static_assert(sizeof(Element) == 2);
  const int quad_lane = threadIdx.x % 4;
  CUTE_UNROLL
  for (int c = 0; c < kCols; c += 8) {
    std::uint32_t w[4];
    CUTE_UNROLL
    for (int k = 0; k < 4; ++k) {
      const cutlass::Array<Element, 2> packed = round_pair<Element>(o(r, c + 2 * k) * scale, o(r, c + 2 * k + 1) * scale);
      w[k] = reinterpret_cast<const std::uint32_t&>(packed);
    }
    transpose_quad(w, quad_lane);
    // This lane's pair of the first group starts 2 * quad_lane columns into it; after the
    // transpose it holds the group quad_lane groups further on.
    if (write) *reinterpret_cast<uint4*>(row + column_of(c) + 6 * quad_lane) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace trainscale::detail
