// The softmax family as torch.ops.trainscale ops: python/trainscale/softmax.py wraps them, the
// entry points are in include/trainscale/softmax.h. Outputs are allocated here.
#include "binding.h"
#include "trainscale/softmax.h"

namespace trainscale::binding {
namespace {

Tensor softmax_forward(const Tensor& x) {
  const char* op = "softmax_forward";
  Ctx ctx(x, op, "x");
  Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  guarded([&] { ts::softmax_forward(view(x, op, "x"), view(y, op, "y"), ctx.stream); });
  return y;
}

Tensor softmax_backward(const Tensor& dy, const Tensor& y) {
  const char* op = "softmax_backward";
  Ctx ctx(y, op, "y");
  Tensor dx = at::empty_like(y, at::MemoryFormat::Contiguous);
  guarded([&] {
    ts::softmax_backward(view(dy, op, "dy"), view(y, op, "y"), view(dx, op, "dx"), ctx.stream);
  });
  return dx;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trainscale, m) {
  def_op(m, "softmax_forward(Tensor x) -> Tensor", &softmax_forward);
  def_op(m, "softmax_backward(Tensor dy, Tensor y) -> Tensor", &softmax_backward);
}

}  // namespace trainscale::binding
