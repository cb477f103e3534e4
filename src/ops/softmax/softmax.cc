#include "ops/softmax/softmax_internal.h"

#include "ops/softmax/softmax_cuda.h"

namespace trainscale {

void softmax_forward(const TensorView& x, TensorView y, cudaStream_t stream) {
  detail::OpChecker c("softmax_forward");
  c.float_rows(x, "x");
  c.like(y, "y", x, "x");
  c.disjoint_or_in_place(y, "y", x, "x");
  if (detail::ran_on_cuda(c, [&] { ops::softmax::softmax_forward_cuda(x, y, stream); })) return;
  ops::softmax::softmax_forward_cpu(x, y);
}

void softmax_backward(const TensorView& dy, const TensorView& y, TensorView dx,
                      cudaStream_t stream) {
  detail::OpChecker c("softmax_backward");
  c.float_rows(dy, "dy");
  c.like(y, "y", dy, "dy");
  c.like(dx, "dx", dy, "dy");
  c.disjoint_or_in_place(dx, "dx", dy, "dy");
  c.no_overlap(dx, "dx", y, "y");
  if (detail::ran_on_cuda(c, [&] { ops::softmax::softmax_backward_cuda(dy, y, dx, stream); })) {
    return;
  }
  ops::softmax::softmax_backward_cpu(dy, y, dx);
}

}  // namespace trainscale
