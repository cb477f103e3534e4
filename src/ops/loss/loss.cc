#include <cmath>

#include "ops/loss/loss_internal.h"

#include "ops/loss/loss_cuda.h"

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

constexpr auto kStatTypes = {DType::kFloat32, DType::kFloat64};

// A reduced loss or its upstream gradient: one float32 (or float64) element.
void check_reduced_value(detail::OpChecker& c, const TensorView& t, const char* name,
                         Reduction reduction) {
  if (!(t.numel() == 1))
    c.fail(name, "one element for reduction '" + std::string(reduction_name(reduction)) + "'",
           "shape " + t.shape_str());
  c.dtype_in(t, name, kStatTypes);
}

// The reduced output / upstream gradient: kNone -> like `a`; otherwise one float32 element.
void check_loss_value(detail::OpChecker& c, const TensorView& t, const char* name,
                      const TensorView& a, Reduction reduction) {
  c.present(t, name);
  if (reduction == Reduction::kNone) {
    c.same_shape(t, name, a, "a").same_dtype(t, name, a, "a");
    c.rows(t, name);
  } else {
    check_reduced_value(c, t, name, reduction);
  }
}

void check_options(detail::OpChecker& c, const CrossEntropyOptions& o) {
  const double e = o.label_smoothing;
  if (!(std::isfinite(e) && e >= 0 && e <= 1))
    c.fail("options.label_smoothing", "a value in [0, 1]", detail::format_number(e));
  if (!(std::isfinite(o.z_loss) && o.z_loss >= 0))
    c.fail("options.z_loss", "a finite value >= 0", detail::format_number(o.z_loss));
  if (!(std::isfinite(o.softcap) && o.softcap >= 0))
    c.fail("options.softcap", "a finite value >= 0 (0 turns it off)",
           detail::format_number(o.softcap));
  const bool known = o.reduction == Reduction::kNone || o.reduction == Reduction::kMean ||
                     o.reduction == Reduction::kSum;
  if (!known)
    c.fail("options.reduction", "none, mean or sum",
           "enum value " + std::to_string(static_cast<int>(o.reduction)));
}

// One float32 (float64 on the CPU) value per row of `rows_of`.
void check_row_values(detail::OpChecker& c, const TensorView& t, const char* name,
                      std::int64_t rows, const char* rows_of) {
  c.present(t, name).dtype_in(t, name, kStatTypes).ndim(t, name, 1);
  c.dim_size(t, name, 0, rows, rows_of);
}

// Per-row loss (kNone) or one reduced value, and likewise its upstream gradient.
void check_row_loss(detail::OpChecker& c, const TensorView& t, const char* name,
                    std::int64_t rows, const char* rows_of, Reduction reduction) {
  if (reduction == Reduction::kNone) {
    check_row_values(c, t, name, rows, rows_of);
  } else {
    c.present(t, name);
    check_reduced_value(c, t, name, reduction);
  }
}

void check_targets(detail::OpChecker& c, const TensorView& targets, std::int64_t rows,
                   const char* rows_of) {
  c.present(targets, "targets").dtype_in(targets, "targets", {DType::kInt32, DType::kInt64});
  c.ndim(targets, "targets", 1).dim_size(targets, "targets", 0, rows, rows_of);
}

// A [rows, cols] matrix with contiguous rows; returns its row count.
std::int64_t check_matrix(detail::OpChecker& c, const TensorView& t, const char* name) {
  c.present(t, name).dtype_in(t, name, kFloatTypes).ndim(t, name, 2);
  return c.rows(t, name).rows;
}

// [M, V] logits with V >= 1; returns M.
std::int64_t check_logits(detail::OpChecker& c, const TensorView& logits) {
  const std::int64_t rows = check_matrix(c, logits, "logits");
  if (!(logits.size(1) >= 1))
    c.fail("logits", "at least one class (V >= 1)", "shape " + logits.shape_str());
  return rows;
}

// Like `ref`: same dtype and shape (and contiguous rows for matrices).
void check_like(detail::OpChecker& c, const TensorView& t, const char* name, const TensorView& ref,
                const char* ref_name) {
  c.present(t, name).same_dtype(t, name, ref, ref_name).same_shape(t, name, ref, ref_name);
  if (t.ndim == 2) c.rows(t, name);
}
struct NamedView {
  const TensorView* view;
  const char* name;
};

// Every output disjoint from every input and from every other output (absent ones skipped).
void check_disjoint(detail::OpChecker& c, std::initializer_list<NamedView> outputs,
                    std::initializer_list<NamedView> inputs) {
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    for (const NamedView& in : inputs) c.no_overlap(*out->view, out->name, *in.view, in.name);
    for (auto other = outputs.begin(); other != out; ++other) {
      c.no_overlap(*out->view, out->name, *other->view, other->name);
    }
  }
}

}  // namespace

void mse_forward(const TensorView& a, const TensorView& b, TensorView out, Reduction reduction,
                 cudaStream_t stream) {
  detail::OpChecker c("mse_forward");
  c.present(a, "a").dtype_in(a, "a", kFloatTypes);
  c.present(b, "b").same_dtype(b, "b", a, "a").same_shape(b, "b", a, "a");
  c.rows(a, "a");
  c.rows(b, "b");
  check_loss_value(c, out, "out", a, reduction);
  c.no_overlap(out, "out", a, "a").no_overlap(out, "out", b, "b");
  if (detail::ran_on_cuda(c, [&] {
      ops::loss::mse_forward_cuda(a, b, out, reduction, stream);
      })) {
    return;
  }
  ops::loss::mse_forward_cpu(a, b, out, reduction);
}

