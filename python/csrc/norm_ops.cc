// The norm family as torch.ops.trainscale ops: python/trainscale/norm.py wraps them, the
// entry points are in include/trainscale/norm.h. Outputs are allocated here.
#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "binding.h"
#include "trainscale/norm.h"

namespace trainscale::binding {
namespace {

std::int64_t rows_of(const Tensor& x) {
  return x.dim() == 0 || x.size(-1) == 0 ? 0 : x.numel() / x.size(-1);
}
at::ScalarType stat_dtype(const Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}
Tensor stat_empty(const Tensor& x) {
  auto sizes = x.sizes().vec();
  if (!sizes.empty()) sizes.pop_back();
  return at::empty(sizes, x.options().dtype(stat_dtype(x)));
}
Tensor workspace(const Tensor& x, const char* op) {
  std::size_t bytes = ts::norm_backward_workspace_bytes(
      rows_of(x), x.dim() ? x.size(-1) : 0, to_dtype(x.scalar_type(), op, "x"),
      x.is_cuda() ? ts::Device::cuda(x.get_device()) : ts::Device::cpu());
  return at::empty({static_cast<std::int64_t>(bytes)}, x.options().dtype(at::kByte));
}
Tensor grad_like(const OptTensor& w, const Tensor& x) {
  return w.has_value() && w->defined() ? at::empty_like(*w, at::MemoryFormat::Contiguous)
                                       : at::empty({0}, x.options());
}

// ---- norms ----------------------------------------------------------------------------------

std::tuple<Tensor, Tensor> rmsnorm_forward(const Tensor& x, const OptTensor& weight, double eps,
                                       double weight_offset) {
  const char* op = "rmsnorm_forward";
  Ctx ctx(x, op, "x");
  Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  Tensor rstd = stat_empty(x);
  guarded([&] {
    ts::rmsnorm_forward(view(x, op, "x"), view(weight, op, "weight"), view(y, op, "y"),
                        view(rstd, op, "rstd"), {.eps = eps, .weight_offset = weight_offset},
                        ctx.stream);
  });
  return {y, rstd};
}

std::tuple<Tensor, Tensor> rmsnorm_backward(const Tensor& dy, const Tensor& x, const OptTensor& weight,
                                       const Tensor& rstd, double eps, double weight_offset) {
  const char* op = "rmsnorm_backward";
  Ctx ctx(x, op, "x");
  Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  Tensor dw = grad_like(weight, x);
  Tensor ws = workspace(x, op);
  guarded([&] {
    ts::rmsnorm_backward(view(dy, op, "dy"), view(x, op, "x"), view(weight, op, "weight"),
                         view(rstd, op, "rstd"), view(dx, op, "dx"),
                         weight.has_value() ? view(dw, op, "dw") : ts::TensorView{},
                         workspace_view(ws, op, "workspace"), {.eps = eps, .weight_offset = weight_offset},
                         ctx.stream);
  });
  return {dx, dw};
}

Tensor fused_add_rmsnorm_forward(Tensor& x, Tensor& residual, const OptTensor& weight, double eps,
                             double weight_offset) {
  const char* op = "fused_add_rmsnorm_forward";
  Ctx ctx(x, op, "x");
  Tensor rstd = stat_empty(x);
  guarded([&] {
    ts::fused_add_rmsnorm_forward(view(x, op, "x"), view(residual, op, "residual"),
                                  view(weight, op, "weight"), view(rstd, op, "rstd"),
                                  {.eps = eps, .weight_offset = weight_offset}, ctx.stream);
  });
  return rstd;
}

// Out of place: (y, x + residual, rstd), x and residual unchanged.
std::tuple<Tensor, Tensor, Tensor> fused_add_rmsnorm_forward_out_of_place(const Tensor& x, const Tensor& residual,
                                                                     const OptTensor& weight, double eps,
                                                                     double weight_offset) {
  const char* op = "fused_add_rmsnorm_forward";
  Ctx ctx(x, op, "x");
  Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  Tensor sum = at::empty_like(residual, at::MemoryFormat::Contiguous);
  Tensor rstd = stat_empty(x);
  guarded([&] {
    ts::fused_add_rmsnorm_forward(view(x, op, "x"), view(residual, op, "residual"), view(weight, op, "weight"),
                                  view(y, op, "y"), view(sum, op, "residual_out"), view(rstd, op, "rstd"),
                                  {.eps = eps, .weight_offset = weight_offset}, ctx.stream);
  });
  return {y, sum, rstd};
}

std::tuple<Tensor, Tensor> fused_add_rmsnorm_backward(const Tensor& dy, const OptTensor& d_residual,
                                                 const Tensor& residual, const OptTensor& weight,
                                                 const Tensor& rstd, double eps,
                                                 double weight_offset) {
  const char* op = "fused_add_rmsnorm_backward";
  Ctx ctx(dy, op, "dy");
  Tensor dx = at::empty_like(dy, at::MemoryFormat::Contiguous);
  Tensor dw = grad_like(weight, dy);
  Tensor ws = workspace(dy, op);
  guarded([&] {
    ts::fused_add_rmsnorm_backward(
        view(dy, op, "dy"), view(d_residual, op, "d_residual"), view(residual, op, "residual"),
        view(weight, op, "weight"), view(rstd, op, "rstd"), view(dx, op, "dx"),
        weight.has_value() ? view(dw, op, "dw") : ts::TensorView{}, workspace_view(ws, op, "workspace"),
        {.eps = eps, .weight_offset = weight_offset}, ctx.stream);
  });
  return {dx, dw};
}

std::tuple<Tensor, Tensor, Tensor> layernorm_forward(const Tensor& x, const OptTensor& weight,
                                                 const OptTensor& bias, double eps) {
  const char* op = "layernorm_forward";
  Ctx ctx(x, op, "x");
  Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  Tensor mean = stat_empty(x);
  Tensor rstd = stat_empty(x);
  guarded([&] {
    ts::layernorm_forward(view(x, op, "x"), view(weight, op, "weight"), view(bias, op, "bias"),
                          view(y, op, "y"), view(mean, op, "mean"), view(rstd, op, "rstd"),
                          {.eps = eps}, ctx.stream);
  });
  return {y, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> layernorm_backward(const Tensor& dy, const Tensor& x,
                                                 const OptTensor& weight, const OptTensor& bias,
                                                 const Tensor& mean, const Tensor& rstd,
                                                 double eps) {
  const char* op = "layernorm_backward";
  Ctx ctx(x, op, "x");
  Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  Tensor dw = grad_like(weight, x);
  Tensor db = grad_like(bias, x);
  Tensor ws = workspace(x, op);
  guarded([&] {
    ts::layernorm_backward({.dy = view(dy, op, "dy"), .x = view(x, op, "x"),
                            .weight = view(weight, op, "weight"), .mean = view(mean, op, "mean"),
                            .rstd = view(rstd, op, "rstd"), .dx = view(dx, op, "dx"),
                            .dw = weight.has_value() ? view(dw, op, "dw") : ts::TensorView{},
                            .db = bias.has_value() ? view(db, op, "db") : ts::TensorView{},
                            .workspace = workspace_view(ws, op, "workspace")}, {.eps = eps}, ctx.stream);
  });
  return {dx, dw, db};
}

}  // namespace
}  // namespace trainscale::binding

TORCH_LIBRARY_FRAGMENT(trainscale, m) {
  using namespace trainscale::binding;
  def_op(m, "rmsnorm_forward(Tensor x, Tensor? weight, float eps, float weight_offset) -> (Tensor, Tensor)",
         &rmsnorm_forward);
  def_op(m, "rmsnorm_backward(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, float eps, "
            "float weight_offset) -> (Tensor, Tensor)",
         &rmsnorm_backward);
  def_op(m, "fused_add_rmsnorm_forward(Tensor(a!) x, Tensor(b!) residual, Tensor? weight, float eps, "
            "float weight_offset) -> Tensor",
         &fused_add_rmsnorm_forward);
  def_op(m, "fused_add_rmsnorm_forward_out_of_place(Tensor x, Tensor residual, Tensor? weight, float eps, "
            "float weight_offset) -> (Tensor, Tensor, Tensor)",
         &fused_add_rmsnorm_forward_out_of_place);
  def_op(m, "fused_add_rmsnorm_backward(Tensor dy, Tensor? d_residual, Tensor residual, Tensor? weight, "
            "Tensor rstd, float eps, float weight_offset) -> (Tensor, Tensor)",
         &fused_add_rmsnorm_backward);
  def_op(m, "layernorm_forward(Tensor x, Tensor? weight, Tensor? bias, float eps) "
            "-> (Tensor, Tensor, Tensor)",
         &layernorm_forward);
  def_op(m, "layernorm_backward(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, "
            "Tensor rstd, float eps) -> (Tensor, Tensor, Tensor)",
         &layernorm_backward);
}
