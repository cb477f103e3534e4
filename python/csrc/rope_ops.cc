// The rope family as torch.ops.trainscale ops: python/trainscale/rope.py wraps them, the
// entry points are in include/trainscale/rope.h. Outputs are allocated here.
#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "binding.h"
#include "trainscale/rope.h"

namespace trainscale::binding {
namespace {

ts::RopeOptions rope_options(bool interleaved, std::int64_t rotary_dim, double theta) {
  return {.style = interleaved ? ts::RopeStyle::kGptJ : ts::RopeStyle::kNeox,
          .rotary_dim = rotary_dim,
          .theta = theta};
}

std::tuple<Tensor, Tensor> rope_impl(bool forward, const Tensor& q, const OptTensor& k,
                                     const OptTensor& cos, const OptTensor& sin,
                                     const OptTensor& position_offsets, bool interleaved,
                                     std::int64_t rotary_dim, double theta) {
  const char* op = forward ? "rope_forward" : "rope_backward";
  Ctx ctx(q, op, "q");
  const bool has_k = k.has_value() && k->defined();
  Tensor q_out = at::empty_like(q, at::MemoryFormat::Contiguous);
  Tensor k_out = has_k ? at::empty_like(*k, at::MemoryFormat::Contiguous)
                       : at::empty({0}, q.options());
  auto opts = rope_options(interleaved, rotary_dim, theta);
  guarded([&] {
    auto kv = view(k, op, forward ? "k" : "dk_out");
    auto kov = has_k ? view(k_out, op, forward ? "k_out" : "dk") : ts::TensorView{};
    if (forward) {
      ts::rope_forward(view(q, op, "q"), kv, view(q_out, op, "q_out"), kov, view(cos, op, "cos"),
                       view(sin, op, "sin"), view(position_offsets, op, "position_offsets"), opts,
                       ctx.stream);
    } else {
      ts::rope_backward(view(q, op, "dq_out"), kv, view(q_out, op, "dq"), kov,
                        view(cos, op, "cos"), view(sin, op, "sin"),
                        view(position_offsets, op, "position_offsets"), opts, ctx.stream);
    }
  });
  return {q_out, k_out};
}

std::tuple<Tensor, Tensor> rope_forward(const Tensor& q, const OptTensor& k, const OptTensor& cos,
                                    const OptTensor& sin, const OptTensor& position_offsets,
                                    bool interleaved, std::int64_t rotary_dim, double theta) {
  return rope_impl(true, q, k, cos, sin, position_offsets, interleaved, rotary_dim, theta);
}
std::tuple<Tensor, Tensor> rope_backward(const Tensor& dq_out, const OptTensor& dk_out,
                                    const OptTensor& cos, const OptTensor& sin,
                                    const OptTensor& position_offsets, bool interleaved,
                                    std::int64_t rotary_dim, double theta) {
  return rope_impl(false, dq_out, dk_out, cos, sin, position_offsets, interleaved, rotary_dim,
                   theta);
}

}  // namespace
}  // namespace trainscale::binding

TORCH_LIBRARY_FRAGMENT(trainscale, m) {
  using namespace trainscale::binding;
  def_op(m, "rope_forward(Tensor q, Tensor? k, Tensor? cos, Tensor? sin, Tensor? position_offsets, "
            "bool interleaved, int rotary_dim, float theta) -> (Tensor, Tensor)",
         &rope_forward);
  def_op(m, "rope_backward(Tensor dq_out, Tensor? dk_out, Tensor? cos, Tensor? sin, "
            "Tensor? position_offsets, bool interleaved, int rotary_dim, float theta) "
            "-> (Tensor, Tensor)",
         &rope_backward);
}
