// Between the optimizer family's entry points (optim.cc), its CPU reference (optim_cpu.cc) and
// its CUDA kernels (optim.cu). Arguments arrive validated.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

#include "core/check.h"
#include "trainscale/optim.h"

namespace trainscale::ops::optim {

// The step's scalars, in double on the host: param <- param * decay - step_size * m / (sqrt(v) *
// inv_sqrt_bc2 + eps).
struct AdamWScalars {
  double decay, step_size, inv_sqrt_bc2;
};

inline AdamWScalars adamw_scalars(const AdamWOptions& o) {
  const auto step = static_cast<double>(o.step);
  return {1.0 - o.lr * o.weight_decay, o.lr / (1.0 - std::pow(o.beta1, step)),
          1.0 / std::sqrt(1.0 - std::pow(o.beta2, step))};
}

#if defined(__CUDACC__)
#define TS_OPTIM_HOST_DEVICE __host__ __device__
#else
#define TS_OPTIM_HOST_DEVICE
#endif

// clip_grad_norm_'s factor, NaN propagated (a comparison, not fmin, which would drop it).
template <class F>
TS_OPTIM_HOST_DEVICE F clip_factor_of(F norm, F max_norm) {
  const F factor = max_norm / (norm + F(1e-6));
  return factor > F(1) ? F(1) : factor;
}

void adamw_step_cpu(std::span<const TensorView> params, std::span<const TensorView> grads,
                    std::span<const TensorView> exp_avgs, std::span<const TensorView> exp_avg_sqs,
                    const AdamWOptions& options, const TensorView& grad_scale);
void grad_norm_cpu(std::span<const TensorView> grads, double max_norm, TensorView norm, TensorView clip_factor);
void scale_by_device_factor_cpu(std::span<const TensorView> tensors, const TensorView& factor);

// optim.cu
void adamw_step_cuda(std::span<const TensorView> params, std::span<const TensorView> grads,
                     std::span<const TensorView> exp_avgs, std::span<const TensorView> exp_avg_sqs,
                     const AdamWOptions& options, const TensorView& grad_scale, cudaStream_t stream);
std::size_t grad_norm_workspace_bytes_cuda(std::span<const TensorView> grads);
void grad_norm_cuda(std::span<const TensorView> grads, double max_norm, TensorView norm, TensorView clip_factor,
                    TensorView workspace, cudaStream_t stream);
void scale_by_device_factor_cuda(std::span<const TensorView> tensors, const TensorView& factor, cudaStream_t stream);

}  // namespace trainscale::ops::optim
