// Forward kernels: RMSNorm, fused add + RMSNorm (in place) and LayerNorm share one row kernel.
#include "core/check.h"
#include "ops/norm/norm_common.cuh"

namespace trainscale::ops::norm {
namespace {

using detail::load_floats;
using detail::load_param;
using detail::row_sum;
using detail::store_floats;
using detail::to_float;
using detail::from_float;

constexpr int kForwardBlock = 256;

struct ForwardArgs {
  const void* x;
  std::int64_t x_stride;
  void* residual;  // fused add: read, then overwritten with x + residual
  std::int64_t residual_stride;
  const void* weight;
  bool weight_f32;
  const void* bias;
  bool bias_f32;
  void* y;
  std::int64_t y_stride;
  float* mean;
  float* rstd;
  std::int64_t rows;
  std::int64_t cols;
  float eps;
  float weight_offset;
};

template <class T>
__device__ __forceinline__ float load_shift(const ForwardArgs& a, std::int64_t col) {
  return a.bias ? load_param<T>(a.bias, a.bias_f32, col) : 0.f;
}

// x (+ residual, rounded to the residual's dtype and written back) for V elements at col.
template <class T, class R, int V>
__device__ __forceinline__ void load_input(const ForwardArgs& a, std::int64_t row,
                                           std::int64_t col, float (&v)[V]) {
  load_floats<T, V>(static_cast<const T*>(a.x) + row * a.x_stride + col, v);
  if constexpr (!std::is_void_v<R>) {
    R* r_ptr = static_cast<R*>(a.residual) + row * a.residual_stride + col;
    float r[V];
    load_floats<R, V>(r_ptr, r);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = to_float(from_float<R>(v[j] + r[j]));
    store_floats<R, V>(r_ptr, v);
  }
}

// Whole row in registers: kThreads threads per row, kVecs vectors of V elements each.
template <class T, class R, Kind kKind, int kThreads, int kVecs>
__global__ void __launch_bounds__(kThreads > kForwardBlock ? kThreads : kForwardBlock)
    forward_registers_kernel(ForwardArgs a) {
  constexpr int V = detail::kVec16<T>;
  constexpr int kBlock = kThreads > kForwardBlock ? kThreads : kForwardBlock;
  constexpr int kRowsPerBlock = kBlock / kThreads;
  __shared__ float scratch[kThreads > 32 ? kBlock / 32 : 1];
  const int lane = threadIdx.x % kThreads;
  const int slot = threadIdx.x / kThreads;
  const std::int64_t n = a.cols;

  float scale[kVecs][V];
  float shift[kKind == Kind::kLayer ? kVecs : 1][V];
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const std::int64_t col = (static_cast<std::int64_t>(i) * kThreads + lane) * V;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const bool in = col + j < n;
      scale[i][j] = in ? load_scale<T, kKind>(a, col + j) : 0.f;
      if constexpr (kKind == Kind::kLayer) shift[i][j] = in ? load_shift<T>(a, col + j) : 0.f;
    }
  }

  // Every thread of a block runs the same number of iterations: the reductions need them all.
  for (std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock; base < a.rows;
       base += static_cast<std::int64_t>(gridDim.x) * kRowsPerBlock) {
    const std::int64_t row = base + slot;
    const bool valid = row < a.rows;
    float v[kVecs][V];
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const std::int64_t col = (static_cast<std::int64_t>(i) * kThreads + lane) * V;
      if (valid && col < n) {
        load_input<T, R, V>(a, row, col, v[i]);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) v[i][j] = 0.f;
      }
    }
    float mean = 0.f;
    float sums[1] = {0.f};
    if constexpr (kKind == Kind::kLayer) {
#pragma unroll
      for (int i = 0; i < kVecs; ++i)
#pragma unroll
        for (int j = 0; j < V; ++j) sums[0] += v[i][j];
      row_sum<kThreads, 1>(sums, scratch);
      mean = sums[0] / static_cast<float>(n);
      sums[0] = 0.f;
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const std::int64_t col = (static_cast<std::int64_t>(i) * kThreads + lane) * V;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float d = v[i][j] - mean;
          sums[0] += col + j < n ? d * d : 0.f;
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < kVecs; ++i)
#pragma unroll
        for (int j = 0; j < V; ++j) sums[0] += v[i][j] * v[i][j];
    }
    row_sum<kThreads, 1>(sums, scratch);
    const float rstd = rsqrtf(sums[0] / static_cast<float>(n) + a.eps);
    if (!valid) continue;
    T* y_row = static_cast<T*>(a.y) + row * a.y_stride;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const std::int64_t col = (static_cast<std::int64_t>(i) * kThreads + lane) * V;
      if (col >= n) continue;
      float out[V];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if constexpr (kKind == Kind::kLayer) {
          out[j] = (v[i][j] - mean) * rstd * scale[i][j] + shift[i][j];
        } else {
          out[j] = v[i][j] * rstd * scale[i][j];
        }
      }
      store_floats<T, V>(y_row + col, out);
    }
    if (lane == 0) {
      if (a.rstd) a.rstd[row] = rstd;
      if (a.mean) a.mean[row] = mean;
    }
  }
}

