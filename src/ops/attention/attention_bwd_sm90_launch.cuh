// Host side of the Hopper attention backward for one head dim: the workspace's parts, the TMA
// descriptors, and four launches on the caller's stream: the preprocess (delta and lse * log2(e),
// attention_bwd_kernel.cuh), zeroing dQ's accumulator and counters, the dK/dV/dQ kernel
// (attention_bwd_sm90_kernel.cuh) and the dQ postprocess (attention_bwd_sm90_epilogue.cuh).
// Included by attention_bwd_sm90_hdim*.cu, each of which instantiates its head dim's two dtypes.
#pragma once

#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "common/cuda_check.h"
#include "core/check.h"
#include "ops/attention/attention_bwd_launch.cuh"
#include "ops/attention/attention_bwd_sm90_kernel.cuh"
#include "ops/attention/attention_tma_view.cuh"

namespace trainscale::ops::attention {

template <class Element, int kHeadDim>
void launch_backward_sm90(const AttentionBackwardArgs& args, const AttentionOptions& options,
                          cudaStream_t stream) {
  using namespace cute;
  constexpr BackwardSm90Plan plan = backward_sm90_plan(kHeadDim);
  static_assert(plan.supported());
  using Traits = BackwardSm90Traits<Element, kHeadDim, plan.block_m, plan.block_n, plan.stages>;
  auto* kernel = &attention_backward_sm90_kernel<Traits>;
  auto* dq_kernel = &attention_backward_sm90_dq_kernel<Traits>;
  require_device_for(kBackwardOp, reinterpret_cast<const void*>(kernel), 9, /*or_newer=*/false,
                     "a Hopper GPU (compute capability 9.0, sm_90a)");

  const TensorView& q = args.q;
  const int64_t batch = q.size(0), q_len = q.size(1), q_heads = q.size(2);
  const int64_t kv_len = args.k.size(1), kv_heads = args.k.size(2);
  if (batch == 0 || q_heads == 0) return;
  // attention_backward_hdim256 sends the deterministic mode to the sm_80 kernels.
  if (Traits::kSplitHeadDim && options.deterministic) {
    detail::throw_op_error(kBackwardOp, "internal: the Hopper kernel for head dim 256 has no deterministic mode");
  }
  const BackwardWorkspace layout = backward_workspace(batch, q_heads, q_len, kHeadDim);
  char* workspace = static_cast<char*>(args.workspace.data);

  if (q_len > 0) {
    using PreprocessTraits = BackwardTraits<Element, kHeadDim, 64, 64, 8>;
    BackwardParams pre{};
    pre.out = bshd(args.out);
    pre.dout = bshd(args.dout);
    pre.lse = static_cast<const float*>(args.lse.data);
    pre.delta = reinterpret_cast<float*>(workspace + layout.delta);
    pre.lse_log2 = reinterpret_cast<float*>(workspace + layout.lse_log2);
    pre.dq_accum = reinterpret_cast<float*>(workspace + layout.dq_accum);
    pre.stats_len = static_cast<int>(layout.stats_len);
    pre.batch = static_cast<int>(batch);
    pre.q_len = static_cast<int>(q_len);
    pre.q_heads = static_cast<int>(q_heads);
    constexpr int kRowsPerBlock = 8;  // one warp per row
    const int64_t rows = batch * q_heads * layout.stats_len;
    attention_backward_preprocess_kernel<PreprocessTraits>
        <<<grid_of((rows + kRowsPerBlock - 1) / kRowsPerBlock), 32 * kRowsPerBlock, 0, stream>>>(pre);
    detail::check_launch(kBackwardOp);
    if (options.deterministic) {
      detail::check_cuda(cudaMemsetAsync(workspace + layout.dq_semaphore, 0, layout.dq_accum - layout.dq_semaphore, stream),
                         kBackwardOp, "cudaMemsetAsync");
    }
  }
  BackwardSm90Params<Traits> p{};
  if (q_len > 0 && kv_len > 0) {
    p.tma_q = make_tma_copy(SM90_TMA_LOAD{}, tma_view<Element>(q), take<0, 2>(typename Traits::SmemLayoutQ{}),
                            Shape<Int<Traits::kBlockM>, Int<kHeadDim>>{}, _1{});
    p.tma_dout = make_tma_copy(SM90_TMA_LOAD{}, tma_view<Element>(args.dout),
                               take<0, 2>(typename Traits::SmemLayoutQ{}),
                               Shape<Int<Traits::kBlockM>, Int<kHeadDim>>{}, _1{});
    p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, tma_view<Element>(args.k), typename Traits::SmemLayoutK{},
                            Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{}, _1{});
    p.tma_v = make_tma_copy(SM90_TMA_LOAD{}, tma_view<Element>(args.v), typename Traits::SmemLayoutK{},
                            Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{}, _1{});
  }
  p.shape_q = make_shape(static_cast<int32_t>(q_len), kHeadDim, static_cast<int32_t>(q_heads),
                         static_cast<int32_t>(batch));
  p.shape_kv = make_shape(static_cast<int32_t>(kv_len), kHeadDim, static_cast<int32_t>(kv_heads),
                          static_cast<int32_t>(batch));
  p.dk = bshd(args.dk);
  p.dv = bshd(args.dv);
  p.lse_log2 = reinterpret_cast<const float*>(workspace + layout.lse_log2);
  p.delta = reinterpret_cast<const float*>(workspace + layout.delta);
  p.dq_accum = reinterpret_cast<float*>(workspace + layout.dq_accum);
  p.dq_semaphore = options.deterministic ? reinterpret_cast<int*>(workspace + layout.dq_semaphore) : nullptr;
  p.batch = static_cast<int>(batch);
  p.q_len = static_cast<int>(q_len);
  p.kv_len = static_cast<int>(kv_len);
  p.q_heads = static_cast<int>(q_heads);
  p.kv_heads = static_cast<int>(kv_heads);
  p.group = static_cast<int>(q_heads / kv_heads);
  p.m_blocks = static_cast<int>(layout.m_blocks);
  const double scale = resolved_scale(options, kHeadDim);
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * M_LOG2E);
  p.softcap = static_cast<float>(options.softcap);
  p.mask = kernel_attention_mask(q_len, kv_len, options);

  if (kv_len > 0) {  // Sq = 0 included: every CTA writes dK = dV = 0
    const int64_t n_blocks = (kv_len + plan.block_n - 1) / plan.block_n;
    p.key_blocks_outermost = backward_key_blocks_outermost(p.mask.right >= 0, n_blocks * kv_heads * batch,
                                                           detail::current_device_info().sm_count);
    constexpr int kSmem = Traits::kSharedBytes;
    detail::check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
                       kBackwardOp, "cudaFuncSetAttribute");
    kernel<<<grid_of(n_blocks * kv_heads * batch), Traits::kThreads, kSmem, stream>>>(p);
    detail::check_launch(kBackwardOp);
  }
  if (q_len > 0) {  // Sk = 0 included: dQ = 0 from the zeroed accumulator
    dq_kernel<<<grid_of(batch * q_heads * layout.m_blocks), Traits::kConsumerThreads, 0, stream>>>(p, bshd(args.dq));
    detail::check_launch(kBackwardOp);
  }
}

template <int kHeadDim>
void dispatch_backward_sm90(const AttentionBackwardArgs& args, const AttentionOptions& options,
                            cudaStream_t stream) {
  with_element_type(args.q.dtype, kBackwardOp, [&](auto tag) {
    launch_backward_sm90<typename decltype(tag)::type, kHeadDim>(args, options, stream);
  });
}

}  // namespace trainscale::ops::attention
