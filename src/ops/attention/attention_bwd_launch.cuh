// Host side of the sm_80+ attention backward for one head dim: the kernel parameters, the device
// checks and the three launches (preprocess, dK/dV, dQ; attention_bwd_kernel.cuh) on the caller's stream.
// Included by attention_bwd_hdim*.cu, each of which instantiates its head dim's two dtypes only;
// the mask, softcap and scale are run-time parameters of one kernel per dtype.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include <cutlass/numeric_types.h>

#include "common/cuda_check.h"
#include "core/check.h"
#include "ops/attention/attention_bwd_kernel.cuh"
#include "ops/attention/attention_cuda.h"
#include "ops/attention/attention_dtype.cuh"
#include "ops/attention/attention_heuristics.h"
#include "ops/attention/attention_internal.h"

namespace trainscale::ops::attention {

inline constexpr const char* kBackwardOp = "attention_backward";

// The kernels need compute capability 8.0+, a kernel image for the device in this build, and the
// head dim's shared memory (backward_plan).
inline void require_backward_device(const void* kernel, int shared_bytes, int head_dim) {
  require_device_for(kBackwardOp, kernel, 8, /*or_newer=*/true, "compute capability 8.0+ (mma.sync on bf16/fp16)");
  const detail::DeviceInfo& info = detail::current_device_info();
  if (static_cast<std::size_t>(shared_bytes) > info.shared_memory_per_block_optin) {
    detail::throw_op_error(kBackwardOp, "head dim " + std::to_string(head_dim) + " needs " +
                                            std::to_string(shared_bytes) + " bytes of shared memory per block; device " +
                                            std::to_string(info.device) + " offers " +
                                            std::to_string(info.shared_memory_per_block_optin));
  }
}

// Whether the Hopper kernel runs this head dim here: an sm_90a build on a compute capability 9.0
// device (attention_bwd_sm90_launch.cuh).
inline bool use_hopper_backward(int head_dim) {
#if defined(TRAINSCALE_HAS_SM90A) && TRAINSCALE_HAS_SM90A
  return backward_sm90_plan(head_dim).supported() && detail::current_device_info().major == 9;
#else
  (void)head_dim;
  return false;
#endif
}

inline BshdTensor bshd(const TensorView& t) { return {t.data, t.strides[0], t.strides[1], t.strides[2]}; }

inline unsigned grid_of(std::int64_t ctas) {
  if (ctas > std::numeric_limits<int>::max())
    detail::throw_op_error(kBackwardOp, "more than 2^31 - 1 thread blocks (" + std::to_string(ctas) +
                                            "): split the batch");
  return static_cast<unsigned>(ctas);
}

template <class Element, int kHeadDim>
void launch_backward(const AttentionBackwardArgs& args, const AttentionOptions& options,
                     cudaStream_t stream) {
  constexpr BackwardPlan plan = backward_plan(kHeadDim);
  static_assert(plan.supported());
  using DkdvTraits = BackwardTraits<Element, kHeadDim, plan.block_m, plan.block_n, plan.warps>;
  using DqTraits = BackwardTraits<Element, kHeadDim, plan.block_m, plan.dq_block_n, plan.warps>;
  static_assert(DkdvTraits::kThreads == plan.threads());
  auto* preprocess = &attention_backward_preprocess_kernel<DqTraits>;
  auto* dkdv = &attention_backward_dkdv_kernel<DkdvTraits>;
  auto* dq = &attention_backward_dq_kernel<DqTraits>;
  constexpr int kDkdvShared = DkdvTraits::kDkdvSharedBytes, kDqShared = DqTraits::kDqSharedBytes;
  require_backward_device(reinterpret_cast<const void*>(dkdv),
                          kDkdvShared > kDqShared ? kDkdvShared : kDqShared, kHeadDim);

  const TensorView& q = args.q;
  const std::int64_t batch = q.size(0), q_len = q.size(1), q_heads = q.size(2);
  const std::int64_t kv_len = args.k.size(1), kv_heads = args.k.size(2);
  if (batch == 0 || q_heads == 0) return;

  BackwardParams p{};
  p.q = bshd(q);
  p.k = bshd(args.k);
  p.v = bshd(args.v);
  p.out = bshd(args.out);
  p.dout = bshd(args.dout);
  p.dq = bshd(args.dq);
  p.dk = bshd(args.dk);
  p.dv = bshd(args.dv);
  p.lse = static_cast<const float*>(args.lse.data);
  p.delta = static_cast<float*>(args.workspace.data);  // [B, Hq, Sq]: stats_len = Sq
  p.lse_log2 = nullptr;
  p.stats_len = static_cast<int>(q_len);
  p.batch = static_cast<int>(batch);
  p.q_len = static_cast<int>(q_len);
  p.kv_len = static_cast<int>(kv_len);
  p.q_heads = static_cast<int>(q_heads);
  p.kv_heads = static_cast<int>(kv_heads);
  p.group = static_cast<int>(q_heads / kv_heads);
  p.scale = static_cast<float>(resolved_scale(options, kHeadDim));
  p.softcap = static_cast<float>(options.softcap);
  p.mask = kernel_attention_mask(q_len, kv_len, options);

  if (q_len > 0) {
    constexpr int kRowsPerBlock = 8;  // one warp per row
    const std::int64_t rows = batch * q_heads * q_len;
    preprocess<<<grid_of((rows + kRowsPerBlock - 1) / kRowsPerBlock), 32 * kRowsPerBlock, 0, stream>>>(p);
    detail::check_launch(kBackwardOp);

    const std::int64_t m_blocks = (q_len + plan.block_m - 1) / plan.block_m;
    detail::check_cuda(cudaFuncSetAttribute(dq, cudaFuncAttributeMaxDynamicSharedMemorySize, kDqShared),
                       kBackwardOp, "cudaFuncSetAttribute");
    dq<<<grid_of(m_blocks * q_heads * batch), DqTraits::kThreads, kDqShared, stream>>>(p);
    detail::check_launch(kBackwardOp);
  }
  if (kv_len > 0) {  // Sq = 0 included: the kernel writes dK = dV = 0
    const std::int64_t n_blocks = (kv_len + plan.block_n - 1) / plan.block_n;
    detail::check_cuda(cudaFuncSetAttribute(dkdv, cudaFuncAttributeMaxDynamicSharedMemorySize, kDkdvShared),
                       kBackwardOp, "cudaFuncSetAttribute");
    dkdv<<<grid_of(n_blocks * kv_heads * batch), DkdvTraits::kThreads, kDkdvShared, stream>>>(p);
    detail::check_launch(kBackwardOp);
  }
}

// The variants of one head dim: the dtypes.
template <int kHeadDim>
void dispatch_backward(const AttentionBackwardArgs& args, const AttentionOptions& options,
                       cudaStream_t stream) {
  with_element_type(args.q.dtype, kBackwardOp, [&](auto tag) {
    launch_backward<typename decltype(tag)::type, kHeadDim>(args, options, stream);
  });
}

}  // namespace trainscale::ops::attention
