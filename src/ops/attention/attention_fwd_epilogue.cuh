// Epilogue of the attention forward: the normalized output rows from the accumulator registers to
// global memory, and the lse of each row by the thread that holds its first columns. Rows past Sq
// are not written. 16-byte stores where the output's alignment allows (detail::
// store_accumulator_row: the quad's pairs transposed by shuffles); otherwise one 32-bit store
// per pair of adjacent columns, or two 16-bit stores. This form accepts any output strides.
#pragma once

#include <cute/tensor.hpp>

#include "common/wgmma.cuh"
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
    constexpr int kCols = decltype(size<1>(o))::value;
    Element* out = static_cast<Element*>(p.out) + tile.batch * p.out_stride_b +
                   static_cast<int64_t>(tile.head) * p.out_stride_h;
    const int row0 = tile.m_block * Traits::kBlockM;
    if (p.out_vector == 8) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = row0 + get<0>(coords(r, 0));
        const bool inside = row < p.q_len;  // rows past Sq still take part in the shuffles
        detail::store_accumulator_row(out + static_cast<int64_t>(inside ? row : 0) * p.out_stride_s, o, r,
                                      [&](int c) { return get<1>(coords(r, c)); }, 1.f, inside);
      }
    } else {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = row0 + get<0>(coords(r, 0));
        if (row >= p.q_len) continue;
        Element* row_out = out + static_cast<int64_t>(row) * p.out_stride_s;
        CUTE_UNROLL
        for (int c = 0; c < kCols; c += 2) {
          const int col = get<1>(coords(r, c));
          const cutlass::Array<Element, 2> packed = detail::round_pair<Element>(o(r, c), o(r, c + 1));
          if (p.out_vector == 2) {
            *reinterpret_cast<cutlass::Array<Element, 2>*>(row_out + col) = packed;
          } else {
            row_out[col] = packed[0];
            row_out[col + 1] = packed[1];
          }
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
