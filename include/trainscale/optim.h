// The optimizer's passes of a training step: AdamW over a model's parameters and the global
// gradient norm with its clipping factor, without a host synchronization between them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "trainscale/tensor.h"

namespace trainscale {

struct AdamWOptions {
  double lr = 1e-3;                   // finite, >= 0
  double beta1 = 0.9, beta2 = 0.999;  // each in [0, 1)
  double eps = 1e-8;                  // finite, >= 0
  double weight_decay = 1e-2;         // finite, >= 0
  std::int64_t step = 1;              // the step's number (bias corrections), >= 1
};

// One AdamW step (torch.optim.AdamW's update) on every parameter, in place on params, exp_avgs
// and exp_avg_sqs:
//   g = grad * grad_scale
//   m <- m + (1 - beta1) (g - m);   v <- beta2 v + (1 - beta2) g^2
//   param <- param (1 - lr weight_decay) - (lr / (1 - beta1^step)) m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// params: tensors of any shape on one device, each contiguous, float32 / float16 / bfloat16
// (float64 on the CPU); grads[i] like params[i]; exp_avgs[i] and exp_avg_sqs[i] of params[i]'s
// shape, contiguous, both float32 or both in params[i]'s dtype. No updated tensor overlaps any
// other argument. grad_scale: absent (1), or a float32 tensor of one element on the params'
// device whose value the kernels read (grad_norm's clip_factor: no host synchronization).
// CUDA: float32 math, each output rounded once on store; the same bits every run. NaN and Inf
// propagate to the elements they reach.
void adamw_step(std::span<const TensorView> params, std::span<const TensorView> grads,
                std::span<const TensorView> exp_avgs, std::span<const TensorView> exp_avg_sqs,
                const AdamWOptions& options, const TensorView& grad_scale = {}, cudaStream_t stream = nullptr);

// The L2 norm of all grads taken together, into `norm`, and the factor
// min(1, max_norm / (norm + 1e-6)) into `clip_factor` (torch.nn.utils.clip_grad_norm_'s; NaN
// when the norm is NaN, 0 when it is Inf). grads: tensors of any shape on one device, each
// contiguous, float32 / float16 / bfloat16 (float64 on the CPU); they are not modified: clipping
// is adamw_step with grad_scale = clip_factor. norm, clip_factor: float32 tensors of one element
// on the grads' device. max_norm > 0 (+Inf: no clipping, factor 1). Deterministic: a fixed
// split per tensor, partial sums in float64 reduced in a fixed order.
// workspace: on CUDA at least grad_norm_workspace_bytes(grads) bytes, 8-byte aligned; ignored
// on the CPU.
void grad_norm(std::span<const TensorView> grads, double max_norm, TensorView norm, TensorView clip_factor,
               TensorView workspace = {}, cudaStream_t stream = nullptr);
std::size_t grad_norm_workspace_bytes(std::span<const TensorView> grads);

// Every tensor multiplied in place by `factor`, read on the device: a loss's upstream gradient
// applied to gradients computed beforehand, without a host synchronization. Where the factor
// is exactly 1 (loss.backward() of a mean or a sum) the kernels return before touching the
// tensors. tensors: any shape, contiguous, float32 / float16 / bfloat16 (float64 on the CPU),
// one device, pairwise disjoint; factor: a float32 tensor of one element on their device,
// disjoint from them. CUDA: the float32 product rounded to the tensor's dtype; NaN and Inf
// propagate.
void scale_by_device_factor(std::span<const TensorView> tensors, const TensorView& factor,
                            cudaStream_t stream = nullptr);

}  // namespace trainscale
