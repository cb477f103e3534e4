// The optimizer family's CUDA kernels: AdamW, the global gradient norm and the scaling by a
// device factor, one launch per tensor. They stream their tensors once; a thread takes one
// 16-byte unit of the parameter (8 elements of 16 bits, 4 of float32) and the same elements of
// the other tensors, and the grid covers the tensor (common/cuda_check.h: a grid as large as the
// work streams best).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "common/cuda_check.h"
#include "common/dtype.cuh"
#include "common/elementwise.cuh"
#include "common/reduce.cuh"
#include "common/vec.cuh"
#include "ops/optim/optim_internal.h"

namespace trainscale::ops::optim {
namespace {

constexpr int kThreads = 256;

struct AdamWKernelScalars {
  float one_minus_beta1, beta2, one_minus_beta2, eps, decay, step_size, inv_sqrt_bc2;
};

// Elements [i, i + N) of one tensor: N = the unit's width on the vector path, 1 for the tail
// and for tensors whose pointers are not all 16-byte aligned.
template <int N, class P, class S>
__device__ __forceinline__ void adamw_elements(P* param, const P* grad, S* exp_avg, S* exp_avg_sq, std::int64_t i,
                                               const AdamWKernelScalars& s, float scale) {
  float p[N], g[N], m[N], v[N];
  detail::load_floats<P, N>(grad + i, g);
  detail::load_floats<S, N>(exp_avg + i, m);
  detail::load_floats<S, N>(exp_avg_sq + i, v);
  detail::load_floats<P, N>(param + i, p);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float gj = g[j] * scale;
    m[j] = fmaf(s.one_minus_beta1, gj - m[j], m[j]);
    v[j] = fmaf(s.beta2, v[j], s.one_minus_beta2 * gj * gj);
    p[j] = p[j] * s.decay - s.step_size * m[j] / fmaf(sqrtf(v[j]), s.inv_sqrt_bc2, s.eps);
  }
  detail::store_floats<S, N>(exp_avg + i, m);
  detail::store_floats<S, N>(exp_avg_sq + i, v);
  detail::store_floats<P, N>(param + i, p);
}

// The units of detail::for_each_unit (kVec elements; the tail one by one).
template <int kVec, class P, class S>
__global__ void __launch_bounds__(kThreads) adamw_kernel(P* param, const P* grad, S* exp_avg, S* exp_avg_sq,
                                                         std::int64_t n, AdamWKernelScalars s, const float* grad_scale) {
  const float scale = grad_scale != nullptr ? *grad_scale : 1.0f;
  detail::for_each_unit<kVec>(n, [&](std::int64_t i, auto width) {
    adamw_elements<decltype(width)::value>(param, grad, exp_avg, exp_avg_sq, i, s, scale);
  });
}

bool aligned16(const TensorView& t) { return detail::is_aligned(t.data, 16); }

template <class P, class S>
void launch_adamw(const TensorView& p, const TensorView& g, const TensorView& m, const TensorView& v,
                  const AdamWKernelScalars& s, const float* grad_scale, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(P);
  const std::int64_t n = p.numel();
  const bool vector = aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v);
  const std::int64_t work = vector ? n / kVec + n % kVec : n;
  const auto grid = static_cast<unsigned>(detail::grid_for_tiles(work, kThreads));
  auto args = [&](auto kernel) {
    kernel<<<grid, kThreads, 0, stream>>>(p.ptr<P>(), g.ptr<const P>(), m.ptr<S>(), v.ptr<S>(), n, s, grad_scale);
  };
  if (vector) {
    args(adamw_kernel<kVec, P, S>);
  } else {
    args(adamw_kernel<1, P, S>);
  }
  detail::check_launch("adamw_step");
}

// Sums of squares: a fixed grid per tensor (a function of its size), one float64 partial per
// block, reduced by one block in a fixed order. Each thread squares and sums a unit in float32
// and adds it to a float64 total, so a 500M-element gradient loses nothing to a long float sum.
constexpr int kNormUnitsPerThread = 4;
constexpr std::int64_t kNormMaxBlocks = 1024;

std::int64_t norm_blocks(std::int64_t n) {
  const std::int64_t per_block = static_cast<std::int64_t>(kThreads) * kNormUnitsPerThread * 8;
  return std::min((n + per_block - 1) / per_block, kNormMaxBlocks);
}

