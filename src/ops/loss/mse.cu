// MSE kernels. Elementwise parts (kNone forward, every backward) use the shared elementwise
// kernel (common/elementwise.cuh); the mean / sum forward is one cluster-wide reduction.
//
// Why a cluster: the reduction must be deterministic, take no workspace and stay safe when
// several streams run MSE at once, so partial sums cannot live in global memory (a static
// __device__ buffer or counter would be shared by concurrent calls). One thread-block cluster
// of 8 blocks x 1024 threads (the portable cluster size) keeps every partial on chip: each
// thread sums a fixed set of elements (fp32 within a 16-byte unit, fp64 across units), each
// block reduces its threads in a fixed tree, and block 0 adds the 8 block sums in rank order
// through distributed shared memory. Same inputs and layout -> same bits, whatever the stream.
// It reads with 8 SMs, not the whole GPU (see loss_cuda.h and the report on its bandwidth),
// which is acceptable for a loss that is a small part of a training step.
#include <cooperative_groups.h>

#include <array>
#include <type_traits>

#include "common/elementwise.cuh"
#include "common/reduce.cuh"
#include "ops/loss/loss_cuda.h"

namespace trainscale::ops::loss {
namespace {

namespace cg = cooperative_groups;
using detail::StridedRows;
using detail::UnitPos;
using detail::UnitWalk;

// (a, b) -> ((a - b)^2)
struct SquaredDiff {
  static constexpr int kIn = 2, kOut = 1;
  __device__ void operator()(const float (&in)[2], float (&out)[1]) const {
    const float d = in[0] - in[1];
    out[0] = d * d;
  }
};

// g = 2 (a - b) grad_out; outputs (g, -g) for kOut == 2, else sign * g.
template <int kOutputs>
struct GradFromTensor {  // (grad_out, a, b) -> ...
  static constexpr int kIn = 3, kOut = kOutputs;
  float sign;
  __device__ void operator()(const float (&in)[3], float (&out)[kOut]) const {
    const float g = 2.f * (in[1] - in[2]) * in[0];
    if constexpr (kOut == 2) {
      out[0] = g;
      out[1] = -g;
    } else {
      out[0] = sign * g;
    }
  }
};

// g = factor * grad_out * (a - b) with the scalar grad_out read on the device once per thread.
template <int kOutputs>
struct GradFromScalar {  // (a, b) -> ...
  static constexpr int kIn = 2, kOut = kOutputs;
  const float* grad_out;
  float factor;  // 2, or 2 / numel for the mean
  float sign;
  __device__ GradFromScalar bind() const {
    GradFromScalar bound = *this;
    bound.factor = factor * *grad_out;
    return bound;
  }
  __device__ void operator()(const float (&in)[2], float (&out)[kOut]) const {
    const float g = factor * (in[0] - in[1]);
    if constexpr (kOut == 2) {
      out[0] = g;
      out[1] = -g;
    } else {
      out[0] = sign * g;
    }
  }
};

constexpr int kReduceBlocks = 8;  // one cluster
constexpr int kReduceThreads = 1024;
// 4 independent 16-byte loads in flight per thread (an unroll of 4 spilled at the 64-register
// cap of 1024-thread blocks).
constexpr int kReduceUnroll = 2;

// out[0] = sum over rows x cols of (a - b)^2, divided by `divisor` (1 for the sum).
template <class T, int V>
__global__ void __cluster_dims__(kReduceBlocks, 1, 1) __launch_bounds__(kReduceThreads)
    mse_reduce_kernel(const T* a, std::int64_t a_stride, const T* b, std::int64_t b_stride,
                      const UnitWalk w, float* out, double divisor) {
  using detail::load_raw;
  using detail::to_float;
  double acc = 0.0;
  for (UnitPos p = detail::walk_start<kReduceThreads, kReduceUnroll>(w); p.i < w.rows;) {
    UnitPos q[kReduceUnroll];
    detail::tile_positions(w, p, q);
    detail::Vec<T, V> xa[kReduceUnroll], xb[kReduceUnroll];
#pragma unroll
    for (int k = 0; k < kReduceUnroll; ++k) {
      if (q[k].i >= w.rows) continue;
      xa[k] = load_raw<T, V>(a + q[k].i * a_stride + q[k].j * V);
      xb[k] = load_raw<T, V>(b + q[k].i * b_stride + q[k].j * V);
    }
#pragma unroll
    for (int k = 0; k < kReduceUnroll; ++k) {
      if (q[k].i >= w.rows) continue;
      float s = 0.f;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float d = to_float(xa[k].v[e]) - to_float(xb[k].v[e]);
        s = fmaf(d, d, s);
      }
      acc += s;
    }
    p = q[kReduceUnroll - 1];
    detail::advance(p, w.grid_step, w.units);
  }
  if constexpr (V > 1) {  // the last cols % V elements of every row
    const std::int64_t count = w.rows * w.tail;
    const std::int64_t first = w.units * V;
    for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kReduceThreads + threadIdx.x;
         t < count; t += static_cast<std::int64_t>(kReduceBlocks) * kReduceThreads) {
      const std::int64_t i = t / w.tail;
      const std::int64_t j = first + (t - i * w.tail);
      const float d = to_float(a[i * a_stride + j]) - to_float(b[i * b_stride + j]);
      acc += d * d;
    }
  }
  // Block: a fixed shuffle tree per warp, then one over the 32 warp sums.
  __shared__ double warp_sums[kReduceThreads / 32];
  __shared__ double block_sum;
  double sums[1] = {acc};
  detail::row_reduce<kReduceThreads, detail::SumOp>(sums, warp_sums);
  if (threadIdx.x == 0) block_sum = sums[0];
  // Cluster: block 0 adds the block sums in rank order; the second sync keeps every block's
  // shared memory alive until it has read them.
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  if (cluster.block_rank() == 0 && threadIdx.x == 0) {
    double total = 0.0;
    for (unsigned r = 0; r < kReduceBlocks; ++r) total += *cluster.map_shared_rank(&block_sum, r);
    out[0] = static_cast<float>(total / divisor);
  }
  cluster.sync();
}

