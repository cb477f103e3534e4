// Host side of the attention forward for one head dim: the TMA descriptors of q, k and v, the
// kernel parameters, the persistent grid and the launch. Included by attention_fwd_hdim*.cu, each
// of which instantiates its head dim's variants (dtype x causal) only.
#pragma once

// wgmma atoms of every N that is a multiple of 8 (the score tiles are 176 and 80 keys wide);
// without it CuTe picks the largest of its default N that divides the tile (16 for both).
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "common/cuda_check.h"
#include "common/stream_scratch.h"
#include "core/check.h"
#include "ops/attention/attention_cuda.h"
#include "ops/attention/attention_dtype.cuh"
#include "ops/attention/attention_fwd_kernel.cuh"
#include "ops/attention/attention_heuristics.h"
#include "ops/attention/attention_internal.h"
#include "ops/attention/attention_tma_view.cuh"

namespace trainscale::ops::attention {

inline constexpr const char* kForwardOp = "attention_forward";

// Sk == 0: every query sees no key, out = 0 and lse = -inf. Any strides.
template <class Element>
__global__ void attention_forward_empty_kernel(Element* out, int64_t sb, int64_t ss, int64_t sh,
                                               int64_t S, int64_t H, int64_t D, int64_t count,
                                               float* lse, int64_t lse_count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t d = i % D, h = i / D % H, s = i / D / H % S, b = i / D / H / S;
    out[b * sb + s * ss + h * sh + d] = Element(0.f);
    if (lse != nullptr && i < lse_count) lse[i] = -INFINITY;
  }
}

// The kernel needs an sm_90a build and a compute capability 9.0 device.
inline void require_hopper(const void* kernel) {
#if !defined(TRAINSCALE_HAS_SM90A) || !TRAINSCALE_HAS_SM90A
  (void)kernel;
  detail::throw_op_error(kForwardOp,
                         "this build has no sm_90a code (TRAINSCALE_CUDA_ARCHS must include 90a); "
                         "the CUDA attention kernel runs on Hopper only");
#else
  require_device_for(kForwardOp, kernel, 9, /*or_newer=*/false, "a Hopper GPU (compute capability 9.0, sm_90a)");
#endif
}

