// CUDA launchers of the loss family; arguments arrive validated by loss.cc. Only MSE has
// kernels so far (mse.cu); cross-entropy and fused linear cross-entropy are CPU-only.
#pragma once

#include "ops/loss/loss_internal.h"

namespace trainscale::ops::loss {

// kNone: one elementwise kernel. kMean / kSum: one launch of one thread-block cluster (8
// blocks of 1024 threads) that sums in a fixed order (bit-identical results run to run, no
// atomics, no workspace, nothing shared between calls: safe on concurrent streams and in
// CUDA graphs). out is float32 there.
void mse_forward_cuda(const TensorView& a, const TensorView& b, TensorView out,
                      Reduction reduction, cudaStream_t stream);
// One elementwise kernel; a reduced grad_out (float32, one element) is read on the device.
void mse_backward_cuda(const TensorView& grad_out, const TensorView& a, const TensorView& b,
                       TensorView grad_a, TensorView grad_b, Reduction reduction,
                       cudaStream_t stream);

}  // namespace trainscale::ops::loss
