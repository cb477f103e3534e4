// Between the norm family's entry points (norm.cc), its CPU reference (norm_cpu.cc) and its
// CUDA kernels (norm.cu). Arguments arrive validated.
#pragma once

#include "core/check.h"
#include "trainscale/norm.h"

namespace trainscale::ops::norm {

void rmsnorm_forward_cpu(const TensorView& x, const TensorView& weight, TensorView y,
                         TensorView rstd, const RMSNormOptions& options);
void rmsnorm_backward_cpu(const TensorView& dy, const TensorView& x, const TensorView& weight,
                          const TensorView& rstd, TensorView dx, TensorView dw,
                          const RMSNormOptions& options);
// y and residual_out may be exactly x and residual (the in-place entry point).
void fused_add_rmsnorm_forward_cpu(const TensorView& x, const TensorView& residual,
                                   const TensorView& weight, TensorView y, TensorView residual_out,
                                   TensorView rstd, const RMSNormOptions& options);
void fused_add_rmsnorm_backward_cpu(const TensorView& dy, const TensorView& d_residual,
                                    const TensorView& residual, const TensorView& weight,
                                    const TensorView& rstd, TensorView dx, TensorView dw,
                                    const RMSNormOptions& options);
void layernorm_forward_cpu(const TensorView& x, const TensorView& weight, const TensorView& bias,
                           TensorView y, TensorView mean, TensorView rstd,
                           const LayerNormOptions& options);
void layernorm_backward_cpu(const TensorView& dy, const TensorView& x, const TensorView& weight,
                            const TensorView& mean, const TensorView& rstd, TensorView dx,
                            TensorView dw, TensorView db);

}  // namespace trainscale::ops::norm
