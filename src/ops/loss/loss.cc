#include "ops/loss/loss_internal.h"

namespace trainscale {

const char* reduction_name(Reduction reduction) {
  switch (reduction) {
    case Reduction::kNone: return "none";
    case Reduction::kMean: return "mean";
    case Reduction::kSum: return "sum";
  }
  return "unknown";
}

namespace {

constexpr auto kFloatTypes = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64};

// The reduced output / upstream gradient: kNone -> like `a`; otherwise one float32 element.
void check_loss_value(detail::OpChecker& c, const TensorView& t, const char* name,
                      const TensorView& a, Reduction reduction) {
  c.present(t, name);
  if (reduction == Reduction::kNone) {
    c.same_shape(t, name, a, "a").same_dtype(t, name, a, "a");
    c.rows(t, name);
  } else {
    c.require(t.numel() == 1, name, "one element for reduction '" + std::string(reduction_name(reduction)) + "'",
              "shape " + t.shape_str());
    c.dtype_in(t, name, {DType::kFloat32, DType::kFloat64});
  }
}

}  // namespace

void mse_forward(const TensorView& a, const TensorView& b, TensorView out, Reduction reduction,
                 cudaStream_t /*stream*/) {
  detail::OpChecker c("mse_forward");
  c.present(a, "a").dtype_in(a, "a", kFloatTypes);
  c.present(b, "b").same_dtype(b, "b", a, "a").same_shape(b, "b", a, "a");
  c.rows(a, "a");
  c.rows(b, "b");
  check_loss_value(c, out, "out", a, reduction);
  c.no_overlap(out, "out", a, "a").no_overlap(out, "out", b, "b");
  if (c.on_cuda()) detail::throw_no_cuda_kernel(c.op());
  ops::loss::mse_forward_cpu(a, b, out, reduction);
}

void mse_backward(const TensorView& grad_out, const TensorView& a, const TensorView& b,
                  TensorView grad_a, TensorView grad_b, Reduction reduction,
                  cudaStream_t /*stream*/) {
  detail::OpChecker c("mse_backward");
  c.present(a, "a").dtype_in(a, "a", kFloatTypes);
  c.present(b, "b").same_dtype(b, "b", a, "a").same_shape(b, "b", a, "a");
  c.rows(a, "a");
  c.rows(b, "b");
  check_loss_value(c, grad_out, "grad_out", a, reduction);
  for (auto [g, name] : {std::pair{grad_a, "grad_a"}, std::pair{grad_b, "grad_b"}}) {
    if (!g.defined()) continue;
    c.present(g, name).same_dtype(g, name, a, "a").same_shape(g, name, a, "a");
    c.rows(g, name);
    c.no_overlap(g, name, a, "a").no_overlap(g, name, b, "b").no_overlap(g, name, grad_out, "grad_out");
  }
  c.no_overlap(grad_a, "grad_a", grad_b, "grad_b");
  if (c.on_cuda()) detail::throw_no_cuda_kernel(c.op());
  ops::loss::mse_backward_cpu(grad_out, a, b, grad_a, grad_b, reduction);
}

}  // namespace trainscale
