// PyTorch dispatcher bindings: at::Tensor -> trainscale::TensorView, outputs allocated here,
// the current CUDA stream passed on CUDA. Registered for CPU and CUDA; trainscale dispatches on
// the device itself (CPU reference or CUDA kernels). Loaded with torch.ops.load_library.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "trainscale/activation.h"
#include "trainscale/error.h"
#include "trainscale/fp8.h"
#include "trainscale/norm.h"
#include "trainscale/rope.h"
#include "trainscale/tensor.h"

#if defined(TRAINSCALE_TORCH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

namespace ts = trainscale;
using at::Tensor;
using OptTensor = std::optional<Tensor>;

[[noreturn]] void arg_error(const char* op, const char* arg, const std::string& what) {
  TORCH_CHECK_VALUE(false, "trainscale::", op, ": argument '", arg, "': ", what);
}

ts::DType to_dtype(at::ScalarType t, const char* op, const char* arg) {
  switch (t) {
    case at::kDouble: return ts::DType::kFloat64;
    case at::kFloat: return ts::DType::kFloat32;
    case at::kHalf: return ts::DType::kFloat16;
    case at::kBFloat16: return ts::DType::kBFloat16;
    case at::kFloat8_e4m3fn: return ts::DType::kFloat8E4M3;
    case at::kFloat8_e5m2: return ts::DType::kFloat8E5M2;
    case at::kInt: return ts::DType::kInt32;
    case at::kLong: return ts::DType::kInt64;
    case at::kByte: return ts::DType::kFloat8E4M3;  // workspaces only (bytes are what count)
    default:
      arg_error(op, arg, std::string("unsupported dtype ") + c10::toString(t));
  }
}

ts::TensorView view(const Tensor& t, const char* op, const char* arg) {
  ts::Device dev;
  if (t.is_cuda()) {
    dev = ts::Device::cuda(t.get_device());
  } else if (!t.is_cpu()) {
    arg_error(op, arg, "expected a CPU or CUDA tensor, got device " + t.device().str());
  }
  if (t.dim() > ts::kMaxDims) {
    arg_error(op, arg, "expected at most " + std::to_string(ts::kMaxDims) + " dims, got " +
                           std::to_string(t.dim()));
  }
  return ts::TensorView::from_arrays(t.data_ptr(), to_dtype(t.scalar_type(), op, arg),
                                     static_cast<int>(t.dim()), t.sizes().data(),
                                     t.strides().data(), dev);
}

ts::TensorView view(const OptTensor& t, const char* op, const char* arg) {
  return t.has_value() && t->defined() ? view(*t, op, arg) : ts::TensorView{};
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
auto guarded(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const ts::Error& e) {
    std::string_view msg(e.what());
    if (msg.find("argument '") != std::string_view::npos) {
      TORCH_CHECK_VALUE(false, e.what());
    }
    TORCH_CHECK(false, e.what());
  }
}

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

std::tuple<Tensor, Tensor> rmsnorm_fwd(const Tensor& x, const OptTensor& weight, double eps,
                                       double weight_offset) {
  const char* op = "rmsnorm_forward";
  Ctx ctx(x);
  Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  Tensor rstd = stat_empty(x);
  guarded([&] {
    ts::rmsnorm_forward(view(x, op, "x"), view(weight, op, "weight"), view(y, op, "y"),
                        view(rstd, op, "rstd"), {.eps = eps, .weight_offset = weight_offset},
                        ctx.stream);
  });
  return {y, rstd};
}

std::tuple<Tensor, Tensor> rmsnorm_bwd(const Tensor& dy, const Tensor& x, const OptTensor& weight,
                                       const Tensor& rstd, double eps, double weight_offset) {
  const char* op = "rmsnorm_backward";
  Ctx ctx(x);
  Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  Tensor dw = grad_like(weight, x);
  Tensor ws = workspace(x, op);
  guarded([&] {
    ts::rmsnorm_backward(view(dy, op, "dy"), view(x, op, "x"), view(weight, op, "weight"),
                         view(rstd, op, "rstd"), view(dx, op, "dx"),
                         weight.has_value() ? view(dw, op, "dw") : ts::TensorView{},
                         view(ws, op, "workspace"), {.eps = eps, .weight_offset = weight_offset},
                         ctx.stream);
  });
  return {dx, dw};
}

