// CUDA launchers of the softmax family (softmax_forward.cu, softmax_backward.cu); arguments
// arrive validated by softmax.cc. Each row is read once and written once: the whole row sits
// in registers, across a thread-block cluster for long rows (common/row_kernel.cuh), rows of
// any length up to detail::max_row_cols and any alignment. Longer rows throw.
#pragma once

#include "trainscale/softmax.h"

namespace trainscale::ops::softmax {

void softmax_forward_cuda(const TensorView& x, TensorView y, cudaStream_t stream);
void softmax_backward_cuda(const TensorView& dy, const TensorView& y, TensorView dx,
                           cudaStream_t stream);

}  // namespace trainscale::ops::softmax
