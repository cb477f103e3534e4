// FP8 dequantize: y = float(q) * s, the one float32 multiply (then one rounding to y's dtype)
// of include/trainscale/fp8.h, for every scale granularity. dequant_kernel: 2^k threads per row
// (up to 256), 8 codes per thread and step (one 8-byte load where rows allow), 16-byte stores.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_check.h"
#include "common/dtype.cuh"
#include "common/vec.cuh"
#include "ops/fp8/fp8_cuda.h"
#include "ops/fp8/fp8_internal.h"

namespace trainscale::ops::fp8 {
namespace {

struct DequantArgs {
  const std::uint8_t* q;
  std::int64_t q_stride;
  const float* scales;
  void* y;
  std::int64_t y_stride;
  std::int64_t rows, cols;
  // Element (i, j)'s scale: scales[m_major ? gj * pitch + gi : gi * across + gj] with
  // gi = i >> row_shift, gj = j >> col_shift (63 gives 0 for any index).
  int row_shift, col_shift;
  std::int64_t across, pitch;
  bool m_major;
  int lanes_log2;  // threads per row: 2^lanes_log2 (<= 256)
  bool q_vec, y_vec;
};

template <bool kE4M3>
__device__ __forceinline__ float2 decode2(unsigned short codes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(codes, kE4M3 ? __NV_E4M3 : __NV_E5M2);
  return __half22float2(__half2(h));  // exact: every fp8 value is a half
}

template <class T, bool kE4M3>
__global__ void __launch_bounds__(256) dequant_kernel(DequantArgs a) {
  const int lanes = 1 << a.lanes_log2;
  const int lane = threadIdx.x & (lanes - 1);
  const int rows_per_block = 256 >> a.lanes_log2;
  const std::int64_t chunks = (a.cols + 7) / 8;
  T* y = static_cast<T*>(a.y);
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * rows_per_block +
                          (threadIdx.x >> a.lanes_log2);
       row < a.rows; row += static_cast<std::int64_t>(gridDim.x) * rows_per_block) {
    const std::uint8_t* q_row = a.q + row * a.q_stride;
    T* y_row = y + row * a.y_stride;
    const std::int64_t gi = row >> a.row_shift;
    for (std::int64_t k = lane; k < chunks; k += lanes) {
      const std::int64_t col = k * 8;
      const std::int64_t gj = col >> a.col_shift;  // a chunk never straddles a 128-column tile
      const float s = a.scales[a.m_major ? gj * a.pitch + gi : gi * a.across + gj];
      const bool full = col + 8 <= a.cols;
      uint2 codes = make_uint2(0, 0);
      if (a.q_vec && full) {
        codes = *reinterpret_cast<const uint2*>(q_row + col);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if (col + e < a.cols) {
            const unsigned b = q_row[col + e];
            if (e < 4) codes.x |= b << (8 * e); else codes.y |= b << (8 * (e - 4));
          }
        }
      }
      float v[8];
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const unsigned w = p < 2 ? codes.x : codes.y;
        const float2 f = decode2<kE4M3>(static_cast<unsigned short>(w >> (16 * (p & 1))));
        v[2 * p] = __fmul_rn(f.x, s);  // one float32 multiply, then one rounding to T
        v[2 * p + 1] = __fmul_rn(f.y, s);
      }
      if (a.y_vec && full) {
        detail::store_floats<T, 8>(y_row + col, v);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if (col + e < a.cols) y_row[col + e] = detail::from_float<T>(v[e]);
        }
      }
    }
  }
}

}  // namespace

void fp8_dequantize_cuda(const TensorView& q, const TensorView& scales, TensorView y,
                         const Fp8QuantizeOptions& options, cudaStream_t stream) {
  const char* op = "fp8_dequantize";
  const auto qr = detail::row_layout(q);
  if (qr.rows == 0 || qr.cols == 0) return;
  DequantArgs a{};
  a.q = static_cast<const std::uint8_t*>(q.data);
  a.q_stride = qr.row_stride;
  a.scales = scales.ptr<const float>();
  a.y = y.data;
  a.y_stride = detail::row_layout(y).row_stride;
  a.rows = qr.rows;
  a.cols = qr.cols;
  const ScaleGrid grid = scale_grid(options, qr.rows, qr.cols);
  switch (options.granularity) {
    case Fp8Granularity::kTensor: a.row_shift = 63; a.col_shift = 63; break;
    case Fp8Granularity::kRow: a.row_shift = 0; a.col_shift = 63; break;
    case Fp8Granularity::kTile1x128: a.row_shift = 0; a.col_shift = 7; break;
    case Fp8Granularity::kBlock128x128: a.row_shift = 7; a.col_shift = 7; break;
  }
  a.across = grid.groups_across;
  a.m_major = grid.m_major;
  a.pitch = grid.m_major_pitch;
  const std::int64_t chunks = (qr.cols + 7) / 8;
  int lanes_log2 = 0;
  while (lanes_log2 < 8 && (std::int64_t{1} << lanes_log2) < chunks) ++lanes_log2;
  a.lanes_log2 = lanes_log2;
  a.q_vec = detail::rows_aligned(a.q, a.rows, a.q_stride, 8);
  const auto elem = static_cast<std::int64_t>(dtype_size(y.dtype));
  a.y_vec = detail::rows_aligned(a.y, a.rows, a.y_stride * elem, 16);
  const std::int64_t blocks = detail::grid_for_tiles(a.rows, 256 >> lanes_log2);
  detail::dispatch_activation_dtype(y.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (q.dtype == DType::kFloat8E4M3) {
      dequant_kernel<T, true><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(a);
    } else {
      dequant_kernel<T, false><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(a);
    }
  });
  detail::check_launch(op);
}

}  // namespace trainscale::ops::fp8
