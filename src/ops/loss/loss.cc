#include <cmath>

#include "ops/loss/loss_internal.h"

#include "ops/loss/fused_linear_plan.h"
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
  if (reduction == Reduction::kNone) {
    c.like(t, name, a, "a");
  } else {
    c.present(t, name);
    check_reduced_value(c, t, name, reduction);
  }
}

void check_options(detail::OpChecker& c, const CrossEntropyOptions& o) {
  const double e = o.label_smoothing;
  if (!(std::isfinite(e) && e >= 0 && e <= 1))
    c.fail("options.label_smoothing", "a value in [0, 1]", detail::format_number(e));
  c.finite(o.z_loss, "options.z_loss", true);
  if (!(std::isfinite(o.softcap) && o.softcap >= 0))
    c.fail("options.softcap", "a finite value >= 0 (0 turns it off)",
           detail::format_number(o.softcap));
  const bool known = o.reduction == Reduction::kNone || o.reduction == Reduction::kMean ||
                     o.reduction == Reduction::kSum;
  if (!known)
    c.fail("options.reduction", "none, mean or sum",
           "enum value " + std::to_string(static_cast<int>(o.reduction)));
  const bool known_kernel = o.kernel == CrossEntropyKernel::kAuto || o.kernel == CrossEntropyKernel::kHeld ||
                            o.kernel == CrossEntropyKernel::kStreamed || o.kernel == CrossEntropyKernel::kHeldDirect;
  if (!known_kernel)
    c.fail("options.kernel", "auto, held, streamed or held_direct",
           "enum value " + std::to_string(static_cast<int>(o.kernel)));
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

// [M, V] logits with V >= 1; returns M.
std::int64_t check_logits(detail::OpChecker& c, const TensorView& logits) {
  const std::int64_t rows = c.matrix(logits, "logits").rows;
  if (!(logits.size(1) >= 1))
    c.fail("logits", "at least one class (V >= 1)", "shape " + logits.shape_str());
  return rows;
}

}  // namespace

void mse_forward(const TensorView& a, const TensorView& b, TensorView out, Reduction reduction,
                 cudaStream_t stream) {
  detail::OpChecker c("mse_forward");
  c.float_rows(a, "a");
  c.like(b, "b", a, "a");
  check_loss_value(c, out, "out", a, reduction);
  c.outputs_disjoint({{out, "out"}}, {{a, "a"}, {b, "b"}});
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
  c.float_rows(a, "a");
  c.like(b, "b", a, "a");
  check_loss_value(c, grad_out, "grad_out", a, reduction);
  if (grad_a.defined()) c.like(grad_a, "grad_a", a, "a");
  if (grad_b.defined()) c.like(grad_b, "grad_b", a, "a");
  c.outputs_disjoint({{grad_a, "grad_a"}, {grad_b, "grad_b"}},
                     {{a, "a"}, {b, "b"}, {grad_out, "grad_out"}});
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
  if (grad_logits.defined()) c.like(grad_logits, "grad_logits", logits, "logits");
  c.outputs_disjoint({{loss, "loss"}, {lse, "lse"}, {grad_logits, "grad_logits"}},
                     {{logits, "logits"}, {targets, "targets"}}, "grad_logits", "logits");
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
  c.like(grad_logits, "grad_logits", logits, "logits");
  c.outputs_disjoint({{grad_logits, "grad_logits"}},
                     {{grad_loss, "grad_loss"}, {logits, "logits"}, {targets, "targets"}, {lse, "lse"}},
                     "grad_logits", "logits");
  if (detail::ran_on_cuda(c, [&] {
        ops::loss::cross_entropy_backward_cuda(grad_loss, logits, targets, lse, grad_logits,
                                               options, stream);
      })) {
    return;
  }
  ops::loss::cross_entropy_backward_cpu(grad_loss, logits, targets, lse, grad_logits, options);
}

