// CUDA launchers of the norm family (norm_forward_{rms,fused_add,layer}.cu,
// norm_backward_{rms,fused_add,layer}.cu); arguments arrive validated by norm.cc.
// options.variant picks the row kernel (norm_plan.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "trainscale/norm.h"

namespace trainscale::ops::norm {

void rmsnorm_forward_cuda(const TensorView& x, const TensorView& weight, TensorView y,
                          TensorView rstd, const RMSNormOptions& options, cudaStream_t stream);
// y and residual_out may be exactly x and residual (the in-place entry point).
void fused_add_rmsnorm_forward_cuda(const TensorView& x, const TensorView& residual,
                                    const TensorView& weight, TensorView y, TensorView residual_out,
                                    TensorView rstd, const RMSNormOptions& options,
                                    cudaStream_t stream);
void layernorm_forward_cuda(const TensorView& x, const TensorView& weight, const TensorView& bias,
                            TensorView y, TensorView mean, TensorView rstd,
                            const LayerNormOptions& options, cudaStream_t stream);

void rmsnorm_backward_cuda(const TensorView& dy, const TensorView& x, const TensorView& weight,
                           const TensorView& rstd, TensorView dx, TensorView dw,
                           TensorView workspace, const RMSNormOptions& options,
                           cudaStream_t stream);
void fused_add_rmsnorm_backward_cuda(const TensorView& dy, const TensorView& d_residual,
                                     const TensorView& residual, const TensorView& weight,
                                     const TensorView& rstd, TensorView dx, TensorView dw,
                                     TensorView workspace, const RMSNormOptions& options,
                                     cudaStream_t stream);
void layernorm_backward_cuda(const TensorView& dy, const TensorView& x, const TensorView& weight,
                             const TensorView& mean, const TensorView& rstd, TensorView dx,
                             TensorView dw, TensorView db, TensorView workspace,
                             const LayerNormOptions& options, cudaStream_t stream);

// Scratch the backward needs for the weight/bias gradients of a [rows, cols] input.
std::size_t backward_workspace_bytes_cuda(std::int64_t rows, std::int64_t cols, DType dtype);

}  // namespace trainscale::ops::norm
