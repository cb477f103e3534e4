// The Newton-Schulz family as torch.ops.trainscale ops: python/trainscale/optim.py wraps them,
// the entry points are in include/trainscale/newton_schulz.h. Outputs and the CUDA workspace
// are allocated here (the workspace through torch's caching allocator, 256-byte aligned).
#include <string>
#include <vector>

#include "binding.h"
#include "trainscale/newton_schulz.h"

namespace trainscale::binding {
namespace {

ts::NewtonSchulzMethod method_of(const char* op, const std::string& name) {
  if (name == "standard") return ts::NewtonSchulzMethod::kStandard;
  if (name == "gram") return ts::NewtonSchulzMethod::kGram;
  arg_error(op, "method", "expected standard or gram, got " + name);
}

ts::NewtonSchulzOptions ns_options(const char* op, std::int64_t steps, double a, double b, double c, double eps,
                                   const std::string& method) {
  return {.steps = static_cast<int>(steps), .a = a, .b = b, .c = c, .per_step = {}, .eps = eps,
          .method = method_of(op, method)};
}

// `bytes` of scratch on t's device (none on the CPU).
Tensor workspace_for(const Tensor& t, std::size_t bytes) {
  if (!t.is_cuda()) return Tensor();
  return at::empty({static_cast<std::int64_t>((bytes + 7) / 8)}, t.options().dtype(at::kLong));
}

ts::MuonLrAdjust lr_adjust_of(const std::string& name) {
  if (name == "original") return ts::MuonLrAdjust::kOriginal;
  if (name == "match_rms_adamw") return ts::MuonLrAdjust::kMatchRmsAdamW;
  if (name == "spectral_unclamped") return ts::MuonLrAdjust::kSpectralUnclamped;
  arg_error("muon_step", "lr_adjust", "expected original, match_rms_adamw or spectral_unclamped, got " + name);
}

Tensor newton_schulz(const Tensor& g, std::int64_t steps, double a, double b, double c, double eps,
                     const std::string& method) {
  constexpr const char* op = "newton_schulz";
  Ctx ctx(g, op, "g");
  Tensor out = at::empty_like(g, at::MemoryFormat::Contiguous);
  guarded([&] {
    const ts::TensorView gv = view(g, op, "g");
    const Tensor ws = workspace_for(g, ts::newton_schulz_workspace_bytes(gv));
    ts::newton_schulz(gv, view(out, op, "out"), ns_options(op, steps, a, b, c, eps, method),
                      ws.defined() ? workspace_view(ws, op, "workspace") : ts::TensorView{}, ctx.stream);
  });
  return out;
}

void muon_step_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, double lr,
                double momentum, double weight_decay, bool nesterov, const std::string& lr_adjust,
                std::int64_t steps, double a, double b, double c, double eps, const std::string& ns_method) {
  constexpr const char* op = "muon_step";
  if (params.empty()) return;
  Ctx ctx(params[0], op, "params");
  const ts::MuonOptions options{.lr = lr,
                                .momentum = momentum,
                                .weight_decay = weight_decay,
                                .nesterov = nesterov,
                                .lr_adjust = lr_adjust_of(lr_adjust),
                                .newton_schulz = ns_options(op, steps, a, b, c, eps, ns_method)};
  guarded([&] {
    std::vector<ts::TensorView> p, g, m;
    for (const Tensor& t : params) p.push_back(view(t, op, "params"));
    for (const Tensor& t : grads) g.push_back(view(t, op, "grads"));
    for (const Tensor& t : momentum_buffers) m.push_back(view(t, op, "momentum_buffers"));
    const Tensor ws = workspace_for(params[0], ts::muon_step_workspace_bytes(p[0], static_cast<std::int64_t>(p.size())));
    ts::muon_step(p, g, m, options, ws.defined() ? workspace_view(ws, op, "workspace") : ts::TensorView{}, ctx.stream);
  });
}

}  // namespace
}  // namespace trainscale::binding

TORCH_LIBRARY_FRAGMENT(trainscale, m) {
  using namespace trainscale::binding;
  def_op(m, "newton_schulz(Tensor g, int steps, float a, float b, float c, float eps, str method) -> Tensor",
         &newton_schulz);
  def_op(m,
         "muon_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, float lr, float momentum, "
         "float weight_decay, bool nesterov, str lr_adjust, int steps, float a, float b, float c, float eps, "
         "str ns_method) -> ()",
         &muon_step_);
}
