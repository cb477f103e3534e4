// FP8 quantize: the passes each scale granularity takes (dequantize: fp8_dequantize.cu).
//   1x128 tiles      one pass: the 128x128 tile kernel with the transposed copy
//                    (fp8_quantize_tiles.cu), tile_rows_kernel without (fp8_quantize_rows.cu).
//   128x128 blocks   one pass of the tile kernel.
//   per row          without the transposed copy, rows of up to kMaxRegisterChunks chunks: one
//                    pass of row_kernel (the row in registers); otherwise global amax.
//   per tensor       global amax: tensor_amax_kernel (here), then the tile kernel.
// Global amax (per tensor; per row / column with the transposed copy; rows too long for the
// registers): the scales tensors themselves are the scratch. memset to 0, an amax pass that
// atomicMax-es the amax bits into them, a finalize kernel that turns each amax into its scale in
// place, then the quantize pass reads the scales. No allocation, no host synchronization, and
// the result does not depend on the order of the atomics (max is exact).
#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/elementwise.cuh"
#include "ops/fp8/fp8_cuda.h"
#include "ops/fp8/fp8_internal.h"
#include "ops/fp8/fp8_quantize_device.cuh"

namespace trainscale::ops::fp8 {
namespace {

using detail::load_raw;
using detail::Vec;

// ---------------------------------------------------------------------------------------------
// Per-tensor amax: a plain streaming read (the elementwise walk: 16-byte units, kAmaxUnroll
// loads in flight per thread, a grid as large as the work), the block's maximum (reduce.cuh),
// one atomicMax per block.

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
  __shared__ unsigned scratch[kAmaxThreads / 32];
  unsigned block_max[1] = {m};
  detail::row_reduce<kAmaxThreads, detail::BitsMaxOp, false>(block_max, scratch);  // once per block
  if (threadIdx.x == 0 && block_max[0] != 0) atomicMax(amax, block_max[0]);
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

void launch_tensor_amax(const TileArgs& a, DType dtype, cudaStream_t stream, const char* op) {
  detail::dispatch_activation_dtype(dtype, op, [&](auto tag) {
    launch_tensor_amax<typename decltype(tag)::type>(a, stream, op);
  });
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

}  // namespace

void fp8_quantize_cuda(const TensorView& x, TensorView q, TensorView scales, TensorView q_t,
                       TensorView scales_t, const Fp8QuantizeOptions& options,
                       cudaStream_t stream) {
  const char* op = "fp8_quantize";
  const bool e4m3 = q.dtype == DType::kFloat8E4M3;
  const auto xr = detail::row_layout(x);
  const std::int64_t M = xr.rows, N = xr.cols;
  const bool transpose = q_t.defined();
  const float kMax = e4m3 ? kFp8Max<true> : kFp8Max<false>;
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
  const auto elem = static_cast<std::int64_t>(x.element_size());
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
        launch_quantize_tiles(a, x.dtype, e4m3, TileMode::kTile, true, stream, op);
      } else {
        launch_quantize_tile_rows(a, x.dtype, e4m3, stream, op);
      }
      return;
    case Fp8Granularity::kBlock128x128:
      launch_quantize_tiles(a, x.dtype, e4m3, TileMode::kBlock, transpose, stream, op);
      return;
    case Fp8Granularity::kRow:
      if (!transpose && (N + 7) / 8 <= kMaxRegisterChunks) {
        const RowArgs r{a.x, a.x_stride, a.q,   a.q_stride, s,
                        M,   N,          pow2,  a.x_vec,    a.q_vec, a.q_vec16};
        launch_quantize_rows(r, x.dtype, e4m3, stream, op);
        return;
      }
      zero(s, M, stream, op);
      if (transpose) zero(s_t, N, stream, op);
      launch_quantize_tiles(a, x.dtype, e4m3, TileMode::kAmaxRow, transpose, stream, op);
      finalize(s, M, kMax, pow2, nullptr, stream, op);
      if (transpose) finalize(s_t, N, kMax, pow2, nullptr, stream, op);
      launch_quantize_tiles(a, x.dtype, e4m3, TileMode::kGivenRow, transpose, stream, op);
      return;
    case Fp8Granularity::kTensor:
      zero(s, 1, stream, op);
      launch_tensor_amax(a, x.dtype, stream, op);
      finalize(s, 1, kMax, pow2, s_t, stream, op);
      launch_quantize_tiles(a, x.dtype, e4m3, TileMode::kGivenTensor, transpose, stream, op);
      return;
  }
}

}  // namespace trainscale::ops::fp8
