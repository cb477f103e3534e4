// Between the activation family's entry points (activation.cc), its CPU reference
// (activation_cpu.cc) and its CUDA kernels (activation.cu). Arguments arrive validated; the
// packed gated forms arrive split into their a / b (and da / db) column halves.
#pragma once

#include "core/check.h"
#include "trainscale/activation.h"

namespace trainscale::ops::activation {

enum class Activation { kGeluErf, kGeluTanh, kSilu };

constexpr Activation gelu_activation(GeluApproximation approx) {
  return approx == GeluApproximation::kTanh ? Activation::kGeluTanh : Activation::kGeluErf;
}

// y = act(x); dx = dy * act'(x).
void activation_forward_cpu(Activation act, const TensorView& x, TensorView y);
void activation_backward_cpu(Activation act, const TensorView& dy, const TensorView& x,
                             TensorView dx);
// y = act(a) * b; da = dy * b * act'(a), db = dy * act(a).
void gated_forward_cpu(Activation act, const TensorView& a, const TensorView& b, TensorView y);
void gated_backward_cpu(Activation act, const TensorView& dy, const TensorView& a,
                        const TensorView& b, TensorView da, TensorView db);

}  // namespace trainscale::ops::activation