// Any row length and alignment: one block per row, pass 1 reduces, pass 2 re-reads (mostly
// from L2) and writes. V is the vector width when rows are aligned, else 1.
template <class T, class R, Kind kKind, int V>
__global__ void __launch_bounds__(kTwoPassThreads) forward_two_pass_kernel(ForwardArgs a) {
  __shared__ float scratch[kTwoPassThreads / 32 * 3];
  const std::int64_t n = a.cols;
  constexpr std::int64_t kStep = static_cast<std::int64_t>(kTwoPassThreads) * V;
  for (std::int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    // LayerNorm sums are shifted by the row's first input, which keeps E[x^2] - E[x]^2 exact
    // enough when |mean| >> std. Read before pass 1 rewrites the residual.
    float pivot = 0.f;
    if constexpr (kKind == Kind::kLayer) {
      pivot = to_float(static_cast<const T*>(a.x)[row * a.x_stride]);
      if constexpr (!std::is_void_v<R>) {
        pivot = to_float(from_float<R>(
            pivot + to_float(static_cast<const R*>(a.residual)[row * a.residual_stride])));
      }
      __syncthreads();
    }
    // sums: x (for the mean), x - pivot and (x - pivot)^2 (for the variance). The mean is not
    // pivot + mean(x - pivot): that sum cancels when the mean is near 0.
    float sums[3] = {0.f, 0.f, 0.f};
    for (std::int64_t col = threadIdx.x * V; col < n; col += kStep) {
      float v[V];
      load_input<T, R, V>(a, row, col, v);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float d = v[j] - pivot;
        sums[0] += v[j];
        sums[1] += d;
        sums[2] += d * d;
      }
    }
    row_sum<kTwoPassThreads, 3>(sums, scratch);  // its barriers also publish the residual
    const float inv_n = 1.f / static_cast<float>(n);
    const float mean_shifted = kKind == Kind::kLayer ? sums[1] * inv_n : 0.f;
    // Clamp the rounding-negative variance without fmaxf, which would turn NaN into 0.
    const float raw_var = sums[2] * inv_n - mean_shifted * mean_shifted;
    const float var = raw_var < 0.f ? 0.f : raw_var;
    const float mean = kKind == Kind::kLayer ? sums[0] * inv_n : 0.f;
    const float rstd = rsqrtf(var + a.eps);
    T* y_row = static_cast<T*>(a.y) + row * a.y_stride;
    for (std::int64_t col = threadIdx.x * V; col < n; col += kStep) {
      float v[V];
      if constexpr (std::is_void_v<R>) {
        load_floats<T, V>(static_cast<const T*>(a.x) + row * a.x_stride + col, v);
      } else {
        load_floats<R, V>(static_cast<const R*>(a.residual) + row * a.residual_stride + col, v);
      }
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float s = load_scale<T, kKind>(a, col + j);
        v[j] = kKind == Kind::kLayer ? (v[j] - mean) * rstd * s + load_shift<T>(a, col + j)
                                     : v[j] * rstd * s;
      }
      store_floats<T, V>(y_row + col, v);
    }
    if (threadIdx.x == 0) {
      if (a.rstd) a.rstd[row] = rstd;
      if (a.mean) a.mean[row] = mean;
    }
  }
}

