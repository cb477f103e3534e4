#include "ops/softmax/softmax_internal.h"

namespace trainscale {

namespace {

constexpr auto kFloatTypes = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64};

bool same_view(const TensorView& a, const TensorView& b) {
  return a.data == b.data && a.dtype == b.dtype && a.ndim == b.ndim && a.shape == b.shape &&
         a.strides == b.strides && a.device == b.device;
}

// An output documented as in place: exactly the input's view, or memory disjoint from it.
void in_place_or_disjoint(detail::OpChecker& c, const TensorView& out, const char* out_name,
                          const TensorView& in, const char* in_name) {
  if (!same_view(out, in)) c.no_overlap(out, out_name, in, in_name);
}

// `t` is a row tensor like `ref` (same dtype and shape, rows contiguous).
void check_like(detail::OpChecker& c, const TensorView& t, const char* name, const TensorView& ref,
                const char* ref_name) {
  c.present(t, name).same_dtype(t, name, ref, ref_name).same_shape(t, name, ref, ref_name);
  c.rows(t, name);
}

}  // namespace

void softmax_forward(const TensorView& x, TensorView y, cudaStream_t /*stream*/) {
  detail::OpChecker c("softmax_forward");
  c.present(x, "x").dtype_in(x, "x", kFloatTypes);
  c.rows(x, "x");
  check_like(c, y, "y", x, "x");
  in_place_or_disjoint(c, y, "y", x, "x");
  if (c.on_cuda()) detail::throw_no_cuda_kernel(c.op());
  ops::softmax::softmax_forward_cpu(x, y);
}

void softmax_backward(const TensorView& dy, const TensorView& y, TensorView dx,
                      cudaStream_t /*stream*/) {
  detail::OpChecker c("softmax_backward");
  c.present(dy, "dy").dtype_in(dy, "dy", kFloatTypes);
  c.rows(dy, "dy");
  check_like(c, y, "y", dy, "dy");
  check_like(c, dx, "dx", dy, "dy");
  in_place_or_disjoint(c, dx, "dx", dy, "dy");
  c.no_overlap(dx, "dx", y, "y");
  if (c.on_cuda()) detail::throw_no_cuda_kernel(c.op());
  ops::softmax::softmax_backward_cpu(dy, y, dx);
}

}  // namespace trainscale
