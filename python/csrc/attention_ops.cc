// Scaled dot-product attention as torch.ops.trainscale ops: python/trainscale/attention.py
// wraps them, the entry points are in include/trainscale/attention.h. Outputs are allocated
// here; shapes, dtypes and strides are validated by the C++ layer.
#include <tuple>

#include "binding.h"
#include "trainscale/attention.h"

namespace trainscale::binding {
namespace {

ts::AttentionOptions attention_options(bool causal, double scale) {
  ts::AttentionOptions o;
  o.causal = causal;
  o.scale = scale;
  return o;
}

// (out, lse): out [B, Sq, Hq, D] contiguous in q's dtype, lse [B, Hq, Sq] float32 (float64 for
// float64 q). A q that is not 4-D gets placeholders, and attention_forward names the argument.
std::tuple<Tensor, Tensor> attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             bool causal, double scale) {
  const char* op = "attention_forward";
  Ctx ctx(q);
  Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  const auto stats = q.options().dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  Tensor lse = q.dim() == 4 ? at::empty({q.size(0), q.size(2), q.size(1)}, stats) : at::empty({0}, stats);
  guarded([&] {
    ts::attention_forward(view(q, op, "q"), view(k, op, "k"), view(v, op, "v"), view(out, op, "out"),
                          view(lse, op, "lse"), attention_options(causal, scale), ctx.stream);
  });
  return {out, lse};
}

// (dq, dk, dv), contiguous, like q, k and v.
std::tuple<Tensor, Tensor, Tensor> attention_backward(const Tensor& dout, const Tensor& q,
                                                      const Tensor& k, const Tensor& v,
                                                      const Tensor& out, const Tensor& lse,
                                                      bool causal, double scale) {
  const char* op = "attention_backward";
  Ctx ctx(q);
  Tensor dq = at::empty_like(q, at::MemoryFormat::Contiguous);
  Tensor dk = at::empty_like(k, at::MemoryFormat::Contiguous);
  Tensor dv = at::empty_like(v, at::MemoryFormat::Contiguous);
  Tensor workspace;
  guarded([&] {
    // The CPU reference needs no workspace; on CUDA the caching allocator owns it (256-byte
    // aligned). A q that is not 4-D gets none, and attention_backward names the argument.
    if (q.is_cuda() && q.dim() == 4) {
      const ts::TensorView shape_of_q(nullptr, ts::DType::kFloat32, {q.size(0), q.size(1), q.size(2), q.size(3)});
      const auto bytes = static_cast<int64_t>(ts::attention_backward_workspace_bytes(shape_of_q));
      workspace = at::empty({bytes}, q.options().dtype(at::kByte));
    }
    ts::attention_backward({.dout = view(dout, op, "dout"),
                            .q = view(q, op, "q"),
                            .k = view(k, op, "k"),
                            .v = view(v, op, "v"),
                            .out = view(out, op, "out"),
                            .lse = view(lse, op, "lse"),
                            .dq = view(dq, op, "dq"),
                            .dk = view(dk, op, "dk"),
                            .dv = view(dv, op, "dv"),
                            .workspace = workspace.defined() ? view(workspace, op, "workspace") : ts::TensorView{}},
                           attention_options(causal, scale), ctx.stream);
  });
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trainscale, m) {
  def_op(m,
         "attention_forward(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> "
         "(Tensor, Tensor)",
         &attention_forward);
  def_op(m,
         "attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
         "bool causal, float scale) -> (Tensor, Tensor, Tensor)",
         &attention_backward);
}

}  // namespace trainscale::binding
