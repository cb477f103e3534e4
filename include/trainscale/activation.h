// Activations: GELU, SiLU and the gated forms SwiGLU = silu(a) * b and GeGLU = gelu(a) * b.
//
// Every tensor is seen as rows of its last dim (last stride 1, leading dims flattening into
// evenly strided rows). Dtypes: float32, float16, bfloat16 (float64 on the CPU); every tensor of
// one call has the same dtype, and outputs have the inputs' shape unless stated.
//
// Aliasing: an output may be exactly the same view as one of the call's inputs (for example
// y == x, dx == dy, or da == a and db == b for an in-place backward), since each element is
// computed from the inputs at the same index only. Any other overlap with an input, or
// between two outputs, is an error.
#pragma once

#include "trainscale/tensor.h"

namespace trainscale {

enum class GeluApproximation {
  kNone,  // 0.5 x (1 + erf(x / sqrt(2)))
  kTanh,  // 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
};
const char* gelu_approximation_name(GeluApproximation approx);

// y = gelu(x); dx = dy * gelu'(x).
void gelu_forward(const TensorView& x, TensorView y,
                  GeluApproximation approx = GeluApproximation::kNone,
                  cudaStream_t stream = nullptr);
void gelu_backward(const TensorView& dy, const TensorView& x, TensorView dx,
                   GeluApproximation approx = GeluApproximation::kNone,
                   cudaStream_t stream = nullptr);

// y = silu(x) = x * sigmoid(x); dx = dy * silu'(x).
void silu_forward(const TensorView& x, TensorView y, cudaStream_t stream = nullptr);
void silu_backward(const TensorView& dy, const TensorView& x, TensorView dx,
                   cudaStream_t stream = nullptr);

// Gated, separate halves: a, b, y [..., F]; da = dy * b * act'(a), db = dy * act(a).
void swiglu_forward(const TensorView& a, const TensorView& b, TensorView y,
                    cudaStream_t stream = nullptr);
void swiglu_backward(const TensorView& dy, const TensorView& a, const TensorView& b, TensorView da,
                     TensorView db, cudaStream_t stream = nullptr);
// swiglu_backward plus the forward's y = silu(a) * b, the same bits as swiglu_forward's, in the
// same pass over a and b: for a backward that did not keep y (trainscale.SwiGLUMLP(fused=True)
// recomputes it for the down projection's weight gradient). y may not overlap any other tensor.
void swiglu_backward_recompute(const TensorView& dy, const TensorView& a, const TensorView& b,
                               TensorView da, TensorView db, TensorView y,
                               cudaStream_t stream = nullptr);
void geglu_forward(const TensorView& a, const TensorView& b, TensorView y,
                   GeluApproximation approx = GeluApproximation::kNone,
                   cudaStream_t stream = nullptr);
void geglu_backward(const TensorView& dy, const TensorView& a, const TensorView& b, TensorView da,
                    TensorView db, GeluApproximation approx = GeluApproximation::kNone,
                    cudaStream_t stream = nullptr);

// Gated, packed (the output of a fused gate/up projection): ab [..., 2F] holds a in its first
// F columns and b in its last F; y and dy are [..., F]; the gradient lands in one
// dab [..., 2F] laid out like ab (dab may be ab itself).
void swiglu_forward_packed(const TensorView& ab, TensorView y, cudaStream_t stream = nullptr);
void swiglu_backward_packed(const TensorView& dy, const TensorView& ab, TensorView dab,
                            cudaStream_t stream = nullptr);
void geglu_forward_packed(const TensorView& ab, TensorView y,
                          GeluApproximation approx = GeluApproximation::kNone,
                          cudaStream_t stream = nullptr);
void geglu_backward_packed(const TensorView& dy, const TensorView& ab, TensorView dab,
                           GeluApproximation approx = GeluApproximation::kNone,
                           cudaStream_t stream = nullptr);

}  // namespace trainscale