Tensor fused_add_rmsnorm_fwd(Tensor& x, Tensor& residual, const OptTensor& weight, double eps,
                             double weight_offset) {
  const char* op = "fused_add_rmsnorm_forward";
  Ctx ctx(x);
  Tensor rstd = stat_empty(x);
  guarded([&] {
    ts::fused_add_rmsnorm_forward(view(x, op, "x"), view(residual, op, "residual"),
                                  view(weight, op, "weight"), view(rstd, op, "rstd"),
                                  {.eps = eps, .weight_offset = weight_offset}, ctx.stream);
  });
  return rstd;
}

std::tuple<Tensor, Tensor> fused_add_rmsnorm_bwd(const Tensor& dy, const OptTensor& d_residual,
                                                 const Tensor& residual, const OptTensor& weight,
                                                 const Tensor& rstd, double eps,
                                                 double weight_offset) {
  const char* op = "fused_add_rmsnorm_backward";
  Ctx ctx(dy);
  Tensor dx = at::empty_like(dy, at::MemoryFormat::Contiguous);
  Tensor dw = grad_like(weight, dy);
  Tensor ws = workspace(dy, op);
  guarded([&] {
    ts::fused_add_rmsnorm_backward(
        view(dy, op, "dy"), view(d_residual, op, "d_residual"), view(residual, op, "residual"),
        view(weight, op, "weight"), view(rstd, op, "rstd"), view(dx, op, "dx"),
        weight.has_value() ? view(dw, op, "dw") : ts::TensorView{}, view(ws, op, "workspace"),
        {.eps = eps, .weight_offset = weight_offset}, ctx.stream);
  });
  return {dx, dw};
}

std::tuple<Tensor, Tensor, Tensor> layernorm_fwd(const Tensor& x, const OptTensor& weight,
                                                 const OptTensor& bias, double eps) {
  const char* op = "layernorm_forward";
  Ctx ctx(x);
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

std::tuple<Tensor, Tensor, Tensor> layernorm_bwd(const Tensor& dy, const Tensor& x,
                                                 const OptTensor& weight, const OptTensor& bias,
                                                 const Tensor& mean, const Tensor& rstd,
                                                 double eps) {
  const char* op = "layernorm_backward";
  Ctx ctx(x);
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
                            .workspace = view(ws, op, "workspace")}, {.eps = eps}, ctx.stream);
  });
  return {dx, dw, db};
}

// ---- activations ----------------------------------------------------------------------------

ts::GeluApproximation approx_of(std::string_view a) {
  if (a == "none") return ts::GeluApproximation::kNone;
  if (a == "tanh") return ts::GeluApproximation::kTanh;
  arg_error("gelu", "approximate", "expected 'none' or 'tanh', got '" + std::string(a) + "'");
}

Tensor gelu_fwd(const Tensor& x, c10::string_view approximate) {
  const char* op = "gelu_forward";
  Ctx ctx(x);
  auto ap = approx_of(std::string_view(approximate.data(), approximate.size()));
  Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  guarded([&] { ts::gelu_forward(view(x, op, "x"), view(y, op, "y"), ap, ctx.stream); });
  return y;
}

Tensor gelu_bwd(const Tensor& dy, const Tensor& x, c10::string_view approximate) {
  const char* op = "gelu_backward";
  Ctx ctx(x);
  auto ap = approx_of(std::string_view(approximate.data(), approximate.size()));
  Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  guarded([&] {
    ts::gelu_backward(view(dy, op, "dy"), view(x, op, "x"), view(dx, op, "dx"), ap, ctx.stream);
  });
  return dx;
}

Tensor silu_fwd(const Tensor& x) {
  const char* op = "silu_forward";
  Ctx ctx(x);
  Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  guarded([&] { ts::silu_forward(view(x, op, "x"), view(y, op, "y"), ctx.stream); });
  return y;
}

Tensor silu_bwd(const Tensor& dy, const Tensor& x) {
  const char* op = "silu_backward";
  Ctx ctx(x);
  Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  guarded([&] {
    ts::silu_backward(view(dy, op, "dy"), view(x, op, "x"), view(dx, op, "dx"), ctx.stream);
  });
  return dx;
}

