#include <string>

#include "ops/norm/norm_internal.h"

#include "ops/norm/norm_cuda.h"

namespace trainscale {
namespace {

using detail::OpChecker;

// residual of the fused op: x's shape, x's dtype or float32 (a float32 residual stream).
void check_residual(OpChecker& c, const TensorView& t, const char* name, const TensorView& x,
                    const char* x_name) {
  c.present(t, name).float32_or_dtype_of(t, name, x, x_name).same_shape(t, name, x, x_name);
  c.rows(t, name);
}

// weight / bias: optional, [N] contiguous, float32 or the activation's dtype.
void check_param(OpChecker& c, const TensorView& p, const char* name, const TensorView& x,
                 const char* x_name, std::int64_t cols) {
  if (!p.defined()) return;
  c.present(p, name).float32_or_dtype_of(p, name, x, x_name);
  c.ndim(p, name, 1).dim_size(p, name, 0, cols, "the row length").contiguous(p, name);
}

// dw / db: given exactly when its parameter is, then shaped and typed like it.
void check_param_grad(OpChecker& c, const TensorView& g, const char* name, const TensorView& p,
                      const char* p_name) {
  if (!p.defined()) {
    if (g.defined())
      c.fail(name, std::string("no tensor (there is no '") + p_name + "')", g.describe());
    return;
  }
  c.matches(g, name, p, p_name).contiguous(g, name);
}

// mean / rstd: one element per row, contiguous, float32 (or float64 beside float64
// activations, so finite differences are not limited by a float32 statistic).
void check_stat(OpChecker& c, const TensorView& s, const char* name, const TensorView& x,
                std::int64_t rows) {
  c.present(s, name);
  const bool float64_allowed = x.dtype == DType::kFloat64;
  const bool dtype_ok =
      s.dtype == DType::kFloat32 || (float64_allowed && s.dtype == DType::kFloat64);
  if (!dtype_ok)
    c.fail(name, float64_allowed ? "dtype in {float32, float64}" : "dtype float32",
           dtype_name(s.dtype));
  if (!(s.numel() == rows))
    c.fail(name, std::to_string(rows) + " elements (one per row)", "shape " + s.shape_str());
  c.contiguous(s, name);
}

void check_optional_stat(OpChecker& c, const TensorView& s, const char* name,
                         const TensorView& x, std::int64_t rows) {
  if (s.defined()) check_stat(c, s, name, x, rows);
}

void check_eps(OpChecker& c, double eps) {
  c.finite(eps, "options.eps", true);
}

void check_variant(OpChecker& c, NormVariant variant) {
  const int v = static_cast<int>(variant);
  if (!(v >= static_cast<int>(NormVariant::kAuto) && v <= static_cast<int>(NormVariant::kRing)))
    c.fail("options.variant", "a NormVariant", std::to_string(v));
}

void check_options(OpChecker& c, const RMSNormOptions& options) {
  check_eps(c, options.eps);
  check_variant(c, options.variant);
  c.finite(options.weight_offset, "options.weight_offset");
}

void check_options(OpChecker& c, const LayerNormOptions& options) {
  check_eps(c, options.eps);
  check_variant(c, options.variant);
}

}  // namespace

void rmsnorm_forward(const TensorView& x, const TensorView& weight, TensorView y, TensorView rstd,
                     const RMSNormOptions& options, cudaStream_t stream) {
  OpChecker c("rmsnorm_forward");
  const auto rows = c.float_rows(x, "x");
  check_param(c, weight, "weight", x, "x", rows.cols);
  c.like(y, "y", x, "x");
  check_optional_stat(c, rstd, "rstd", x, rows.rows);
  check_options(c, options);
  c.outputs_disjoint({{y, "y"}, {rstd, "rstd"}}, {{x, "x"}, {weight, "weight"}});
  if (detail::ran_on_cuda(c, [&] {
      ops::norm::rmsnorm_forward_cuda(x, weight, y, rstd, options, stream);
      })) {
    return;
  }
  ops::norm::rmsnorm_forward_cpu(x, weight, y, rstd, options);
}

void rmsnorm_backward(const TensorView& dy, const TensorView& x, const TensorView& weight,
                      const TensorView& rstd, TensorView dx, TensorView dw, TensorView workspace,
                      const RMSNormOptions& options, cudaStream_t stream) {
  OpChecker c("rmsnorm_backward");
  const auto rows = c.float_rows(x, "x");
  c.like(dy, "dy", x, "x");
  check_param(c, weight, "weight", x, "x", rows.cols);
  check_stat(c, rstd, "rstd", x, rows.rows);
  c.like(dx, "dx", x, "x");
  check_param_grad(c, dw, "dw", weight, "weight");
  c.optional(workspace, "workspace");
  check_options(c, options);
  c.outputs_disjoint({{dx, "dx"}, {dw, "dw"}, {workspace, "workspace"}},
                     {{dy, "dy"}, {x, "x"}, {weight, "weight"}, {rstd, "rstd"}}, "dx", "dy");
  if (detail::ran_on_cuda(c, [&] {
      ops::norm::rmsnorm_backward_cuda(dy, x, weight, rstd, dx, dw, workspace, options, stream);
      })) {
    return;
  }
  ops::norm::rmsnorm_backward_cpu(dy, x, weight, rstd, dx, dw, options);
}

namespace {

// Both fused add forwards: the inputs, rstd and the options checked, then the outputs
// (check_outputs), then the CUDA kernels or the CPU reference.
template <class CheckOutputs>
void run_fused_add_rmsnorm_forward(const TensorView& x, const TensorView& residual,
                                   const TensorView& weight, TensorView y, TensorView residual_out,
                                   TensorView rstd, const RMSNormOptions& options,
                                   cudaStream_t stream, CheckOutputs&& check_outputs) {
  OpChecker c("fused_add_rmsnorm_forward");
  const auto rows = c.float_rows(x, "x");
  check_residual(c, residual, "residual", x, "x");
  check_param(c, weight, "weight", x, "x", rows.cols);
  check_optional_stat(c, rstd, "rstd", x, rows.rows);
  check_options(c, options);
  check_outputs(c);
  if (detail::ran_on_cuda(c, [&] {
      ops::norm::fused_add_rmsnorm_forward_cuda(x, residual, weight, y, residual_out, rstd, options,
                                                stream);
      })) {
    return;
  }
  ops::norm::fused_add_rmsnorm_forward_cpu(x, residual, weight, y, residual_out, rstd, options);
}

}  // namespace

void fused_add_rmsnorm_forward(TensorView x, TensorView residual, const TensorView& weight,
                               TensorView rstd, const RMSNormOptions& options,
                               cudaStream_t stream) {
  run_fused_add_rmsnorm_forward(x, residual, weight, x, residual, rstd, options, stream, [&](OpChecker& c) {
    c.outputs_disjoint({{x, "x"}, {residual, "residual"}, {rstd, "rstd"}}, {{weight, "weight"}});
  });
}

void fused_add_rmsnorm_forward(const TensorView& x, const TensorView& residual,
                               const TensorView& weight, TensorView y, TensorView residual_out,
                               TensorView rstd, const RMSNormOptions& options,
                               cudaStream_t stream) {
  run_fused_add_rmsnorm_forward(x, residual, weight, y, residual_out, rstd, options, stream, [&](OpChecker& c) {
    c.like(y, "y", x, "x");
    c.like(residual_out, "residual_out", residual, "residual");
    c.outputs_disjoint({{y, "y"}, {residual_out, "residual_out"}, {rstd, "rstd"}},
                       {{x, "x"}, {residual, "residual"}, {weight, "weight"}});
  });
}

void fused_add_rmsnorm_backward(const TensorView& dy, const TensorView& d_residual,
                                const TensorView& residual, const TensorView& weight,
                                const TensorView& rstd, TensorView dx, TensorView dw,
                                TensorView workspace, const RMSNormOptions& options,
                                cudaStream_t stream) {
  OpChecker c("fused_add_rmsnorm_backward");
  const auto rows = c.float_rows(dy, "dy");
  check_residual(c, residual, "residual", dy, "dy");
  if (d_residual.defined()) c.like(d_residual, "d_residual", residual, "residual");
  check_param(c, weight, "weight", dy, "dy", rows.cols);
  check_stat(c, rstd, "rstd", dy, rows.rows);
  c.like(dx, "dx", dy, "dy");
  check_param_grad(c, dw, "dw", weight, "weight");
  c.optional(workspace, "workspace");
  check_options(c, options);
  c.outputs_disjoint({{dx, "dx"}, {dw, "dw"}, {workspace, "workspace"}},
                     {{dy, "dy"}, {d_residual, "d_residual"}, {residual, "residual"},
                      {weight, "weight"}, {rstd, "rstd"}},
                     "dx", "dy");
  if (detail::ran_on_cuda(c, [&] {
      ops::norm::fused_add_rmsnorm_backward_cuda(dy, d_residual, residual, weight, rstd, dx, dw,
                                                 workspace, options, stream);
      })) {
    return;
  }
  ops::norm::fused_add_rmsnorm_backward_cpu(dy, d_residual, residual, weight, rstd, dx, dw,
                                            options);
}

void layernorm_forward(const TensorView& x, const TensorView& weight, const TensorView& bias,
                       TensorView y, TensorView mean, TensorView rstd,
                       const LayerNormOptions& options, cudaStream_t stream) {
  OpChecker c("layernorm_forward");
  const auto rows = c.float_rows(x, "x");
  check_param(c, weight, "weight", x, "x", rows.cols);
  check_param(c, bias, "bias", x, "x", rows.cols);
  c.like(y, "y", x, "x");
  check_optional_stat(c, mean, "mean", x, rows.rows);
  check_optional_stat(c, rstd, "rstd", x, rows.rows);
  check_options(c, options);
  c.outputs_disjoint({{y, "y"}, {mean, "mean"}, {rstd, "rstd"}},
                     {{x, "x"}, {weight, "weight"}, {bias, "bias"}});
  if (detail::ran_on_cuda(c, [&] {
      ops::norm::layernorm_forward_cuda(x, weight, bias, y, mean, rstd, options, stream);
      })) {
    return;
  }
  ops::norm::layernorm_forward_cpu(x, weight, bias, y, mean, rstd, options);
}

void layernorm_backward(const LayerNormBackwardArgs& args, const LayerNormOptions& options,
                        cudaStream_t stream) {
  const auto& [dy, x, weight, mean, rstd, dx, dw, db, workspace] = args;
  OpChecker c("layernorm_backward");
  const auto rows = c.float_rows(x, "x");
  c.like(dy, "dy", x, "x");
  check_param(c, weight, "weight", x, "x", rows.cols);
  check_stat(c, mean, "mean", x, rows.rows);
  check_stat(c, rstd, "rstd", x, rows.rows);
  c.like(dx, "dx", x, "x");
  check_param_grad(c, dw, "dw", weight, "weight");
  // The bias is no input of the backward pass, so db is optional and checked like a bias.
  check_param(c, db, "db", x, "x", rows.cols);
  c.optional(workspace, "workspace");
  check_options(c, options);
  c.outputs_disjoint({{dx, "dx"}, {dw, "dw"}, {db, "db"}, {workspace, "workspace"}},
                     {{dy, "dy"}, {x, "x"}, {weight, "weight"}, {mean, "mean"}, {rstd, "rstd"}},
                     "dx", "dy");
  if (detail::ran_on_cuda(c, [&] {
      ops::norm::layernorm_backward_cuda(dy, x, weight, mean, rstd, dx, dw, db, workspace, options, stream);
      })) {
    return;
  }
  ops::norm::layernorm_backward_cpu(dy, x, weight, mean, rstd, dx, dw, db);
}

std::size_t norm_backward_workspace_bytes(std::int64_t rows, std::int64_t cols, DType dtype,
                                          Device device) {
  OpChecker c("norm_backward_workspace_bytes");
  if (!(rows >= 0 && cols >= 0))
    c.fail("rows/cols", "non-negative sizes", std::to_string(rows) + " x " + std::to_string(cols));
  if (!(dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16 ||
        dtype == DType::kFloat64))
    c.fail("dtype", "a float dtype", dtype_name(dtype));
  if (!device.is_cuda()) return 0;
#if TRAINSCALE_HAVE_CUDA
  return ops::norm::backward_workspace_bytes_cuda(rows, cols, dtype);
#else
  detail::throw_no_cuda_build(c.op());
#endif
}

}  // namespace trainscale