void mse_backward(const TensorView& grad_out, const TensorView& a, const TensorView& b,
                  TensorView grad_a, TensorView grad_b, Reduction reduction,
                  cudaStream_t stream) {
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
  if (detail::ran_on_cuda(c, [&] {
      ops::loss::mse_backward_cuda(grad_out, a, b, grad_a, grad_b, reduction, stream);
      })) {
    return;
  }
  ops::loss::mse_backward_cpu(grad_out, a, b, grad_a, grad_b, reduction);
}

void cross_entropy_forward(const TensorView& logits, const TensorView& targets, TensorView loss,
                           TensorView lse, TensorView grad_logits,
                           const CrossEntropyOptions& options, cudaStream_t stream) {
  detail::OpChecker c("cross_entropy_forward");
  const std::int64_t rows = check_logits(c, logits);
  check_targets(c, targets, rows, "one per row of 'logits'");
  check_options(c, options);
  check_row_loss(c, loss, "loss", rows, "one per row of 'logits'", options.reduction);
  if (lse.defined()) check_row_values(c, lse, "lse", rows, "one per row of 'logits'");
  if (grad_logits.defined()) check_like(c, grad_logits, "grad_logits", logits, "logits");
  c.in_place_or_disjoint(grad_logits, "grad_logits", logits, "logits");
  check_disjoint(c, {{&loss, "loss"}, {&lse, "lse"}, {&grad_logits, "grad_logits"}},
                 {{&targets, "targets"}});
  c.no_overlap(loss, "loss", logits, "logits").no_overlap(lse, "lse", logits, "logits");
  if (detail::ran_on_cuda(c, [&] {
        ops::loss::cross_entropy_forward_cuda(logits, targets, loss, lse, grad_logits, options,
                                              stream);
      })) {
    return;
  }
  ops::loss::cross_entropy_forward_cpu(logits, targets, loss, lse, grad_logits, options);
}

void cross_entropy_backward(const TensorView& grad_loss, const TensorView& logits,
                            const TensorView& targets, const TensorView& lse,
                            TensorView grad_logits, const CrossEntropyOptions& options,
                            cudaStream_t stream) {
  detail::OpChecker c("cross_entropy_backward");
  const std::int64_t rows = check_logits(c, logits);
  check_targets(c, targets, rows, "one per row of 'logits'");
  check_options(c, options);
  check_row_loss(c, grad_loss, "grad_loss", rows, "one per row of 'logits'", options.reduction);
  check_row_values(c, lse, "lse", rows, "one per row of 'logits'");
  check_like(c, grad_logits, "grad_logits", logits, "logits");
  c.in_place_or_disjoint(grad_logits, "grad_logits", logits, "logits");
  check_disjoint(c, {{&grad_logits, "grad_logits"}},
                 {{&grad_loss, "grad_loss"}, {&targets, "targets"}, {&lse, "lse"}});
  if (detail::ran_on_cuda(c, [&] {
        ops::loss::cross_entropy_backward_cuda(grad_loss, logits, targets, lse, grad_logits,
                                               options, stream);
      })) {
    return;
  }
  ops::loss::cross_entropy_backward_cpu(grad_loss, logits, targets, lse, grad_logits, options);
}

void fused_linear_cross_entropy_forward(const TensorView& hidden, const TensorView& weight,
                                        const TensorView& bias, const TensorView& targets,
                                        TensorView loss, TensorView lse, TensorView grad_hidden,
                                        TensorView grad_weight, TensorView grad_bias,
                                        const CrossEntropyOptions& options,
                                        cudaStream_t /*stream*/) {
  detail::OpChecker c("fused_linear_cross_entropy_forward");
  const std::int64_t tokens = check_matrix(c, hidden, "hidden");
  const std::int64_t classes = check_matrix(c, weight, "weight");
  c.same_dtype(weight, "weight", hidden, "hidden");
  c.dim_size(weight, "weight", 1, hidden.size(1), "the hidden size of 'hidden'");
  if (!(classes >= 1))
    c.fail("weight", "at least one class (V >= 1)", "shape " + weight.shape_str());
  if (bias.defined()) {
    c.present(bias, "bias").same_dtype(bias, "bias", hidden, "hidden").ndim(bias, "bias", 1);
    c.dim_size(bias, "bias", 0, classes, "one per row of 'weight'");
  }
  check_targets(c, targets, tokens, "one per row of 'hidden'");
  check_options(c, options);
  check_row_loss(c, loss, "loss", tokens, "one per row of 'hidden'", options.reduction);
  if (lse.defined()) check_row_values(c, lse, "lse", tokens, "one per row of 'hidden'");
  if (grad_hidden.defined()) check_like(c, grad_hidden, "grad_hidden", hidden, "hidden");
  if (grad_weight.defined()) check_like(c, grad_weight, "grad_weight", weight, "weight");
  if (grad_bias.defined()) {
    if (!(bias.defined()))
      c.fail("grad_bias", "a 'bias' to differentiate", "grad_bias without bias");
    check_like(c, grad_bias, "grad_bias", bias, "bias");
  }
  check_disjoint(c,
                 {{&loss, "loss"}, {&lse, "lse"}, {&grad_hidden, "grad_hidden"},
                  {&grad_weight, "grad_weight"}, {&grad_bias, "grad_bias"}},
                 {{&hidden, "hidden"}, {&weight, "weight"}, {&bias, "bias"}, {&targets, "targets"}});
  if (c.on_cuda()) detail::throw_no_cuda_kernel(c.op());
  ops::loss::fused_linear_cross_entropy_forward_cpu(hidden, weight, bias, targets, loss, lse,
                                                    grad_hidden, grad_weight, grad_bias, options);
}

}  // namespace trainscale
