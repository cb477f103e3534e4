#include <cmath>
#include <string>

#include "ops/newton_schulz/newton_schulz_internal.h"

namespace trainscale {

namespace {

void check_finite(detail::OpChecker& c, double value, const std::string& name, bool non_negative) {
  const bool ok = std::isfinite(value) && (!non_negative || value >= 0);
  if (!ok)
    c.fail(name.c_str(), non_negative ? "a finite value >= 0" : "a finite value",
           std::to_string(value));
}

// `prefix` names the options in messages ("options." or "options.newton_schulz.").
void check_newton_schulz_options(detail::OpChecker& c, const NewtonSchulzOptions& options,
                                 const std::string& prefix) {
  if (!(options.steps >= 0))
    c.fail((prefix + "steps").c_str(), "steps >= 0", std::to_string(options.steps));
  check_finite(c, options.a, prefix + "a", false);
  check_finite(c, options.b, prefix + "b", false);
  check_finite(c, options.c, prefix + "c", false);
  if (!options.per_step.empty()) {
    if (!(options.per_step.size() == static_cast<std::size_t>(options.steps)))
      c.fail((prefix + "per_step").c_str(),
             "one (a, b, c) per step: " + std::to_string(options.steps) + " entries",
             std::to_string(options.per_step.size()) + " entries");
    for (std::size_t step = 0; step < options.per_step.size(); ++step) {
      for (double coefficient : options.per_step[step]) {
        check_finite(c, coefficient, prefix + "per_step[" + std::to_string(step) + "]", false);
      }
    }
  }
  check_finite(c, options.eps, prefix + "eps", true);
}

}  // namespace

void newton_schulz(const TensorView& g, TensorView out, const NewtonSchulzOptions& options,
                   TensorView workspace, cudaStream_t stream) {
  detail::OpChecker c("newton_schulz");
  c.matrix(g, "g");
  c.like(out, "out", g, "g");
  c.optional(workspace, "workspace");
  c.outputs_disjoint({{out, "out"}, {workspace, "workspace"}}, {{g, "g"}});
  check_newton_schulz_options(c, options, "options.");
  if (detail::ran_on_cuda(c, [&] {
        ops::newton_schulz::newton_schulz_cuda(g, out, options, workspace, stream);
      })) {
    return;
  }
  ops::newton_schulz::newton_schulz_cpu(g, out, options);
}

std::size_t newton_schulz_workspace_bytes(const TensorView& g) {
  detail::OpChecker c("newton_schulz_workspace_bytes");
  c.matrix(g, "g");
#if TRAINSCALE_HAVE_CUDA
  return ops::newton_schulz::newton_schulz_workspace_bytes_cuda(g.size(0), g.size(1), g.dtype);
#else
  return 0;
#endif
}

void muon_step(TensorView param, const TensorView& grad, TensorView momentum_buffer,
               const MuonOptions& options, TensorView workspace, cudaStream_t /*stream*/) {
  detail::OpChecker c("muon_step");
  c.matrix(param, "param");
  c.like(grad, "grad", param, "param");
  c.present(momentum_buffer, "momentum_buffer")
      .float32_or_dtype_of(momentum_buffer, "momentum_buffer", param, "param")
      .same_shape(momentum_buffer, "momentum_buffer", param, "param");
  c.rows(momentum_buffer, "momentum_buffer");
  c.optional(workspace, "workspace");
  // param and momentum_buffer are updated in place; grad is read only.
  c.outputs_disjoint({{param, "param"}, {momentum_buffer, "momentum_buffer"}, {workspace, "workspace"}},
                     {{grad, "grad"}});
  check_finite(c, options.lr, "options.lr", true);
  check_finite(c, options.momentum, "options.momentum", true);
  check_finite(c, options.weight_decay, "options.weight_decay", true);
  check_newton_schulz_options(c, options.newton_schulz, "options.newton_schulz.");
  if (c.on_cuda()) detail::throw_no_cuda_kernel(c.op());
  ops::newton_schulz::muon_step_cpu(param, grad, momentum_buffer, options);
}

}  // namespace trainscale