Tensor swiglu_fwd(const Tensor& a, const Tensor& b) {
  const char* op = "swiglu_forward";
  Ctx ctx(a);
  Tensor y = at::empty_like(a, at::MemoryFormat::Contiguous);
  guarded([&] {
    ts::swiglu_forward(view(a, op, "a"), view(b, op, "b"), view(y, op, "y"), ctx.stream);
  });
  return y;
}

std::tuple<Tensor, Tensor> swiglu_bwd(const Tensor& dy, const Tensor& a, const Tensor& b) {
  const char* op = "swiglu_backward";
  Ctx ctx(a);
  Tensor da = at::empty_like(a, at::MemoryFormat::Contiguous);
  Tensor db = at::empty_like(b, at::MemoryFormat::Contiguous);
  guarded([&] {
    ts::swiglu_backward(view(dy, op, "dy"), view(a, op, "a"), view(b, op, "b"),
                        view(da, op, "da"), view(db, op, "db"), ctx.stream);
  });
  return {da, db};
}

Tensor swiglu_packed_fwd(const Tensor& ab) {
  const char* op = "swiglu_forward_packed";
  Ctx ctx(ab);
  auto sizes = ab.sizes().vec();
  if (sizes.empty() || sizes.back() % 2 != 0) {
    arg_error(op, "ab", "expected an even last dim [..., 2F], got shape " +
                            c10::str(ab.sizes()));
  }
  sizes.back() /= 2;
  Tensor y = at::empty(sizes, ab.options());
  guarded([&] { ts::swiglu_forward_packed(view(ab, op, "ab"), view(y, op, "y"), ctx.stream); });
  return y;
}

Tensor swiglu_packed_bwd(const Tensor& dy, const Tensor& ab) {
  const char* op = "swiglu_backward_packed";
  Ctx ctx(ab);
  Tensor dab = at::empty_like(ab, at::MemoryFormat::Contiguous);
  guarded([&] {
    ts::swiglu_backward_packed(view(dy, op, "dy"), view(ab, op, "ab"), view(dab, op, "dab"),
                               ctx.stream);
  });
  return dab;
}

// ---- rope -----------------------------------------------------------------------------------

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
  Ctx ctx(q);
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

std::tuple<Tensor, Tensor> rope_fwd(const Tensor& q, const OptTensor& k, const OptTensor& cos,
                                    const OptTensor& sin, const OptTensor& position_offsets,
                                    bool interleaved, std::int64_t rotary_dim, double theta) {
  return rope_impl(true, q, k, cos, sin, position_offsets, interleaved, rotary_dim, theta);
}
std::tuple<Tensor, Tensor> rope_bwd(const Tensor& dq_out, const OptTensor& dk_out,
                                    const OptTensor& cos, const OptTensor& sin,
                                    const OptTensor& position_offsets, bool interleaved,
                                    std::int64_t rotary_dim, double theta) {
  return rope_impl(false, dq_out, dk_out, cos, sin, position_offsets, interleaved, rotary_dim,
                   theta);
}

// ---- fp8 ------------------------------------------------------------------------------------

std::tuple<Tensor, Tensor> fp8_quantize(const Tensor& x, at::ScalarType dtype,
                                        c10::string_view granularity, bool power_of_two_scales,
                                        bool scales_m_major) {
  const char* op = "fp8_quantize";
  Ctx ctx(x);
  if (dtype != at::kFloat8_e4m3fn && dtype != at::kFloat8_e5m2) {
    arg_error(op, "dtype", std::string("expected float8_e4m3fn or float8_e5m2, got ") +
                               c10::toString(dtype));
  }
  if (x.dim() != 2) {
    arg_error(op, "x", "expected 2 dims [M, N], got shape " + c10::str(x.sizes()));
  }
  std::string_view g(granularity.data(), granularity.size());
  const std::int64_t M = x.size(0), N = x.size(1), tiles = (N + 127) / 128;
  ts::Fp8QuantizeOptions o{.power_of_two_scales = power_of_two_scales,
                           .scales_m_major = scales_m_major};
  std::vector<std::int64_t> ssizes;
  if (g == "row") {
    o.granularity = ts::Fp8Granularity::kRow;
    ssizes = {M};
  } else if (g == "1x128") {
    o.granularity = ts::Fp8Granularity::kTile1x128;
    ssizes = scales_m_major ? std::vector<std::int64_t>{tiles, (M + 3) / 4 * 4}
                            : std::vector<std::int64_t>{M, tiles};
  } else {
    arg_error(op, "granularity", "expected 'row' or '1x128', got '" + std::string(g) + "'");
  }
  Tensor q = at::empty({M, N}, x.options().dtype(dtype));
  Tensor scales = at::empty(ssizes, x.options().dtype(at::kFloat));
  guarded([&] {
    ts::fp8_quantize(view(x, op, "x"), view(q, op, "q"), view(scales, op, "scales"), {}, {}, o,
                     ctx.stream);
  });
  return {q, scales};
}

}  // namespace

