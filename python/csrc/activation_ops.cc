// The activation family as torch.ops.trainscale ops: python/trainscale/activation.py wraps them, the
// entry points are in include/trainscale/activation.h. Outputs are allocated here.
#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "binding.h"
#include "trainscale/activation.h"

namespace trainscale::binding {
namespace {

ts::GeluApproximation approx_of(const char* op, c10::string_view approximate) {
  const std::string_view a(approximate.data(), approximate.size());
  if (a == "none") return ts::GeluApproximation::kNone;
  if (a == "tanh") return ts::GeluApproximation::kTanh;
  arg_error(op, "approximate", "expected 'none' or 'tanh', got '" + std::string(a) + "'");
}

Tensor gelu_forward(const Tensor& x, c10::string_view approximate) {
  const char* op = "gelu_forward";
  Ctx ctx(x, op, "x");
  auto ap = approx_of(op, approximate);
  Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  guarded([&] { ts::gelu_forward(view(x, op, "x"), view(y, op, "y"), ap, ctx.stream); });
  return y;
}

Tensor gelu_backward(const Tensor& dy, const Tensor& x, c10::string_view approximate) {
  const char* op = "gelu_backward";
  Ctx ctx(x, op, "x");
  auto ap = approx_of(op, approximate);
  Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  guarded([&] {
    ts::gelu_backward(view(dy, op, "dy"), view(x, op, "x"), view(dx, op, "dx"), ap, ctx.stream);
  });
  return dx;
}

Tensor silu_forward(const Tensor& x) {
  const char* op = "silu_forward";
  Ctx ctx(x, op, "x");
  Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  guarded([&] { ts::silu_forward(view(x, op, "x"), view(y, op, "y"), ctx.stream); });
  return y;
}

Tensor silu_backward(const Tensor& dy, const Tensor& x) {
  const char* op = "silu_backward";
  Ctx ctx(x, op, "x");
  Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  guarded([&] {
    ts::silu_backward(view(dy, op, "dy"), view(x, op, "x"), view(dx, op, "dx"), ctx.stream);
  });
  return dx;
}

// The gated pair's bindings, separate halves a, b [..., F]: `fn(a, b, y, stream)` /
// `fn(dy, a, b, da, db, stream)` calls swiglu's or geglu's entry point.
template <class Fn>
Tensor gated_forward(const char* op, const Tensor& a, const Tensor& b, Fn&& fn) {
  Ctx ctx(a, op, "a");
  Tensor y = at::empty_like(a, at::MemoryFormat::Contiguous);
  guarded([&] { fn(view(a, op, "a"), view(b, op, "b"), view(y, op, "y"), ctx.stream); });
  return y;
}

template <class Fn>
std::tuple<Tensor, Tensor> gated_backward(const char* op, const Tensor& dy, const Tensor& a, const Tensor& b,
                                          Fn&& fn) {
  Ctx ctx(a, op, "a");
  Tensor da = at::empty_like(a, at::MemoryFormat::Contiguous);
  Tensor db = at::empty_like(b, at::MemoryFormat::Contiguous);
  guarded([&] {
    fn(view(dy, op, "dy"), view(a, op, "a"), view(b, op, "b"), view(da, op, "da"), view(db, op, "db"), ctx.stream);
  });
  return {da, db};
}

// Packed: ab [..., 2F] (a in the first F columns, b in the last), y [..., F], dab like ab.
template <class Fn>
Tensor gated_forward_packed(const char* op, const Tensor& ab, Fn&& fn) {
  Ctx ctx(ab, op, "ab");
  auto sizes = ab.sizes().vec();
  if (sizes.empty() || sizes.back() % 2 != 0) {
    arg_error(op, "ab", "expected an even last dim [..., 2F], got shape " + c10::str(ab.sizes()));
  }
  sizes.back() /= 2;
  Tensor y = at::empty(sizes, ab.options());
  guarded([&] { fn(view(ab, op, "ab"), view(y, op, "y"), ctx.stream); });
  return y;
}

template <class Fn>
Tensor gated_backward_packed(const char* op, const Tensor& dy, const Tensor& ab, Fn&& fn) {
  Ctx ctx(ab, op, "ab");
  Tensor dab = at::empty_like(ab, at::MemoryFormat::Contiguous);
  guarded([&] { fn(view(dy, op, "dy"), view(ab, op, "ab"), view(dab, op, "dab"), ctx.stream); });
  return dab;
}

Tensor swiglu_forward(const Tensor& a, const Tensor& b) {
  return gated_forward("swiglu_forward", a, b, [](auto&&... v) { ts::swiglu_forward(v...); });
}

std::tuple<Tensor, Tensor> swiglu_backward(const Tensor& dy, const Tensor& a, const Tensor& b) {
  return gated_backward("swiglu_backward", dy, a, b, [](auto&&... v) { ts::swiglu_backward(v...); });
}

// In place: a <- da, b <- db; returns the forward's y. For a backward that owns a and b (the
// MLP's saved projections): no [.., F] gradient buffers beside them.
Tensor swiglu_backward_recompute_(const Tensor& dy, Tensor& a, Tensor& b) {
  const char* op = "swiglu_backward_recompute_";
  Ctx ctx(a, op, "a");
  Tensor y = at::empty_like(a, at::MemoryFormat::Contiguous);
  guarded([&] {
    const TensorView va = view(a, op, "a"), vb = view(b, op, "b");
    ts::swiglu_backward_recompute(view(dy, op, "dy"), va, vb, va, vb, view(y, op, "y"), ctx.stream);
  });
  return y;
}

Tensor swiglu_forward_packed(const Tensor& ab) {
  return gated_forward_packed("swiglu_forward_packed", ab, [](auto&&... v) { ts::swiglu_forward_packed(v...); });
}

Tensor swiglu_backward_packed(const Tensor& dy, const Tensor& ab) {
  return gated_backward_packed("swiglu_backward_packed", dy, ab,
                               [](auto&&... v) { ts::swiglu_backward_packed(v...); });
}

// geglu: gelu(a) * b, gelu's form named as in gelu_forward.
Tensor geglu_forward(const Tensor& a, const Tensor& b, c10::string_view approximate) {
  const auto ap = approx_of("geglu_forward", approximate);
  return gated_forward("geglu_forward", a, b,
                       [&](const TensorView& va, const TensorView& vb, TensorView y, cudaStream_t stream) {
                         ts::geglu_forward(va, vb, y, ap, stream);
                       });
}

std::tuple<Tensor, Tensor> geglu_backward(const Tensor& dy, const Tensor& a, const Tensor& b,
                                          c10::string_view approximate) {
  const auto ap = approx_of("geglu_backward", approximate);
  return gated_backward("geglu_backward", dy, a, b,
                        [&](const TensorView& vdy, const TensorView& va, const TensorView& vb, TensorView da,
                            TensorView db, cudaStream_t stream) { ts::geglu_backward(vdy, va, vb, da, db, ap, stream); });
}

Tensor geglu_forward_packed(const Tensor& ab, c10::string_view approximate) {
  const auto ap = approx_of("geglu_forward_packed", approximate);
  return gated_forward_packed("geglu_forward_packed", ab, [&](const TensorView& vab, TensorView y, cudaStream_t stream) {
    ts::geglu_forward_packed(vab, y, ap, stream);
  });
}

Tensor geglu_backward_packed(const Tensor& dy, const Tensor& ab, c10::string_view approximate) {
  const auto ap = approx_of("geglu_backward_packed", approximate);
  return gated_backward_packed("geglu_backward_packed", dy, ab,
                               [&](const TensorView& vdy, const TensorView& vab, TensorView dab, cudaStream_t stream) {
                                 ts::geglu_backward_packed(vdy, vab, dab, ap, stream);
                               });
}

}  // namespace
}  // namespace trainscale::binding

