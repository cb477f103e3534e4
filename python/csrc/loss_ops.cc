// Cross-entropy and fused linear cross-entropy as torch.ops.trainscale ops:
// python/trainscale/loss.py wraps them, the entry points are in include/trainscale/loss.h.
// Outputs (and the CUDA workspace) are allocated here.
#include <cstddef>
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
  Ctx ctx(logits, op, "logits");
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
  Ctx ctx(logits, op, "logits");
  Tensor grad = at::empty_like(logits, at::MemoryFormat::Contiguous);
  guarded([&] {
    ts::cross_entropy_backward(view(grad_loss, op, "grad_loss"), view(logits, op, "logits"),
                               view(target, op, "targets"), view(lse, op, "lse"),
                               view(grad, op, "grad_logits"), o, ctx.stream);
  });
  return grad;
}

// (loss, lse, grad_hidden, grad_weight, grad_bias) of hidden @ weight^T + bias against target,
// in one call. Each with_grad_<x> asks for that gradient (of the sum of loss times grad_loss,
// which is absent = 1); a gradient not asked for is an empty tensor.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> fused_linear_cross_entropy_forward(
    const Tensor& hidden, const Tensor& weight, const OptTensor& bias, const Tensor& target,
    const OptTensor& grad_loss, int64_t ignore_index, double label_smoothing, double z_loss,
    double softcap, c10::string_view reduction, bool with_grad_hidden, bool with_grad_weight,
    bool with_grad_bias, at::ScalarType grad_weight_accumulation, int64_t chunk_tokens) {
  const char* op = "fused_linear_cross_entropy_forward";
  const auto o = ce_options(op, ignore_index, label_smoothing, z_loss, softcap,
                            std::string_view(reduction.data(), reduction.size()));
  const bool has_bias = bias.has_value() && bias->defined();
  if (with_grad_bias && !has_bias) {
    arg_error(op, "with_grad_bias", "a gradient of a bias that is not given");
  }
  Ctx ctx(hidden, op, "hidden");
  const auto stats = hidden.options().dtype(stat_dtype(hidden));
  const int64_t tokens = hidden.dim() == 2 ? hidden.size(0) : 0;
  const auto grad_of = [](bool wanted, const Tensor& x) {
    return wanted ? at::empty_like(x, at::MemoryFormat::Contiguous) : at::empty({0}, x.options());
  };
  Tensor loss = o.reduction == ts::Reduction::kNone ? at::empty({tokens}, stats)
                                                     : at::empty({}, stats);
  Tensor lse = at::empty({tokens}, stats);
  Tensor grad_hidden = grad_of(with_grad_hidden, hidden);
  Tensor grad_weight = grad_of(with_grad_weight, weight);
  Tensor grad_bias = grad_of(with_grad_bias, has_bias ? *bias : hidden);
  Tensor workspace;
  guarded([&] {
    ts::FusedLinearCrossEntropyArgs args{
        .hidden = view(hidden, op, "hidden"),
        .weight = view(weight, op, "weight"),
        .bias = view(bias, op, "bias"),
        .targets = view(target, op, "targets"),
        .loss = view(loss, op, "loss"),
        .lse = view(lse, op, "lse"),
        .grad_loss = view(grad_loss, op, "grad_loss"),
        .grad_hidden = with_grad_hidden ? view(grad_hidden, op, "grad_hidden") : ts::TensorView{},
        .grad_weight = with_grad_weight ? view(grad_weight, op, "grad_weight") : ts::TensorView{},
        .grad_bias = with_grad_bias ? view(grad_bias, op, "grad_bias") : ts::TensorView{},
        .workspace = {},  // sized from these arguments below
        .chunk_tokens = chunk_tokens,
        .grad_weight_accumulation =
            to_dtype(grad_weight_accumulation, op, "grad_weight_accumulation"),
    };
    // The CPU reference needs no workspace; on CUDA the caching allocator owns it. The query
    // checks only what it reads (hidden and weight), which the forward checks first as well:
    // when it fails, the forward reports the error under its own name.
    if (hidden.is_cuda()) {
      std::size_t bytes = 0;
      try {
        bytes = ts::fused_linear_cross_entropy_workspace_bytes(args, o);
      } catch (const ts::Error&) {
      }
      workspace =
          at::empty({static_cast<int64_t>(bytes)}, hidden.options().dtype(at::kByte));
      args.workspace = workspace_view(workspace, op, "workspace");
    }
    ts::fused_linear_cross_entropy_forward(args, o, ctx.stream);
  });
  return {loss, lse, grad_hidden, grad_weight, grad_bias};
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
  def_op(m,
         "fused_linear_cross_entropy_forward(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
         "Tensor? grad_loss, int ignore_index, float label_smoothing, float z_loss, float softcap, str reduction, "
         "bool with_grad_hidden, bool with_grad_weight, bool with_grad_bias, ScalarType grad_weight_accumulation, "
         "int chunk_tokens) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
         &fused_linear_cross_entropy_forward);
}

}  // namespace trainscale::binding
