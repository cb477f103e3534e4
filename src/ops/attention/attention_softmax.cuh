// The online softmax of the attention forward, in registers. A consumer thread holds two rows of
// each 64-row wgmma accumulator, split over the 4 threads of a quad; row maxima are reduced
// across the quad at every key block, row sums only at the end (a sum is linear: each thread keeps
// the partial sum of its own columns, rescaled with the shared maximum).
//
// Scores are folded into base 2 with the scale: p = 2^(s * scale * log2(e) - m * scale * log2(e)),
// one FFMA and one MUFU.EX2 per element. A negative scale is handled by negating the scores first
// (so the running maximum is the maximum of the scaled scores) and using |scale|.
#pragma once

#include <cute/tensor.hpp>

namespace trainscale::ops::attention {

// The wgmma accumulator layout ((2, 2, N/8), MMA_M, MMA_N) as (rows, cols):
// ((2, MMA_M), (2, N/8, MMA_N)); within a thread, element (r, 2c) and (r, 2c + 1) are adjacent
// columns.
template <class Layout>
__device__ __forceinline__ auto accumulator_rowcol(Layout layout) {
  using namespace cute;
  static_assert(decltype(rank(layout))::value == 3);
  static_assert(decltype(rank(get<0>(layout)))::value == 3);
  auto v = get<0>(layout);
  return make_layout(make_layout(get<1>(v), get<1>(layout)),
                     make_layout(get<0>(v), get<2>(v), get<2>(layout)));
}

// The same registers as the A operand of a register-sourced wgmma with K = N:
// ((2, 2, N/8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, N/16 * MMA_N). The 64x16 A fragment maps
// threads and values like the C fragment of a 64x16 tile, so P needs no data movement.
template <class Layout>
__device__ __forceinline__ auto accumulator_as_a_operand(Layout layout) {
  using namespace cute;
  auto v = get<0>(layout);
  auto split = logical_divide(get<2>(v), Int<2>{});  // (2, N/16)
  return make_layout(make_layout(get<0>(v), get<1>(v), get<0>(split)), get<1>(layout),
                     coalesce(make_layout(get<1>(split), get<2>(layout))));
}

// Elementwise conversion of a register fragment (packed converts where the types allow).
template <class To, class Tensor>
__device__ __forceinline__ auto convert_fragment(const Tensor& src) {
  using namespace cute;
  using From = typename Tensor::value_type;
  constexpr int kN = decltype(size(src))::value;
  auto dst = make_tensor<To>(src.layout());
  cutlass::NumericArrayConverter<To, From, kN> convert;
  *reinterpret_cast<cutlass::Array<To, kN>*>(dst.data()) =
      convert(*reinterpret_cast<const cutlass::Array<From, kN>*>(src.data()));
  return dst;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh on the MUFU unit (sm_75+; relative error about 2^-11, below bf16's rounding).
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Reduce over the 4 threads of a quad (the threads holding one row).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];  // of the (sign-adjusted, unscaled) scores seen so far; -inf: none
  float row_sum[kRows];  // this thread's partial sum of 2^(...) relative to row_max
  float scale_log2;      // |scale| * log2(e)

  __device__ __forceinline__ explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  // One key block: scores `s` (rows x cols, masked entries -inf) become probabilities relative
  // to the new running maximum; the sums are rescaled to it, and `rescale` receives the factor
  // the output rows must be multiplied by (rescale_output), which the caller applies once no
  // product still writes them. A NaN score does not enter the maximum (fmaxf) but turns its
  // probability, the sum and the output NaN.
  template <class TensorS>
  __device__ __forceinline__ void update(TensorS& s, float (&rescale)[kRows]) {
    using namespace cute;
    static_assert(decltype(size<0>(s))::value == kRows);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float m = row_max[r];
#pragma unroll
      for (int c = 0; c < size<1>(s); ++c) m = fmaxf(m, s(r, c));
      m = quad_max(m);
      // All -inf so far (every key masked): subtract 0 so that 2^(-inf - 0) = 0, not NaN.
      const float m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
      rescale[r] = fast_exp2(row_max[r] * scale_log2 - m_scaled);
      row_max[r] = m;
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < size<1>(s); ++c) {
        const float p = fast_exp2(fmaf(s(r, c), scale_log2, -m_scaled));
        s(r, c) = p;
        sum += p;
      }
      row_sum[r] = row_sum[r] * rescale[r] + sum;
    }
  }

  template <class TensorO>
  __device__ __forceinline__ static void rescale_output(TensorO& o, const float (&rescale)[kRows]) {
    using namespace cute;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int c = 0; c < size<1>(o); ++c) o(r, c) *= rescale[r];
    }
  }

  // After the last block: o /= sum and the natural-log lse; a row that saw no key gets o = 0 (even
  // where 0 * V was NaN) and lse = -inf. A NaN sum gives NaN in both. abs_scale = |scale|.
  template <class TensorO>
  __device__ __forceinline__ void finalize(TensorO& o, float abs_scale, float (&lse)[kRows]) {
    using namespace cute;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_sum(row_sum[r]);
      const bool empty = sum == 0.f;
      const float inv = empty ? 0.f : 1.f / sum;
      lse[r] = empty ? -INFINITY : row_max[r] * abs_scale + logf(sum);
#pragma unroll
      for (int c = 0; c < size<1>(o); ++c) o(r, c) = empty ? 0.f : o(r, c) * inv;
    }
  }
};

}  // namespace trainscale::ops::attention