namespace {

// Validates every argument of fused_linear_cross_entropy_forward (all but the workspace's
// size, which the CUDA path checks against its plan).
void check_fused_linear(detail::OpChecker& c, const FusedLinearCrossEntropyArgs& a,
                        const CrossEntropyOptions& options) {
  const std::int64_t tokens = c.matrix(a.hidden, "hidden").rows;
  const std::int64_t classes = c.matrix(a.weight, "weight").rows;
  c.same_dtype(a.weight, "weight", a.hidden, "hidden");
  c.dim_size(a.weight, "weight", 1, a.hidden.size(1), "the hidden size of 'hidden'");
  if (!(classes >= 1))
    c.fail("weight", "at least one class (V >= 1)", "shape " + a.weight.shape_str());
  if (a.bias.defined()) {
    c.present(a.bias, "bias").same_dtype(a.bias, "bias", a.hidden, "hidden").ndim(a.bias, "bias", 1);
    c.dim_size(a.bias, "bias", 0, classes, "one per row of 'weight'");
  }
  check_targets(c, a.targets, tokens, "one per row of 'hidden'");
  check_options(c, options);
  check_row_loss(c, a.loss, "loss", tokens, "one per row of 'hidden'", options.reduction);
  if (a.lse.defined()) check_row_values(c, a.lse, "lse", tokens, "one per row of 'hidden'");
  if (a.grad_loss.defined())
    check_row_loss(c, a.grad_loss, "grad_loss", tokens, "one per row of 'hidden'", options.reduction);
  if (a.grad_hidden.defined()) c.like(a.grad_hidden, "grad_hidden", a.hidden, "hidden");
  if (a.grad_weight.defined()) c.like(a.grad_weight, "grad_weight", a.weight, "weight");
  if (a.grad_bias.defined()) {
    if (!(a.bias.defined()))
      c.fail("grad_bias", "a 'bias' to differentiate", "grad_bias without bias");
    c.matches(a.grad_bias, "grad_bias", a.bias, "bias");
  }
  if (!(a.chunk_tokens >= 0))
    c.fail("chunk_tokens", "a count >= 0 (0 chooses it)", std::to_string(a.chunk_tokens));
  if (!(a.grad_weight_accumulation == DType::kFloat32 ||
        a.grad_weight_accumulation == a.weight.dtype))
    c.fail("grad_weight_accumulation", std::string("float32 or the weight's dtype (") +
                                           dtype_name(a.weight.dtype) + ")",
           dtype_name(a.grad_weight_accumulation));
  c.outputs_disjoint({{a.loss, "loss"}, {a.lse, "lse"}, {a.grad_hidden, "grad_hidden"},
                      {a.grad_weight, "grad_weight"}, {a.grad_bias, "grad_bias"},
                      {a.workspace, "workspace"}},
                     {{a.hidden, "hidden"}, {a.weight, "weight"}, {a.bias, "bias"},
                      {a.targets, "targets"}, {a.grad_loss, "grad_loss"}});
}

}  // namespace

void fused_linear_cross_entropy_forward(const FusedLinearCrossEntropyArgs& args,
                                        const CrossEntropyOptions& options, cudaStream_t stream) {
  detail::OpChecker c("fused_linear_cross_entropy_forward");
  check_fused_linear(c, args, options);
  if (detail::ran_on_cuda(c, [&] {
        ops::loss::fused_linear_cross_entropy_forward_cuda(args, options, stream);
      })) {
    return;
  }
  ops::loss::fused_linear_cross_entropy_forward_cpu(args, options);
}

std::size_t fused_linear_cross_entropy_workspace_bytes(const FusedLinearCrossEntropyArgs& args,
                                                       const CrossEntropyOptions& options) {
  detail::OpChecker c("fused_linear_cross_entropy_workspace_bytes");
  c.matrix(args.hidden, "hidden");
  c.matrix(args.weight, "weight");
  return ops::loss::plan_fused_linear(args, options).bytes;
}

}  // namespace trainscale
