// Cross-entropy as torch.ops.trainscale ops: python/trainscale/loss.py wraps them, the entry
// points are in include/trainscale/loss.h. Outputs are allocated here.
#include <string>
#include <string_view>
#include <tuple>

#include "binding.h"
#include "trainscale/loss.h"

namespace trainscale::binding {
namespace {

at::ScalarType stat_dtype(const Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

ts::CrossEntropyOptions ce_options(const char* op, int64_t ignore_index, double label_smoothing,
                                   double z_loss, double softcap, std::string_view reduction) {
  ts::CrossEntropyOptions o;
  o.ignore_index = ignore_index;
  o.label_smoothing = label_smoothing;
  o.z_loss = z_loss;
  o.softcap = softcap;
  if (reduction == "mean") {
    o.reduction = ts::Reduction::kMean;
  } else if (reduction == "sum") {
    o.reduction = ts::Reduction::kSum;
  } else if (reduction == "none") {
    o.reduction = ts::Reduction::kNone;
  } else {
    arg_error(op, "reduction", "expected 'mean', 'sum' or 'none', got '" + std::string(reduction) + "'");
  }
  return o;
}

// (loss, lse, grad_logits): grad_logits (with_grad) is d(sum of loss)/d(logits), written in
// the same pass; empty otherwise.
std::tuple<Tensor, Tensor, Tensor> cross_entropy_forward(const Tensor& logits,
                                                         const Tensor& target,
                                                         int64_t ignore_index,
                                                         double label_smoothing, double z_loss,
                                                         double softcap,
                                                         c10::string_view reduction,
                                                         bool with_grad) {
  const char* op = "cross_entropy_forward";
  const auto o = ce_options(op, ignore_index, label_smoothing, z_loss, softcap,
                            std::string_view(reduction.data(), reduction.size()));
  Ctx ctx(logits);
  const auto stats = logits.options().dtype(stat_dtype(logits));
  const int64_t rows = logits.dim() == 2 ? logits.size(0) : 0;
  Tensor loss = o.reduction == ts::Reduction::kNone ? at::empty({rows}, stats) : at::empty({}, stats);
  Tensor lse = at::empty({rows}, stats);
  Tensor grad = with_grad ? at::empty_like(logits, at::MemoryFormat::Contiguous)
                          : at::empty({0}, logits.options());
  guarded([&] {
    ts::cross_entropy_forward(view(logits, op, "logits"), view(target, op, "targets"),
                              view(loss, op, "loss"), view(lse, op, "lse"),
                              with_grad ? view(grad, op, "grad_logits") : ts::TensorView{}, o,
                              ctx.stream);
  });
  return {loss, lse, grad};
}

Tensor cross_entropy_backward(const Tensor& grad_loss, const Tensor& logits, const Tensor& target,
                              const Tensor& lse, int64_t ignore_index, double label_smoothing,
                              double z_loss, double softcap, c10::string_view reduction) {
  const char* op = "cross_entropy_backward";
  const auto o = ce_options(op, ignore_index, label_smoothing, z_loss, softcap,
                            std::string_view(reduction.data(), reduction.size()));
  Ctx ctx(logits);
  Tensor grad = at::empty_like(logits, at::MemoryFormat::Contiguous);
  guarded([&] {
    ts::cross_entropy_backward(view(grad_loss, op, "grad_loss"), view(logits, op, "logits"),
                               view(target, op, "targets"), view(lse, op, "lse"),
                               view(grad, op, "grad_logits"), o, ctx.stream);
  });
  return grad;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trainscale, m) {
  def_op(m,
         "cross_entropy_forward(Tensor logits, Tensor target, int ignore_index, float label_smoothing, "
         "float z_loss, float softcap, str reduction, bool with_grad) -> (Tensor, Tensor, Tensor)",
         &cross_entropy_forward);
  def_op(m,
         "cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor target, Tensor lse, int ignore_index, "
         "float label_smoothing, float z_loss, float softcap, str reduction) -> Tensor",
         &cross_entropy_backward);
}

}  // namespace trainscale::binding
