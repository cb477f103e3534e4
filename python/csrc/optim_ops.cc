// The optimizer family as torch.ops.trainscale ops: python/trainscale/optim.py wraps them, the
// entry points are in include/trainscale/optim.h. The norm's outputs and workspace are
// allocated here (the workspace through torch's caching allocator).
#include <vector>

#include "binding.h"
#include "trainscale/optim.h"

namespace trainscale::binding {
namespace {

std::vector<ts::TensorView> views(at::TensorList list, const char* op, const char* arg) {
  std::vector<ts::TensorView> out;
  out.reserve(list.size());
  for (const Tensor& t : list) out.push_back(view(t, op, arg));
  return out;
}

void adamw_step_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 double lr, double beta1, double beta2, double eps, double weight_decay, std::int64_t step,
                 const OptTensor& grad_scale) {
  constexpr const char* op = "adamw_step";
  if (params.empty()) return;
  Ctx ctx(params[0], op, "params");
  const ts::AdamWOptions options{
      .lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps, .weight_decay = weight_decay, .step = step};
  guarded([&] {
    ts::adamw_step(views(params, op, "params"), views(grads, op, "grads"), views(exp_avgs, op, "exp_avgs"),
                   views(exp_avg_sqs, op, "exp_avg_sqs"), options, view(grad_scale, op, "grad_scale"), ctx.stream);
  });
}

std::tuple<Tensor, Tensor> grad_norm(at::TensorList grads, double max_norm) {
  constexpr const char* op = "grad_norm";
  if (grads.empty()) arg_error(op, "grads", "expected at least one tensor, got none");
  Ctx ctx(grads[0], op, "grads");
  const auto options = grads[0].options().dtype(at::kFloat);
  Tensor norm = at::empty({}, options), factor = at::empty({}, options);
  guarded([&] {
    const std::vector<ts::TensorView> g = views(grads, op, "grads");
    Tensor ws;
    if (grads[0].is_cuda()) {
      const std::size_t bytes = ts::grad_norm_workspace_bytes(g);
      ws = at::empty({static_cast<std::int64_t>((bytes + 7) / 8)}, grads[0].options().dtype(at::kLong));
    }
    ts::grad_norm(g, max_norm, view(norm, op, "norm"), view(factor, op, "clip_factor"),
                  ws.defined() ? workspace_view(ws, op, "workspace") : ts::TensorView{}, ctx.stream);
  });
  return {norm, factor};
}

void scale_by_device_factor_(at::TensorList tensors, const Tensor& factor) {
  constexpr const char* op = "scale_by_device_factor";
  if (tensors.empty()) return;
  Ctx ctx(tensors[0], op, "tensors");
  guarded([&] { ts::scale_by_device_factor(views(tensors, op, "tensors"), view(factor, op, "factor"), ctx.stream); });
}

}  // namespace
}  // namespace trainscale::binding

TORCH_LIBRARY_FRAGMENT(trainscale, m) {
  using namespace trainscale::binding;
  def_op(m,
         "adamw_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, float lr, "
         "float beta1, float beta2, float eps, float weight_decay, int step, Tensor? grad_scale) -> ()",
         &adamw_step_);
  def_op(m, "grad_norm(Tensor[] grads, float max_norm) -> (Tensor, Tensor)", &grad_norm);
  def_op(m, "scale_by_device_factor_(Tensor(a!)[] tensors, Tensor factor) -> ()", &scale_by_device_factor_);
}