TORCH_LIBRARY(trainscale, m) {
  m.def("rmsnorm_fwd(Tensor x, Tensor? weight, float eps, float weight_offset) -> (Tensor, Tensor)");
  m.def("rmsnorm_bwd(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, float eps, "
        "float weight_offset) -> (Tensor, Tensor)");
  m.def("fused_add_rmsnorm_fwd(Tensor(a!) x, Tensor(b!) residual, Tensor? weight, float eps, "
        "float weight_offset) -> Tensor");
  m.def("fused_add_rmsnorm_bwd(Tensor dy, Tensor? d_residual, Tensor residual, Tensor? weight, "
        "Tensor rstd, float eps, float weight_offset) -> (Tensor, Tensor)");
  m.def("layernorm_fwd(Tensor x, Tensor? weight, Tensor? bias, float eps) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("layernorm_bwd(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, "
        "Tensor rstd, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("gelu_fwd(Tensor x, str approximate) -> Tensor");
  m.def("gelu_bwd(Tensor dy, Tensor x, str approximate) -> Tensor");
  m.def("silu_fwd(Tensor x) -> Tensor");
  m.def("silu_bwd(Tensor dy, Tensor x) -> Tensor");
  m.def("swiglu_fwd(Tensor a, Tensor b) -> Tensor");
  m.def("swiglu_bwd(Tensor dy, Tensor a, Tensor b) -> (Tensor, Tensor)");
  m.def("swiglu_packed_fwd(Tensor ab) -> Tensor");
  m.def("swiglu_packed_bwd(Tensor dy, Tensor ab) -> Tensor");
  m.def("rope_fwd(Tensor q, Tensor? k, Tensor? cos, Tensor? sin, Tensor? position_offsets, "
        "bool interleaved, int rotary_dim, float theta) -> (Tensor, Tensor)");
  m.def("rope_bwd(Tensor dq_out, Tensor? dk_out, Tensor? cos, Tensor? sin, "
        "Tensor? position_offsets, bool interleaved, int rotary_dim, float theta) "
        "-> (Tensor, Tensor)");
  m.def("fp8_quantize(Tensor x, ScalarType dtype, str granularity, bool power_of_two_scales, "
        "bool scales_m_major) -> (Tensor, Tensor)");
}

#define TRAINSCALE_IMPLS(m)                                      \
  m.impl("rmsnorm_fwd", &rmsnorm_fwd);                           \
  m.impl("rmsnorm_bwd", &rmsnorm_bwd);                           \
  m.impl("fused_add_rmsnorm_fwd", &fused_add_rmsnorm_fwd);       \
  m.impl("fused_add_rmsnorm_bwd", &fused_add_rmsnorm_bwd);       \
  m.impl("layernorm_fwd", &layernorm_fwd);                       \
  m.impl("layernorm_bwd", &layernorm_bwd);                       \
  m.impl("gelu_fwd", &gelu_fwd);                                 \
  m.impl("gelu_bwd", &gelu_bwd);                                 \
  m.impl("silu_fwd", &silu_fwd);                                 \
  m.impl("silu_bwd", &silu_bwd);                                 \
  m.impl("swiglu_fwd", &swiglu_fwd);                             \
  m.impl("swiglu_bwd", &swiglu_bwd);                             \
  m.impl("swiglu_packed_fwd", &swiglu_packed_fwd);               \
  m.impl("swiglu_packed_bwd", &swiglu_packed_bwd);               \
  m.impl("rope_fwd", &rope_fwd);                                 \
  m.impl("rope_bwd", &rope_bwd);                                 \
  m.impl("fp8_quantize", &fp8_quantize);

TORCH_LIBRARY_IMPL(trainscale, CPU, m) { TRAINSCALE_IMPLS(m) }
TORCH_LIBRARY_IMPL(trainscale, CUDA, m) { TRAINSCALE_IMPLS(m) }