std::int64_t row_stride(const TensorView& t) { return detail::row_layout(t).row_stride; }

template <class T>
void launch_reduce(const char* op, std::int64_t rows, std::int64_t cols, const StridedRows& a,
                   const StridedRows& b, float* out, double divisor, cudaStream_t stream) {
  const detail::ElementwisePlan plan =
      detail::plan_elementwise(rows, cols, std::array{a, b}, sizeof(T));
  const auto launch = [&](auto vec) {
    constexpr int V = decltype(vec)::value;
    // Empty inputs still launch: the sum is 0 and the mean 0 / 0 = NaN, as in the reference.
    const UnitWalk w =
        detail::make_walk(plan.rows, plan.cols, V, kReduceBlocks, kReduceThreads, kReduceUnroll);
    mse_reduce_kernel<T, V><<<kReduceBlocks, kReduceThreads, 0, stream>>>(
        static_cast<const T*>(a.data), a.row_stride, static_cast<const T*>(b.data),
        b.row_stride, w, out, divisor);
    detail::check_launch(op);
  };
  if (plan.vectorized) {
    launch(std::integral_constant<int, detail::kVec16<T>>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

}  // namespace

void mse_forward_cuda(const TensorView& a, const TensorView& b, TensorView out,
                      Reduction reduction, cudaStream_t stream) {
  const char* op = "mse_forward";
  const detail::Rows shape = detail::row_layout(a);
  const StridedRows in_a{a.data, shape.row_stride}, in_b{b.data, row_stride(b)};
  detail::dispatch_activation_dtype(a.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (reduction == Reduction::kNone) {
      detail::launch_elementwise<T>(op, shape.rows, shape.cols, {in_a, in_b},
                                    {StridedRows{out.data, row_stride(out)}},
                                    SquaredDiff{}, stream);
    } else {
      const double numel = static_cast<double>(shape.rows) * static_cast<double>(shape.cols);
      launch_reduce<T>(op, shape.rows, shape.cols, in_a, in_b, static_cast<float*>(out.data),
                       reduction == Reduction::kMean ? numel : 1.0, stream);
    }
  });
}

void mse_backward_cuda(const TensorView& grad_out, const TensorView& a, const TensorView& b,
                       TensorView grad_a, TensorView grad_b, Reduction reduction,
                       cudaStream_t stream) {
  const char* op = "mse_backward";
  if (!grad_a.defined() && !grad_b.defined()) return;
  const detail::Rows shape = detail::row_layout(a);
  const StridedRows in_a{a.data, shape.row_stride}, in_b{b.data, row_stride(b)};
  // The outputs given: (grad_a, grad_b) -> (g, -g); only one -> sign * g.
  std::array<StridedRows, 2> outs{};
  int n_out = 0;
  if (grad_a.defined()) outs[n_out++] = {grad_a.data, row_stride(grad_a)};
  if (grad_b.defined()) outs[n_out++] = {grad_b.data, row_stride(grad_b)};
  const float sign = grad_a.defined() ? 1.f : -1.f;
  detail::dispatch_activation_dtype(a.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto run = [&](auto outputs) {
      constexpr int kOut = decltype(outputs)::value;
      std::array<StridedRows, kOut> out_rows{};
      for (int n = 0; n < kOut; ++n) out_rows[n] = outs[n];
      if (reduction == Reduction::kNone) {
        const StridedRows in_g{grad_out.data, row_stride(grad_out)};
        detail::launch_elementwise<T>(op, shape.rows, shape.cols, {in_g, in_a, in_b}, out_rows,
                                      GradFromTensor<kOut>{sign}, stream);
      } else {
        const double numel = static_cast<double>(shape.rows) * static_cast<double>(shape.cols);
        const double factor = reduction == Reduction::kMean ? 2.0 / numel : 2.0;
        detail::launch_elementwise<T>(
            op, shape.rows, shape.cols, {in_a, in_b}, out_rows,
            GradFromScalar<kOut>{static_cast<const float*>(grad_out.data),
                                 static_cast<float>(factor), sign},
            stream);
      }
    };
    if (n_out == 2) {
      run(std::integral_constant<int, 2>{});
    } else {
      run(std::integral_constant<int, 1>{});
    }
  });
}

}  // namespace trainscale::ops::loss
