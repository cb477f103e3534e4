// Losses: mean squared error, cross-entropy, fused linear cross-entropy.
#pragma once

#include "trainscale/tensor.h"

namespace trainscale {

enum class Reduction { kNone, kMean, kSum };
const char* reduction_name(Reduction reduction);

// out = (a - b)^2 elementwise (kNone), or its mean / sum over every element (one float32
// element). a and b: same shape and dtype (float32, float16, bfloat16; float64 on the CPU),
// rows of the last dim contiguous.
void mse_forward(const TensorView& a, const TensorView& b, TensorView out, Reduction reduction,
                 cudaStream_t stream = nullptr);

// grad_a = 2 (a - b) * grad_out (divided by numel for kMean), grad_b = -grad_a. grad_out has
// out's shape and dtype; grad_a / grad_b have a's; either may be absent (TensorView{}).
void mse_backward(const TensorView& grad_out, const TensorView& a, const TensorView& b,
                  TensorView grad_a, TensorView grad_b, Reduction reduction,
                  cudaStream_t stream = nullptr);

}  // namespace trainscale
