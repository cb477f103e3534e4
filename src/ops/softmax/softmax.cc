#include "ops/softmax/softmax_internal.h"

#include "ops/softmax/softmax_cuda.h"

namespace trainscale {

namespace {

constexpr auto kFloatTypes = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64};
// `t` is a row tensor like `ref` (same dtype and shape, rows contiguous).
void check_like(detail::OpChecker& c, const TensorView& t, const char* name, const TensorView& ref,
                const char* ref_name) {
  c.present(t, name).same_dtype(t, name, ref, ref_name).same_shape(t, name, ref, ref_name);
  c.rows(t, name);
}

}  // namespace

void softmax_forward(const TensorView& x, TensorView y, cudaStream_t stream) {
  detail::OpChecker c("softmax_forward");
  c.present(x, "x").dtype_in(x, "x", kFloatTypes);
  c.rows(x, "x");
  check_like(c, y, "y", x, "x");
  c.in_place_or_disjoint(y, "y", x, "x");
  if (detail::ran_on_cuda(c, [&] { ops::softmax::softmax_forward_cuda(x, y, stream); })) return;
  ops::softmax::softmax_forward_cpu(x, y);
}

void softmax_backward(const TensorView& dy, const TensorView& y, TensorView dx,
                      cudaStream_t stream) {
  detail::OpChecker c("softmax_backward");
  c.present(dy, "dy").dtype_in(dy, "dy", kFloatTypes);
  c.rows(dy, "dy");
  check_like(c, y, "y", dy, "dy");
  check_like(c, dx, "dx", dy, "dy");
  c.in_place_or_disjoint(dx, "dx", dy, "dy");
  c.no_overlap(dx, "dx", y, "y");
  if (detail::ran_on_cuda(c, [&] { ops::softmax::softmax_backward_cuda(dy, y, dx, stream); })) {
    return;
  }
  ops::softmax::softmax_backward_cpu(dy, y, dx);
}

}  // namespace trainscale