template <int kVec, class T>
__global__ void __launch_bounds__(kThreads) sum_squares_kernel(const T* g, std::int64_t n, double* partials) {
  __shared__ double scratch[kThreads / 32];
  double total[1] = {0.0};
  detail::for_each_unit<kVec>(n, [&](std::int64_t i, auto width) {
    constexpr int kWidth = decltype(width)::value;
    float x[kWidth], sum = 0.0f;
    detail::load_floats<T, kWidth>(g + i, x);
#pragma unroll
    for (int j = 0; j < kWidth; ++j) sum = fmaf(x[j], x[j], sum);
    total[0] += sum;
  });
  detail::row_reduce<kThreads, detail::SumOp>(total, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = total[0];
}

__global__ void __launch_bounds__(kThreads) norm_finish_kernel(const double* partials, std::int64_t count,
                                                               double max_norm, float* norm, float* clip_factor) {
  __shared__ double scratch[kThreads / 32];
  double total[1] = {0.0};
  for (std::int64_t i = threadIdx.x; i < count; i += kThreads) total[0] += partials[i];
  detail::row_reduce<kThreads, detail::SumOp>(total, scratch);
  if (threadIdx.x == 0) {
    const double root = sqrt(total[0]);
    *norm = static_cast<float>(root);
    *clip_factor = static_cast<float>(clip_factor_of(root, max_norm));
  }
}

template <class T>
void launch_sum_squares(const TensorView& g, double* partials, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const std::int64_t n = g.numel();
  const auto grid = static_cast<unsigned>(norm_blocks(n));
  if (aligned16(g)) {
    sum_squares_kernel<kVec, T><<<grid, kThreads, 0, stream>>>(g.ptr<const T>(), n, partials);
  } else {
    sum_squares_kernel<1, T><<<grid, kThreads, 0, stream>>>(g.ptr<const T>(), n, partials);
  }
  detail::check_launch("grad_norm");
}

// Every block reads the factor first and returns at exactly 1, so the common case costs one
// launch and no traffic; the grid is capped at a few resident waves for the same reason.
template <int kVec, class T>
__global__ void __launch_bounds__(kThreads) scale_kernel(T* x, std::int64_t n, const float* factor) {
  const float f = *factor;
  if (f == 1.0f) return;
  detail::for_each_unit<kVec>(n, [&](std::int64_t i, auto width) {
    constexpr int kWidth = decltype(width)::value;
    float v[kWidth];
    detail::load_floats<T, kWidth>(x + i, v);
#pragma unroll
    for (int j = 0; j < kWidth; ++j) v[j] *= f;
    detail::store_floats<T, kWidth>(x + i, v);
  });
}

template <class T>
void launch_scale(const TensorView& t, const float* factor, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kWaves = 4, kBlocksPerSm = 2048 / kThreads;
  const std::int64_t n = t.numel();
  const bool vector = aligned16(t);
  const std::int64_t cap = static_cast<std::int64_t>(detail::current_device_info().sm_count) * kBlocksPerSm * kWaves;
  const auto grid = static_cast<unsigned>(
      std::min(detail::grid_for_tiles(vector ? n / kVec + n % kVec : n, kThreads), cap));
  if (vector) {
    scale_kernel<kVec, T><<<grid, kThreads, 0, stream>>>(t.ptr<T>(), n, factor);
  } else {
    scale_kernel<1, T><<<grid, kThreads, 0, stream>>>(t.ptr<T>(), n, factor);
  }
  detail::check_launch("scale_by_device_factor");
}

template <class F>
void dispatch_float(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(float{}); break;
    case DType::kFloat16: f(__half{}); break;
    case DType::kBFloat16: f(__nv_bfloat16{}); break;
    default: throw Error(std::string("trainscale: optimizer kernels for ") + dtype_name(dtype) + " do not exist");
  }
}

std::int64_t partial_count(std::span<const TensorView> grads) {
  std::int64_t count = 0;
  for (const TensorView& g : grads) count += norm_blocks(g.numel());
  return count;
}

}  // namespace

void adamw_step_cuda(std::span<const TensorView> params, std::span<const TensorView> grads,
                     std::span<const TensorView> exp_avgs, std::span<const TensorView> exp_avg_sqs,
                     const AdamWOptions& options, const TensorView& grad_scale, cudaStream_t stream) {
  const AdamWScalars d = adamw_scalars(options);
  const AdamWKernelScalars s{static_cast<float>(1.0 - options.beta1), static_cast<float>(options.beta2),
                             static_cast<float>(1.0 - options.beta2),  static_cast<float>(options.eps),
                             static_cast<float>(d.decay),              static_cast<float>(d.step_size),
                             static_cast<float>(d.inv_sqrt_bc2)};
  const float* scale = grad_scale.defined() ? grad_scale.ptr<const float>() : nullptr;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) continue;
    dispatch_float(params[i].dtype, [&](auto p) {
      using P = decltype(p);
      if (exp_avgs[i].dtype == DType::kFloat32) {
        launch_adamw<P, float>(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], s, scale, stream);
      } else {
        launch_adamw<P, P>(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], s, scale, stream);
      }
    });
  }
}

std::size_t grad_norm_workspace_bytes_cuda(std::span<const TensorView> grads) {
  return static_cast<std::size_t>(partial_count(grads)) * sizeof(double);
}

void grad_norm_cuda(std::span<const TensorView> grads, double max_norm, TensorView norm, TensorView clip_factor,
                    TensorView workspace, cudaStream_t stream) {  // workspace checked by grad_norm
  auto* partials = workspace.defined() ? static_cast<double*>(workspace.data) : nullptr;
  std::int64_t offset = 0;
  for (const TensorView& g : grads) {
    if (g.numel() == 0) continue;
    dispatch_float(g.dtype, [&](auto t) { launch_sum_squares<decltype(t)>(g, partials + offset, stream); });
    offset += norm_blocks(g.numel());
  }
  norm_finish_kernel<<<1, kThreads, 0, stream>>>(partials, offset, max_norm, norm.ptr<float>(),
                                                 clip_factor.ptr<float>());
  detail::check_launch("grad_norm");
}

void scale_by_device_factor_cuda(std::span<const TensorView> tensors, const TensorView& factor, cudaStream_t stream) {
  for (const TensorView& t : tensors) {
    if (t.numel() == 0) continue;
    dispatch_float(t.dtype, [&](auto v) { launch_scale<decltype(v)>(t, factor.ptr<const float>(), stream); });
  }
}

}  // namespace trainscale::ops::optim
