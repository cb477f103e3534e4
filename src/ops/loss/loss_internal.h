// Between the loss family's entry points (loss.cc), its CPU reference (loss_cpu.cc) and its
// CUDA kernels (loss.cu). Arguments arrive validated.
#pragma once

#include "core/check.h"
#include "trainscale/loss.h"

namespace trainscale::ops::loss {

void mse_forward_cpu(const TensorView& a, const TensorView& b, TensorView out,
                     Reduction reduction);
void mse_backward_cpu(const TensorView& grad_out, const TensorView& a, const TensorView& b,
                      TensorView grad_a, TensorView grad_b, Reduction reduction);

}  // namespace trainscale::ops::loss