TORCH_LIBRARY_FRAGMENT(trainscale, m) {
  using namespace trainscale::binding;
  def_op(m, "gelu_forward(Tensor x, str approximate) -> Tensor",
         &gelu_forward);
  def_op(m, "gelu_backward(Tensor dy, Tensor x, str approximate) -> Tensor",
         &gelu_backward);
  def_op(m, "silu_forward(Tensor x) -> Tensor",
         &silu_forward);
  def_op(m, "silu_backward(Tensor dy, Tensor x) -> Tensor",
         &silu_backward);
  def_op(m, "swiglu_forward(Tensor a, Tensor b) -> Tensor",
         &swiglu_forward);
  def_op(m, "swiglu_backward(Tensor dy, Tensor a, Tensor b) -> (Tensor, Tensor)",
         &swiglu_backward);
  def_op(m, "swiglu_backward_recompute_(Tensor dy, Tensor(a!) a, Tensor(b!) b) -> Tensor",
         &swiglu_backward_recompute_);
  def_op(m, "swiglu_forward_packed(Tensor ab) -> Tensor",
         &swiglu_forward_packed);
  def_op(m, "swiglu_backward_packed(Tensor dy, Tensor ab) -> Tensor",
         &swiglu_backward_packed);
  def_op(m, "geglu_forward(Tensor a, Tensor b, str approximate) -> Tensor", &geglu_forward);
  def_op(m, "geglu_backward(Tensor dy, Tensor a, Tensor b, str approximate) -> (Tensor, Tensor)", &geglu_backward);
  def_op(m, "geglu_forward_packed(Tensor ab, str approximate) -> Tensor", &geglu_forward_packed);
  def_op(m, "geglu_backward_packed(Tensor dy, Tensor ab, str approximate) -> Tensor", &geglu_backward_packed);
}
