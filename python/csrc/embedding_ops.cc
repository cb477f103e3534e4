// The embedding family as torch.ops.trainscale ops: python/trainscale/embedding.py wraps them,
// the entry points are in include/trainscale/embedding.h. Outputs and the backward's workspace
// are allocated here (the workspace through torch's caching allocator). ids of any shape are
// flattened: out is ids.shape + [H]. The forward takes the backward's padding_idx (unused by
// the gather) so that autograd finds it among the forward's inputs.
#include <vector>

#include "binding.h"
#include "trainscale/embedding.h"

namespace trainscale::binding {
namespace {

Tensor embedding_forward(const Tensor& weight, const Tensor& ids, std::int64_t padding_idx) {
  constexpr const char* op = "embedding_forward";
  if (weight.dim() != 2) arg_error(op, "weight", "expected 2 dimensions [V, H], got " + std::to_string(weight.dim()));
  if (!(padding_idx == -1 || (padding_idx >= 0 && padding_idx < weight.size(0))))
    arg_error(op, "padding_idx",
              "expected -1 (none) or a row in [0, " + std::to_string(weight.size(0)) + "), got " + std::to_string(padding_idx));
  Ctx ctx(weight, op, "weight");
  const Tensor flat = ids.reshape({-1}).contiguous();
  Tensor out = at::empty({flat.size(0), weight.size(1)}, weight.options());
  guarded([&] { ts::embedding_forward(view(weight, op, "weight"), view(flat, op, "ids"), view(out, op, "out"), ctx.stream); });
  std::vector<std::int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(weight.size(1));
  return out.view(shape);
}

Tensor embedding_backward(const Tensor& grad_output, const Tensor& ids, std::int64_t num_weights,
                          std::int64_t padding_idx) {
  constexpr const char* op = "embedding_backward";
  if (grad_output.dim() != ids.dim() + 1)
    arg_error(op, "grad_output", "expected ids.shape + [H] (" + std::to_string(ids.dim() + 1) + " dimensions), got " +
                                     std::to_string(grad_output.dim()) + " dimensions");
  if (num_weights < 0) arg_error(op, "num_weights", "expected a count >= 0, got " + std::to_string(num_weights));
  Ctx ctx(grad_output, op, "grad_output");
  const std::int64_t cols = grad_output.size(-1);
  // Rows of unit stride are read in place; other layouts (an expanded gradient, say) are copied.
  Tensor rows = grad_output.reshape({-1, cols});
  if (!((cols <= 1 || rows.stride(1) == 1) && (rows.size(0) <= 1 || rows.stride(0) >= cols))) rows = rows.contiguous();
  const Tensor flat = ids.reshape({-1}).contiguous();
  Tensor grad_weight = at::empty({num_weights, cols}, grad_output.options());
  guarded([&] {
    Tensor ws;
    if (grad_output.is_cuda()) {
      const std::size_t bytes = ts::embedding_backward_workspace_bytes(flat.size(0));
      ws = at::empty({static_cast<std::int64_t>((bytes + 15) / 16 * 2)}, grad_output.options().dtype(at::kLong));
    }
    const ts::TensorView workspace = ws.defined() ? workspace_view(ws, op, "workspace") : ts::TensorView{};
    ts::embedding_backward(view(rows, op, "grad_output"), view(flat, op, "ids"), view(grad_weight, op, "grad_weight"),
                           padding_idx, workspace, ctx.stream);
  });
  return grad_weight;
}

}  // namespace
}  // namespace trainscale::binding

TORCH_LIBRARY_FRAGMENT(trainscale, m) {
  using namespace trainscale::binding;
  def_op(m, "embedding_forward(Tensor weight, Tensor ids, int padding_idx) -> Tensor", &embedding_forward);
  def_op(m, "embedding_backward(Tensor grad_output, Tensor ids, int num_weights, int padding_idx) -> Tensor",
         &embedding_backward);
}