template <class Element, int kHeadDim, bool kMasked>
void launch_forward(const TensorView& q, const TensorView& k, const TensorView& v, TensorView out,
                    TensorView lse, const AttentionOptions& options, cudaStream_t stream) {
  using namespace cute;
  using Traits = PlanTraits<Element, kHeadDim, kMasked>;
  constexpr ForwardPlan plan = forward_plan(kHeadDim, kMasked);
  static_assert(plan.block_m == Traits::kBlockM && plan.threads() == Traits::kThreads);
  auto* kernel = &attention_forward_kernel<Traits>;
  require_hopper(reinterpret_cast<const void*>(kernel));

  const int64_t batch = q.size(0), q_len = q.size(1), q_heads = q.size(2);
  const int64_t kv_len = k.size(1), kv_heads = k.size(2);
  if (batch == 0 || q_len == 0) return;
  float* lse_data = lse.defined() ? static_cast<float*>(lse.data) : nullptr;
  if (kv_len == 0) {
    const int64_t count = batch * q_len * q_heads * kHeadDim;
    const int blocks = static_cast<int>(std::min<int64_t>((count + 255) / 256, 4096));
    attention_forward_empty_kernel<Element><<<blocks, 256, 0, stream>>>(
        static_cast<Element*>(out.data), out.strides[0], out.strides[1], out.strides[2], q_len,
        q_heads, kHeadDim, count, lse_data, batch * q_heads * q_len);
    detail::check_launch(kForwardOp);
    return;
  }

  ForwardParams<Traits> p{};
  p.tma_q = make_tma_copy(SM90_TMA_LOAD{}, tma_view<Element>(q), typename Traits::SmemLayoutQ{},
                          Shape<Int<Traits::kBlockM>, Int<kHeadDim>>{}, _1{});
  p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, tma_view<Element>(k), take<0, 2>(typename Traits::SmemLayoutK{}),
                          Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{}, _1{});
  p.tma_v = make_tma_copy(SM90_TMA_LOAD{}, tma_view<Element>(v), take<0, 2>(typename Traits::SmemLayoutV{}),
                          Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{}, _1{});
  p.shape_q = make_shape(static_cast<int32_t>(q_len), kHeadDim, static_cast<int32_t>(q_heads),
                         static_cast<int32_t>(batch));
  p.shape_kv = make_shape(static_cast<int32_t>(kv_len), kHeadDim, static_cast<int32_t>(kv_heads),
                          static_cast<int32_t>(batch));
  p.out = out.data;
  p.out_stride_b = out.strides[0];
  p.out_stride_s = out.strides[1];
  p.out_stride_h = out.strides[2];
  auto out_aligned_to = [&](std::int64_t elements) {
    return reinterpret_cast<std::uintptr_t>(out.data) % (2 * elements) == 0 && out.strides[0] % elements == 0 &&
           out.strides[1] % elements == 0 && out.strides[2] % elements == 0;
  };
  p.out_vector = out_aligned_to(8) ? 8 : out_aligned_to(2) ? 2 : 1;
  p.lse = lse_data;
  p.q_len = static_cast<int>(q_len);
  p.kv_len = static_cast<int>(kv_len);
  p.q_heads = static_cast<int>(q_heads);
  p.group = static_cast<int>(q_heads / kv_heads);
  const double scale = resolved_scale(options, kHeadDim);
  p.abs_scale = static_cast<float>(std::fabs(scale));
  p.scale_log2 = static_cast<float>(std::fabs(scale) * M_LOG2E);
  p.negate_scores = scale < 0;
  p.softcap_unscaled = static_cast<float>(options.softcap / std::fabs(scale));
  p.mask = kernel_attention_mask(q_len, kv_len, options);

  const detail::DeviceInfo& info = detail::current_device_info();
  const int64_t kv_bytes_per_head = 2 * kv_len * kHeadDim * static_cast<int64_t>(sizeof(Element));
  p.scheduler.order = forward_tile_order(q_len, batch, q_heads, kv_heads, kv_bytes_per_head,
                                         static_cast<int64_t>(info.l2_bytes), plan);
  const int64_t grid = forward_grid(p.scheduler.order.tiles(), info.sm_count);
  if (forward_dynamic_schedule(options.schedule, plan.masked, kHeadDim, q_len)) {
    auto* counter = static_cast<unsigned long long*>(
        detail::stream_scratch(sizeof(unsigned long long), stream, kForwardOp, kForwardOp));
    detail::check_cuda(cudaMemsetAsync(counter, 0, sizeof *counter, stream), kForwardOp,
                       "cudaMemsetAsync (tile counter)");
    p.scheduler.counter = counter;
  }

  constexpr int kSmem = Traits::kSharedBytes;
  detail::check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
                     kForwardOp, "cudaFuncSetAttribute");
  kernel<<<static_cast<unsigned>(grid), Traits::kThreads, kSmem, stream>>>(p);
  detail::check_launch(kForwardOp);
}

// The variants of one head dim: dtype x masked (causal or a window).
template <int kHeadDim>
void dispatch_forward(const TensorView& q, const TensorView& k, const TensorView& v, TensorView out,
                      TensorView lse, const AttentionOptions& options, cudaStream_t stream) {
  with_element_type(q.dtype, kForwardOp, [&](auto tag) {
    using Element = typename decltype(tag)::type;
    if (attention_is_masked(options)) {
      launch_forward<Element, kHeadDim, true>(q, k, v, out, lse, options, stream);
    } else {
      launch_forward<Element, kHeadDim, false>(q, k, v, out, lse, options, stream);
    }
  });
}

}  // namespace trainscale::ops::attention
