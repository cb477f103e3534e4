// Softmax over the last dimension.
#pragma once

#include "trainscale/tensor.h"

namespace trainscale {

// y = exp(x - max) / sum(exp(x - max)) over each row of the last dim. x and y: same shape and
// dtype (float32, float16, bfloat16; float64 on the CPU), rows contiguous and evenly strided.
// y may be exactly x's view (in place). As in torch, -inf entries give 0 and a row with no
// finite maximum (all -inf, or any +inf / NaN) gives NaN.
void softmax_forward(const TensorView& x, TensorView y, cudaStream_t stream = nullptr);

// dx = y * (dy - sum(dy * y)) per row. dy, y, dx: same shape and dtype; dx may be exactly dy's
// view (in place).
void softmax_backward(const TensorView& dy, const TensorView& y, TensorView dx,
                      cudaStream_t stream = nullptr);

}  // namespace trainscale