template <class T, class R, Kind kKind>
void launch_forward(const ForwardArgs& a, NormVariant variant, cudaStream_t stream,
                    const char* op) {
  if (a.rows == 0) return;
  constexpr int V = detail::kVec16<T>;
  const std::int64_t vecs = (a.cols + V - 1) / V;
  bool aligned = a.cols % V == 0 && rows_vectorizable(a.x, a.x_stride, sizeof(T)) &&
                 rows_vectorizable(a.y, a.y_stride, sizeof(T));
  if constexpr (!std::is_void_v<R>) {
    aligned = aligned && rows_vectorizable(a.residual, a.residual_stride, sizeof(R));
  }
  if (use_registers(variant, aligned, vecs, kMaxRegisterVecs<kForwardVecsPerThread>)) {
    with_register_config<kForwardVecsPerThread>(vecs, [&](auto threads, auto per_thread) {
      constexpr int kThreads = decltype(threads)::value;
      constexpr int kBlock = kThreads > kForwardBlock ? kThreads : kForwardBlock;
      constexpr int kRowsPerBlock = kBlock / kThreads;
      const std::int64_t grid =
          blocks_for((a.rows + kRowsPerBlock - 1) / kRowsPerBlock, 2048 / kBlock);
      forward_registers_kernel<T, R, kKind, kThreads, decltype(per_thread)::value>
          <<<static_cast<unsigned>(grid), kBlock, 0, stream>>>(a);
    });
  } else if (aligned) {
    forward_two_pass_kernel<T, R, kKind, V>
        <<<static_cast<unsigned>(blocks_for(a.rows, 4)), kTwoPassThreads, 0, stream>>>(a);
  } else {
    forward_two_pass_kernel<T, R, kKind, 1>
        <<<static_cast<unsigned>(blocks_for(a.rows, 4)), kTwoPassThreads, 0, stream>>>(a);
  }
  detail::check_launch(op);
}

ForwardArgs make_args(const char* op, const TensorView& x, const TensorView& weight,
                      const TensorView& bias, TensorView y, TensorView mean, TensorView rstd) {
  detail::OpChecker c(op);
  const auto xr = c.rows(x, "x");
  const auto yr = c.rows(y, "y");
  ForwardArgs a{};
  a.x = x.data;
  a.x_stride = xr.row_stride;
  a.weight = weight.defined() ? weight.data : nullptr;
  a.weight_f32 = weight.defined() && weight.dtype == DType::kFloat32;
  a.bias = bias.defined() ? bias.data : nullptr;
  a.bias_f32 = bias.defined() && bias.dtype == DType::kFloat32;
  a.y = y.data;
  a.y_stride = yr.row_stride;
  a.mean = mean.defined() ? mean.ptr<float>() : nullptr;
  a.rstd = rstd.defined() ? rstd.ptr<float>() : nullptr;
  a.rows = xr.rows;
  a.cols = xr.cols;
  return a;
}

}  // namespace

void rmsnorm_forward_cuda(const TensorView& x, const TensorView& weight, TensorView y,
                          TensorView rstd, const RMSNormOptions& options, cudaStream_t stream,
                          NormVariant variant) {
  ForwardArgs a = make_args("rmsnorm_forward", x, weight, {}, y, {}, rstd);
  a.eps = static_cast<float>(options.eps);
  a.weight_offset = static_cast<float>(options.weight_offset);
  detail::dispatch_activation_dtype(x.dtype, "rmsnorm_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_forward<T, void, Kind::kRms>(a, variant, stream, "rmsnorm_forward");
  });
}

void fused_add_rmsnorm_forward_cuda(TensorView x, TensorView residual, const TensorView& weight,
                                    TensorView rstd, const RMSNormOptions& options,
                                    cudaStream_t stream, NormVariant variant) {
  const char* op = "fused_add_rmsnorm_forward";
  ForwardArgs a = make_args(op, x, weight, {}, x, {}, rstd);
  a.residual = residual.data;
  a.residual_stride = detail::OpChecker(op).rows(residual, "residual").row_stride;
  a.eps = static_cast<float>(options.eps);
  a.weight_offset = static_cast<float>(options.weight_offset);
  detail::dispatch_activation_dtype(x.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (residual.dtype == DType::kFloat32) {
      launch_forward<T, float, Kind::kRms>(a, variant, stream, op);
    } else {
      launch_forward<T, T, Kind::kRms>(a, variant, stream, op);
    }
  });
}

void layernorm_forward_cuda(const TensorView& x, const TensorView& weight, const TensorView& bias,
                            TensorView y, TensorView mean, TensorView rstd,
                            const LayerNormOptions& options, cudaStream_t stream,
                            NormVariant variant) {
  ForwardArgs a = make_args("layernorm_forward", x, weight, bias, y, mean, rstd);
  a.eps = static_cast<float>(options.eps);
  detail::dispatch_activation_dtype(x.dtype, "layernorm_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_forward<T, void, Kind::kLayer>(a, variant, stream, "layernorm_forward");
  });
}

}  // namespace trainscale::ops::norm
