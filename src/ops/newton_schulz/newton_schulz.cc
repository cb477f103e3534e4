#include <span>
#include <string>
#include <vector>

#include "ops/newton_schulz/newton_schulz_internal.h"

namespace trainscale {

namespace {

using detail::Arg;

// `prefix` names the options in messages ("options." or "options.newton_schulz.").
void check_newton_schulz_options(detail::OpChecker& c, const NewtonSchulzOptions& options,
                                 const std::string& prefix) {
  if (!(options.steps >= 0))
    c.fail((prefix + "steps").c_str(), "steps >= 0", std::to_string(options.steps));
  c.finite(options.a, (prefix + "a").c_str()).finite(options.b, (prefix + "b").c_str())
      .finite(options.c, (prefix + "c").c_str());
  if (!options.per_step.empty()) {
    if (!(options.per_step.size() == static_cast<std::size_t>(options.steps)))
      c.fail((prefix + "per_step").c_str(),
             "one (a, b, c) per step: " + std::to_string(options.steps) + " entries",
             std::to_string(options.per_step.size()) + " entries");
    for (std::size_t step = 0; step < options.per_step.size(); ++step) {
      for (double coefficient : options.per_step[step]) {
        c.finite(coefficient, (prefix + "per_step[" + std::to_string(step) + "]").c_str());
      }
    }
  }
  c.finite(options.eps, (prefix + "eps").c_str(), true);
  if (!(options.method == NewtonSchulzMethod::kStandard || options.method == NewtonSchulzMethod::kGram))
    c.fail((prefix + "method").c_str(), "kStandard or kGram",
           std::to_string(static_cast<int>(options.method)));
}

constexpr std::int64_t kMaxMatrices = 65535;

// g: a matrix [R, C] or a batch [N, R, C] (1 <= N <= 65535) of rows of one stride.
void batch_of_matrices(detail::OpChecker& c, const TensorView& g, const char* name) {
  c.present(g, name).dtype_in(g, name, detail::kFloatDTypes);
  if (!(g.ndim == 2 || g.ndim == 3))
    c.fail(name, "a matrix [R, C] or a batch of matrices [N, R, C]", g.describe());
  if (g.ndim == 3 && !(g.size(0) <= kMaxMatrices))
    c.fail(name, "at most " + std::to_string(kMaxMatrices) + " matrices", g.shape_str());
  c.rows(g, name);
}

std::int64_t matrices_in(const TensorView& g) { return g.ndim == 3 ? g.size(0) : 1; }

}  // namespace

void newton_schulz(const TensorView& g, TensorView out, const NewtonSchulzOptions& options,
                   TensorView workspace, cudaStream_t stream) {
  detail::OpChecker c("newton_schulz");
  batch_of_matrices(c, g, "g");
  c.like(out, "out", g, "g");
  c.optional(workspace, "workspace");
  c.outputs_disjoint({{out, "out"}, {workspace, "workspace"}}, {{g, "g"}});
  check_newton_schulz_options(c, options, "options.");
  if (detail::ran_on_cuda(c, [&] {
        ops::newton_schulz::newton_schulz_cuda(
            g, out, options, workspace, stream,
            ops::newton_schulz::gram_blocks(std::min(g.size(-2), g.size(-1))));
      })) {
    return;
  }
  ops::newton_schulz::newton_schulz_cpu(g, out, options);
}

std::size_t newton_schulz_workspace_bytes(const TensorView& g) {
  detail::OpChecker c("newton_schulz_workspace_bytes");
  batch_of_matrices(c, g, "g");
#if TRAINSCALE_HAVE_CUDA
  return ops::newton_schulz::newton_schulz_workspace_bytes_cuda(matrices_in(g), g.size(-2), g.size(-1), g.dtype);
#else
  return 0;
#endif
}

namespace {

// The arguments of a muon_step, one parameter or a list ("params[3]", ...).
void check_muon_arguments(detail::OpChecker& c, std::span<const TensorView> params,
                          std::span<const TensorView> grads, std::span<const TensorView> buffers,
                          const TensorView& workspace, const MuonOptions& options, bool list) {
  if (!(grads.size() == params.size()))
    c.fail("grads", "one per parameter: " + std::to_string(params.size()), std::to_string(grads.size()));
  if (!(buffers.size() == params.size()))
    c.fail("momentum_buffers", "one per parameter: " + std::to_string(params.size()),
           std::to_string(buffers.size()));
  const auto name = [&](const char* single, const char* plural, std::size_t i) {
    return list ? std::string(plural) + "[" + std::to_string(i) + "]" : std::string(single);
  };
  std::vector<std::string> names;  // params, grads, buffers: stable storage for the checker
  names.reserve(3 * params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::string& p = names.emplace_back(name("param", "params", i));
    const std::string& g = names.emplace_back(name("grad", "grads", i));
    const std::string& b = names.emplace_back(name("momentum_buffer", "momentum_buffers", i));
    if (i == 0) {
      c.matrix(params[0], p.c_str());
    } else {
      c.like(params[i], p.c_str(), params[0], names[0].c_str());
    }
    c.like(grads[i], g.c_str(), params[i], p.c_str());
    c.present(buffers[i], b.c_str())
        .float32_or_dtype_of(buffers[i], b.c_str(), params[i], p.c_str())
        .same_shape(buffers[i], b.c_str(), params[i], p.c_str());
    if (i > 0) c.same_dtype(buffers[i], b.c_str(), buffers[0], names[2].c_str());
    c.rows(buffers[i], b.c_str());
  }
  c.optional(workspace, "workspace");
  // Parameters, buffers and the workspace are written, grads only read.
  std::vector<Arg> written, read;
  for (std::size_t i = 0; i < params.size(); ++i) {
    written.push_back({params[i], names[3 * i].c_str()});
    written.push_back({buffers[i], names[3 * i + 2].c_str()});
    read.push_back({grads[i], names[3 * i + 1].c_str()});
  }
  written.push_back({workspace, "workspace"});
  c.updates_disjoint(written, read);
  c.finite(options.lr, "options.lr", true)
      .finite(options.momentum, "options.momentum", true)
      .finite(options.weight_decay, "options.weight_decay", true);
  check_newton_schulz_options(c, options.newton_schulz, "options.newton_schulz.");
}

void run_muon(detail::OpChecker& c, std::span<const TensorView> params, std::span<const TensorView> grads,
              std::span<const TensorView> buffers, const MuonOptions& options, const TensorView& workspace,
              cudaStream_t stream) {
  if (detail::ran_on_cuda(c, [&] {
        ops::newton_schulz::muon_step_cuda(params, grads, buffers, options, workspace, stream);
      })) {
    return;
  }
  for (std::size_t i = 0; i < params.size(); ++i)
    ops::newton_schulz::muon_step_cpu(params[i], grads[i], buffers[i], options);
}

}  // namespace

void muon_step(TensorView param, const TensorView& grad, TensorView momentum_buffer,
               const MuonOptions& options, TensorView workspace, cudaStream_t stream) {
  detail::OpChecker c("muon_step");
  const std::span<const TensorView> p(&param, 1), g(&grad, 1), b(&momentum_buffer, 1);
  check_muon_arguments(c, p, g, b, workspace, options, false);
  run_muon(c, p, g, b, options, workspace, stream);
}

void muon_step(std::span<const TensorView> params, std::span<const TensorView> grads,
               std::span<const TensorView> momentum_buffers, const MuonOptions& options,
               TensorView workspace, cudaStream_t stream) {
  detail::OpChecker c("muon_step");
  if (params.empty()) return;
  check_muon_arguments(c, params, grads, momentum_buffers, workspace, options, true);
  run_muon(c, params, grads, momentum_buffers, options, workspace, stream);
}

std::size_t muon_step_workspace_bytes(const TensorView& param, std::int64_t count) {
  detail::OpChecker c("muon_step_workspace_bytes");
  c.matrix(param, "param");
  if (!(count >= 1)) c.fail("count", "count >= 1", std::to_string(count));
#if TRAINSCALE_HAVE_CUDA
  return ops::newton_schulz::muon_step_workspace_bytes_cuda(count, param.size(0), param.size(1), param.dtype);
#else
  return 0;
#endif
}

}  // namespace trainscale
