// CUDA launchers of the activation family (activation.cu); arguments arrive validated by
// activation.cc, the packed gated forms already split into their a / b (da / db) halves.
// Outputs may be exactly the same view as an input (in place); every launcher is one
// elementwise kernel on `stream` and launches nothing for empty tensors.
#pragma once

#include "ops/activation/activation_internal.h"

namespace trainscale::ops::activation {

// y = act(x); dx = dy * act'(x).
void activation_forward_cuda(Activation act, const TensorView& x, TensorView y,
                             cudaStream_t stream, const char* op);
void activation_backward_cuda(Activation act, const TensorView& dy, const TensorView& x,
                              TensorView dx, cudaStream_t stream, const char* op);
// y = act(a) * b; da = dy * b * act'(a), db = dy * act(a), and with y != nullptr the forward's
// y (the same bits as gated_forward_cuda's) in the same pass.
void gated_forward_cuda(Activation act, const TensorView& a, const TensorView& b, TensorView y,
                        cudaStream_t stream, const char* op);
void gated_backward_cuda(Activation act, const TensorView& dy, const TensorView& a,
                         const TensorView& b, TensorView da, TensorView db, const TensorView* y,
                         cudaStream_t stream, const char* op);

}  // namespace trainscale::ops::activation
