// PyTorch dispatcher bindings of the softmax family and cross-entropy (torch op names are the
// C++ entry names). A fragment of the `trainscale` library that ops.cc defines; the small
// tensor-view and error helpers below mirror ops.cc's (to be shared once ops.cc is split).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "trainscale/error.h"
#include "trainscale/loss.h"
#include "trainscale/softmax.h"
#include "trainscale/tensor.h"

#if defined(TRAINSCALE_TORCH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

namespace ts = trainscale;
using at::Tensor;

ts::DType to_dtype(at::ScalarType t, const char* op, const char* arg) {
  switch (t) {
    case at::kDouble: return ts::DType::kFloat64;
    case at::kFloat: return ts::DType::kFloat32;
    case at::kHalf: return ts::DType::kFloat16;
    case at::kBFloat16: return ts::DType::kBFloat16;
    case at::kInt: return ts::DType::kInt32;
    case at::kLong: return ts::DType::kInt64;
    default:
      TORCH_CHECK_VALUE(false, "trainscale::", op, ": argument '", arg, "': unsupported dtype ",
                        c10::toString(t));
  }
}

ts::TensorView view(const Tensor& t, const char* op, const char* arg) {
  ts::Device dev;
  if (t.is_cuda()) {
    dev = ts::Device::cuda(t.get_device());
  } else {
    TORCH_CHECK_VALUE(t.is_cpu(), "trainscale::", op, ": argument '", arg,
                      "': expected a CPU or CUDA tensor, got device ", t.device().str());
  }
  TORCH_CHECK_VALUE(t.dim() <= ts::kMaxDims, "trainscale::", op, ": argument '", arg,
                    "': expected at most ", ts::kMaxDims, " dims, got ", t.dim());
  return ts::TensorView::from_arrays(t.data_ptr(), to_dtype(t.scalar_type(), op, arg),
                                     static_cast<int>(t.dim()), t.sizes().data(),
                                     t.strides().data(), dev);
}

// Device guard + stream for the call; CPU: nothing.
struct Ctx {
#if defined(TRAINSCALE_TORCH_CUDA)
  std::optional<c10::cuda::CUDAGuard> guard;
#endif
  cudaStream_t stream = nullptr;
  explicit Ctx(const Tensor& t) {
    if (t.is_cuda()) {
#if defined(TRAINSCALE_TORCH_CUDA)
      guard.emplace(t.device());
      stream = c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
#else
      TORCH_CHECK(false, "trainscale: CUDA tensor given, but the extension was built without CUDA");
#endif
    }
  }
};

// trainscale::Error -> ValueError for argument errors, RuntimeError otherwise.
template <class F>
void guarded(F&& f) {
  try {
    f();
  } catch (const ts::Error& e) {
    const std::string_view msg(e.what());
    TORCH_CHECK_VALUE(msg.find("argument '") == std::string_view::npos, e.what());
    TORCH_CHECK(false, e.what());
  }
}

at::ScalarType stat_dtype(const Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// ---- softmax --------------------------------------------------------------------------------

Tensor softmax_forward(const Tensor& x) {
  const char* op = "softmax_forward";
  Ctx ctx(x);
  Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  guarded([&] { ts::softmax_forward(view(x, op, "x"), view(y, op, "y"), ctx.stream); });
  return y;
}

Tensor softmax_backward(const Tensor& dy, const Tensor& y) {
  const char* op = "softmax_backward";
  Ctx ctx(y);
  Tensor dx = at::empty_like(y, at::MemoryFormat::Contiguous);
  guarded([&] {
    ts::softmax_backward(view(dy, op, "dy"), view(y, op, "y"), view(dx, op, "dx"), ctx.stream);
  });
  return dx;
}

// ---- cross-entropy --------------------------------------------------------------------------

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
    TORCH_CHECK_VALUE(false, "trainscale::", op, ": argument 'reduction': expected 'mean', 'sum' "
                      "or 'none', got '", std::string(reduction), "'");
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
  m.def("softmax_forward(Tensor x) -> Tensor");
  m.def("softmax_backward(Tensor dy, Tensor y) -> Tensor");
  m.def("cross_entropy_forward(Tensor logits, Tensor target, int ignore_index, "
        "float label_smoothing, float z_loss, float softcap, str reduction, bool with_grad) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor target, Tensor lse, "
        "int ignore_index, float label_smoothing, float z_loss, float softcap, str reduction) "
        "-> Tensor");
}

#define TRAINSCALE_SOFTMAX_CE_IMPLS(m)                           \
  m.impl("softmax_forward", &softmax_forward);                   \
  m.impl("softmax_backward", &softmax_backward);                 \
  m.impl("cross_entropy_forward", &cross_entropy_forward);       \
  m.impl("cross_entropy_backward", &cross_entropy_backward);

TORCH_LIBRARY_IMPL(trainscale, CPU, m) { TRAINSCALE_SOFTMAX_CE_IMPLS(m) }
TORCH_LIBRARY_IMPL(trainscale, CUDA, m) { TRAINSCALE_SOFTMAX_CE_IMPLS(m) }
