// Epilogue of the attention forward: the normalized output rows straight from the accumulator
// registers to global memory (each thread holds pairs of adjacent columns: one 32-bit store per
// pair where the output's alignment allows, two 16-bit stores otherwise), and the lse of each row
// by the thread that holds its first columns. Rows past Sq are not written. Writing through
// shared memory with a TMA store is the faster alternative for short sequences; this form accepts
// any output strides.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "ops/attention/attention_fwd_mainloop.cuh"

namespace trainscale::ops::attention {

template <class Traits>
struct ForwardEpilogue {
  using Element = typename Traits::Element;

  // o: the thread's output accumulators as (rows, cols), already divided by the row sums;
  // coords: their (row, col) within the tile; lse: per row.
  template <class TensorO, class TensorC, int kRows>
  __device__ __forceinline__ static void store(const ForwardParams<Traits>& p, const AttentionTile& tile,
                                               const TensorO& o, const TensorC& coords,
                                               const float (&lse)[kRows]) {
    using namespace cute;
    static_assert(decltype(size<0>(o))::value == kRows);
    Element* out = static_cast<Element*>(p.out) + tile.batch * p.out_stride_b +
                   static_cast<int64_t>(tile.head) * p.out_stride_h;
    const int row0 = tile.m_block * Traits::kBlockM;
    cutlass::NumericArrayConverter<Element, float, 2> convert;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = row0 + get<0>(coords(r, 0));
      if (row >= p.q_len) continue;
      Element* row_out = out + static_cast<int64_t>(row) * p.out_stride_s;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o); c += 2) {
        const int col = get<1>(coords(r, c));
        cutlass::Array<float, 2> pair;
        pair[0] = o(r, c);
        pair[1] = o(r, c + 1);
        const cutlass::Array<Element, 2> packed = convert(pair);
        if (p.out_pairs_aligned) {
          *reinterpret_cast<cutlass::Array<Element, 2>*>(row_out + col) = packed;
        } else {
          row_out[col] = packed[0];
          row_out[col + 1] = packed[1];
        }
      }
    }
    if (p.lse != nullptr && get<1>(coords(0, 0)) == 0) {
      float* lse_out = p.lse + (static_cast<int64_t>(tile.batch) * p.q_heads + tile.head) * p.q_len;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = row0 + get<0>(coords(r, 0));
        if (row < p.q_len) lse_out[row] = lse[r];
      }
    }
  }
};

}  // namespace trainscale::ops::attention
