// Between the softmax family's entry points (softmax.cc), its CPU reference (softmax_cpu.cc)
// and its CUDA kernels (softmax.cu). Arguments arrive validated.
#pragma once

#include "core/check.h"
#include "trainscale/softmax.h"

namespace trainscale::ops::softmax {

void softmax_forward_cpu(const TensorView& x, TensorView y);
void softmax_backward_cpu(const TensorView& dy, const TensorView& y, TensorView dx);

}  // namespace trainscale::ops::softmax
