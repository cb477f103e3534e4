#include <algorithm>
#include <string>

#include "ops/activation/activation_cuda.h"
#include "ops/activation/activation_internal.h"

namespace trainscale {

const char* gelu_approximation_name(GeluApproximation approx) {
  switch (approx) {
    case GeluApproximation::kNone: return "none";
    case GeluApproximation::kTanh: return "tanh";
  }
  return "unknown";
}

namespace {

using ops::activation::Activation;

void check_approximation(detail::OpChecker& c, GeluApproximation approx) {
  if (!(approx == GeluApproximation::kNone || approx == GeluApproximation::kTanh))
    c.fail("approx", "GeluApproximation::kNone or kTanh",
           "value " + std::to_string(static_cast<int>(approx)));
}

// ab [..., 2F] seen as its a (first F columns) or b (last F columns) half.
enum class Half { kA, kB };
TensorView packed_half(const TensorView& ab, Half half) {
  TensorView h = ab;
  const std::int64_t f = ab.size(-1) / 2;
  h.shape[h.ndim - 1] = f;
  if (half == Half::kB && ab.data != nullptr) {
    h.data = static_cast<char*>(ab.data) + f * static_cast<std::int64_t>(ab.element_size());
  }
  return h;
}

void check_packed(detail::OpChecker& c, const TensorView& ab) {
  c.float_rows(ab, "ab");
  if (!(ab.size(-1) % 2 == 0))
    c.fail("ab", "an even last dim (the a and b halves of [..., 2F])", "shape " + ab.shape_str());
}

// y or dy of a packed call: [..., F] with ab's dtype.
void check_packed_half_like(detail::OpChecker& c, const TensorView& t, const char* name,
                            const TensorView& ab) {
  c.present(t, name).same_dtype(t, name, ab, "ab");
  const TensorView a = packed_half(ab, Half::kA);
  bool same = t.ndim == a.ndim;
  for (int d = 0; same && d < t.ndim; ++d) same = t.shape[d] == a.shape[d];
  if (!same)
    c.fail(name, "shape " + a.shape_str() + " ('ab' with its last dim halved)", t.shape_str());
  c.rows(t, name);
}

void plain_forward(detail::OpChecker& c, Activation act, const TensorView& x, TensorView y,
                   cudaStream_t stream) {
  c.float_rows(x, "x");
  c.like(y, "y", x, "x");
  c.disjoint_or_in_place(y, "y", x, "x");
  if (detail::ran_on_cuda(c, [&] {
        ops::activation::activation_forward_cuda(act, x, y, stream, c.op());
      })) {
    return;
  }
  ops::activation::activation_forward_cpu(act, x, y);
}

void plain_backward(detail::OpChecker& c, Activation act, const TensorView& dy, const TensorView& x,
                    TensorView dx, cudaStream_t stream) {
  c.float_rows(x, "x");
  c.like(dy, "dy", x, "x");
  c.like(dx, "dx", x, "x");
  c.disjoint_or_in_place(dx, "dx", dy, "dy");
  c.disjoint_or_in_place(dx, "dx", x, "x");
  if (detail::ran_on_cuda(c, [&] {
        ops::activation::activation_backward_cuda(act, dy, x, dx, stream, c.op());
      })) {
    return;
  }
  ops::activation::activation_backward_cpu(act, dy, x, dx);
}

void gated_forward(detail::OpChecker& c, Activation act, const TensorView& a, const TensorView& b,
                   TensorView y, cudaStream_t stream) {
  c.float_rows(a, "a");
  c.like(b, "b", a, "a");
  c.like(y, "y", a, "a");
  c.disjoint_or_in_place(y, "y", a, "a");
  c.disjoint_or_in_place(y, "y", b, "b");
  if (detail::ran_on_cuda(c, [&] {
        ops::activation::gated_forward_cuda(act, a, b, y, stream, c.op());
      })) {
    return;
  }
  ops::activation::gated_forward_cpu(act, a, b, y);
}

// With y, also the forward's y = act(a) * b (for a backward that did not keep it).
void gated_backward(detail::OpChecker& c, Activation act, const TensorView& dy, const TensorView& a,
                    const TensorView& b, TensorView da, TensorView db, const TensorView* y,
                    cudaStream_t stream) {
  c.float_rows(a, "a");
  c.like(b, "b", a, "a");
  c.like(dy, "dy", a, "a");
  for (auto [grad, name] : {std::pair{da, "da"}, std::pair{db, "db"}}) {
    c.like(grad, name, a, "a");
    c.disjoint_or_in_place(grad, name, dy, "dy");
    c.disjoint_or_in_place(grad, name, a, "a");
    c.disjoint_or_in_place(grad, name, b, "b");
  }
  c.no_overlap(da, "da", db, "db");
  if (y != nullptr) {
    c.like(*y, "y", a, "a");
    c.no_overlap(*y, "y", dy, "dy");
    c.no_overlap(*y, "y", a, "a");
    c.no_overlap(*y, "y", b, "b");
    c.no_overlap(*y, "y", da, "da");
    c.no_overlap(*y, "y", db, "db");
  }
  if (detail::ran_on_cuda(c, [&] {
        ops::activation::gated_backward_cuda(act, dy, a, b, da, db, y, stream, c.op());
      })) {
    return;
  }
  // y first: da / db may be a / b themselves.
  if (y != nullptr) ops::activation::gated_forward_cpu(act, a, b, *y);
  ops::activation::gated_backward_cpu(act, dy, a, b, da, db);
}

void packed_forward(detail::OpChecker& c, Activation act, const TensorView& ab, TensorView y,
                    cudaStream_t stream) {
  check_packed(c, ab);
  check_packed_half_like(c, y, "y", ab);
  c.no_overlap(y, "y", ab, "ab");
  const TensorView a = packed_half(ab, Half::kA), b = packed_half(ab, Half::kB);
  if (detail::ran_on_cuda(c, [&] {
        ops::activation::gated_forward_cuda(act, a, b, y, stream, c.op());
      })) {
    return;
  }
  ops::activation::gated_forward_cpu(act, a, b, y);
}

void packed_backward(detail::OpChecker& c, Activation act, const TensorView& dy,
                     const TensorView& ab, TensorView dab, cudaStream_t stream) {
  check_packed(c, ab);
  check_packed_half_like(c, dy, "dy", ab);
  c.like(dab, "dab", ab, "ab");
  c.disjoint_or_in_place(dab, "dab", ab, "ab");
  c.no_overlap(dab, "dab", dy, "dy");
  const TensorView a = packed_half(ab, Half::kA), b = packed_half(ab, Half::kB);
  const TensorView da = packed_half(dab, Half::kA), db = packed_half(dab, Half::kB);
  if (detail::ran_on_cuda(c, [&] {
        ops::activation::gated_backward_cuda(act, dy, a, b, da, db, nullptr, stream, c.op());
      })) {
    return;
  }
  ops::activation::gated_backward_cpu(act, dy, a, b, da, db);
}

}  // namespace

void gelu_forward(const TensorView& x, TensorView y, GeluApproximation approx,
                  cudaStream_t stream) {
  detail::OpChecker c("gelu_forward");
  check_approximation(c, approx);
  plain_forward(c, ops::activation::gelu_activation(approx), x, y, stream);
}

void gelu_backward(const TensorView& dy, const TensorView& x, TensorView dx,
                   GeluApproximation approx, cudaStream_t stream) {
  detail::OpChecker c("gelu_backward");
  check_approximation(c, approx);
  plain_backward(c, ops::activation::gelu_activation(approx), dy, x, dx, stream);
}

void silu_forward(const TensorView& x, TensorView y, cudaStream_t stream) {
  detail::OpChecker c("silu_forward");
  plain_forward(c, Activation::kSilu, x, y, stream);
}

void silu_backward(const TensorView& dy, const TensorView& x, TensorView dx,
                   cudaStream_t stream) {
  detail::OpChecker c("silu_backward");
  plain_backward(c, Activation::kSilu, dy, x, dx, stream);
}

void swiglu_forward(const TensorView& a, const TensorView& b, TensorView y,
                    cudaStream_t stream) {
  detail::OpChecker c("swiglu_forward");
  gated_forward(c, Activation::kSilu, a, b, y, stream);
}

void swiglu_backward(const TensorView& dy, const TensorView& a, const TensorView& b, TensorView da,
                     TensorView db, cudaStream_t stream) {
  detail::OpChecker c("swiglu_backward");
  gated_backward(c, Activation::kSilu, dy, a, b, da, db, nullptr, stream);
}

void swiglu_backward_recompute(const TensorView& dy, const TensorView& a, const TensorView& b,
                               TensorView da, TensorView db, TensorView y, cudaStream_t stream) {
  detail::OpChecker c("swiglu_backward_recompute");
  gated_backward(c, Activation::kSilu, dy, a, b, da, db, &y, stream);
}

void geglu_forward(const TensorView& a, const TensorView& b, TensorView y, GeluApproximation approx,
                   cudaStream_t stream) {
  detail::OpChecker c("geglu_forward");
  check_approximation(c, approx);
  gated_forward(c, ops::activation::gelu_activation(approx), a, b, y, stream);
}

void geglu_backward(const TensorView& dy, const TensorView& a, const TensorView& b, TensorView da,
                    TensorView db, GeluApproximation approx, cudaStream_t stream) {
  detail::OpChecker c("geglu_backward");
  check_approximation(c, approx);
  gated_backward(c, ops::activation::gelu_activation(approx), dy, a, b, da, db, nullptr, stream);
}

void swiglu_forward_packed(const TensorView& ab, TensorView y, cudaStream_t stream) {
  detail::OpChecker c("swiglu_forward_packed");
  packed_forward(c, Activation::kSilu, ab, y, stream);
}

void swiglu_backward_packed(const TensorView& dy, const TensorView& ab, TensorView dab,
                            cudaStream_t stream) {
  detail::OpChecker c("swiglu_backward_packed");
  packed_backward(c, Activation::kSilu, dy, ab, dab, stream);
}

void geglu_forward_packed(const TensorView& ab, TensorView y, GeluApproximation approx,
                          cudaStream_t stream) {
  detail::OpChecker c("geglu_forward_packed");
  check_approximation(c, approx);
  packed_forward(c, ops::activation::gelu_activation(approx), ab, y, stream);
}

void geglu_backward_packed(const TensorView& dy, const TensorView& ab, TensorView dab,
                           GeluApproximation approx, cudaStream_t stream) {
  detail::OpChecker c("geglu_backward_packed");
  check_approximation(c, approx);
  packed_backward(c, ops::activation::gelu_activation(approx), dy, ab, dab, stream);
}

}  // namespace trainscale
