// Activation kernels: one elementwise kernel template (common/elementwise.cuh) instantiated per
// activation (GeluErf, GeluTanh, Silu), form (plain / gated, forward / backward), dtype and path
// (16-byte units or scalar). Each activation's math is one __device__ function giving the value
// and the derivative together; a form uses what it needs and the compiler drops the rest.
//
// Math in fp32, in the order of the fp64 reference (activation_cpu.cc), so NaN/Inf land where
// the reference puts them:
//   gelu_erf  = x Phi(x),            Phi = 0.5 (1 + erf(x / sqrt2)), d = Phi + x phi(x)
//   gelu_tanh = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), computed as
//               x sigmoid(2u) (the same function, one exponential), d = s + 2 x s (1 - s) u'
//   silu      = x s,                 s = sigmoid(x), d = s (1 + x (1 - s))
// sigmoid uses the hardware exponential and reciprocal (MUFU, a few ulp; the float32 GPU tests
// hold at their 1e-5 tolerance), as Triton does: with the accurate expf and a correctly rounded reciprocal the
// instruction count per element, not HBM, bounded swiglu. The exponential is
// ex2.approx.ftz with the base change folded into the argument's constants: __expf's subnormal
// handling (a compare and two predicated multiplies per element) only ever changes 1 + e by
// less than half an ulp, and for gelu_tanh the argument is one polynomial in x.
// Tanh itself (tanh.approx, one MUFU) was not taken: its error, ~2^-11 relative, is ~5e-4 next
// to 1 + tanh(u) = 2.4e-3 at x = -3 (20 % off there, worse below), where 1 + tanh(u) cancels.
#include <array>

#include "common/elementwise.cuh"
#include "ops/activation/activation_cuda.h"

namespace trainscale::ops::activation {
namespace {

using detail::StridedRows;

struct ValueAndDerivative {
  float value;
  float derivative;
};

constexpr float kLog2e = 1.44269504088896341f;

// 1 / (1 + 2^t). 2^t below the normal range flushes to 0 (1 + 2^t rounds to 1 there anyway);
// 1 + 2^t = +Inf gives 0; NaN stays NaN.
__device__ __forceinline__ float inv_one_plus_exp2(float t) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(t));
  return __fdividef(1.f, 1.f + e);
}

__device__ __forceinline__ float sigmoid(float z) { return inv_one_plus_exp2(-kLog2e * z); }

struct GeluErf {
  __device__ static ValueAndDerivative eval(float x) {
    constexpr float kInvSqrt2 = 0.707106781186547524f;
    constexpr float kInvSqrt2Pi = 0.398942280401432678f;  // 1 / sqrt(2 pi)
    // erfc keeps Phi accurate for negative x, where 1 + erf(x) cancels.
    const float cdf = 0.5f * erfcf(-x * kInvSqrt2);
    // x * x overflowing to inf gives exp(-inf) = 0 and x * 0 = 0, as in fp64 for finite x.
    return {x * cdf, cdf + x * (expf(-0.5f * x * x) * kInvSqrt2Pi)};
  }
};

struct GeluTanh {
  static constexpr float kScale = 0.797884560802865356f;  // sqrt(2 / pi)
  static constexpr float kCubic = 0.044715f;
  __device__ static ValueAndDerivative eval(float x) {
    // sigmoid(2u) = 1 / (1 + 2^(-2 log2(e) u)), the constants folded into u's polynomial.
    constexpr float kLinear = -2.f * kLog2e * kScale;
    constexpr float kCubed = -2.f * kLog2e * kScale * kCubic;
    const float x2 = x * x;
    const float s = inv_one_plus_exp2(x * (kLinear + kCubed * x2));  // 0.5 (1 + tanh(u))
    // u' = sqrt(2/pi) (1 + 3 c x^2); x^2 capped so that a huge finite x gives 0 * finite = 0
    // (fp64 does not overflow there) while NaN and +-Inf still give NaN through s and x.
    const float du = kScale + (3.f * kScale * kCubic) * fminf(x2, 1e30f);
    // 0.5 x (1 - tanh^2(u)) u' = 2 x s (1 - s) u'.
    return {x * s, s + x * (2.f * s * (1.f - s)) * du};
  }
};

struct Silu {
  __device__ static ValueAndDerivative eval(float x) {
    const float s = sigmoid(x);
    return {x * s, s * (1.f + x * (1.f - s))};
  }
};

// Forms: inputs and outputs in the order the launchers below pass them.
template <class Act>
struct Forward {  // (x) -> (y)
  static constexpr int kIn = 1, kOut = 1;
  __device__ void operator()(const float (&in)[1], float (&out)[1]) const {
    out[0] = Act::eval(in[0]).value;
  }
};

template <class Act>
struct Backward {  // (dy, x) -> (dx)
  static constexpr int kIn = 2, kOut = 1;
  __device__ void operator()(const float (&in)[2], float (&out)[1]) const {
    out[0] = in[0] * Act::eval(in[1]).derivative;
  }
};

template <class Act>
struct GatedForward {  // (a, b) -> (y)
  static constexpr int kIn = 2, kOut = 1;
  __device__ void operator()(const float (&in)[2], float (&out)[1]) const {
    out[0] = Act::eval(in[0]).value * in[1];
  }
};

template <class Act>
struct GatedBackward {  // (dy, a, b) -> (da, db)
  static constexpr int kIn = 3, kOut = 2;
  __device__ void operator()(const float (&in)[3], float (&out)[2]) const {
    const ValueAndDerivative e = Act::eval(in[1]);
    out[0] = in[0] * in[2] * e.derivative;
    out[1] = in[0] * e.value;
  }
};

template <class Act>
struct GatedBackwardAndForward {  // (dy, a, b) -> (da, db, y): y as GatedForward writes it
  static constexpr int kIn = 3, kOut = 3;
  __device__ void operator()(const float (&in)[3], float (&out)[3]) const {
    const ValueAndDerivative e = Act::eval(in[1]);
    out[0] = in[0] * in[2] * e.derivative;
    out[1] = in[0] * e.value;
    out[2] = e.value * in[2];
  }
};

template <template <class> class Form, class Fn>
void with_form(Activation act, Fn&& fn) {
  switch (act) {
    case Activation::kGeluErf: return fn(Form<GeluErf>{});
    case Activation::kGeluTanh: return fn(Form<GeluTanh>{});
    case Activation::kSilu: return fn(Form<Silu>{});
  }
}

// Launches Form<act> over validated views of one shape and dtype (in[0] gives both).
template <template <class> class Form, std::size_t NIn, std::size_t NOut>
void run(Activation act, const char* op, const std::array<TensorView, NIn>& in,
         const std::array<TensorView, NOut>& out, cudaStream_t stream) {
  const detail::Rows shape = detail::row_layout(in[0]);
  std::array<StridedRows, NIn> in_rows;
  std::array<StridedRows, NOut> out_rows;
  for (std::size_t n = 0; n < NIn; ++n) in_rows[n] = {in[n].data, detail::row_layout(in[n]).row_stride};
  for (std::size_t n = 0; n < NOut; ++n) {
    out_rows[n] = {out[n].data, detail::row_layout(out[n]).row_stride};
  }
  with_form<Form>(act, [&](auto form) {
    detail::dispatch_activation_dtype(in[0].dtype, op, [&](auto tag) {
      using T = typename decltype(tag)::type;
      detail::launch_elementwise<T>(op, shape.rows, shape.cols, in_rows, out_rows, form, stream);
    });
  });
}

}  // namespace

void activation_forward_cuda(Activation act, const TensorView& x, TensorView y,
                             cudaStream_t stream, const char* op) {
  run<Forward, 1, 1>(act, op, {x}, {y}, stream);
}

void activation_backward_cuda(Activation act, const TensorView& dy, const TensorView& x,
                              TensorView dx, cudaStream_t stream, const char* op) {
  run<Backward, 2, 1>(act, op, {dy, x}, {dx}, stream);
}

void gated_forward_cuda(Activation act, const TensorView& a, const TensorView& b, TensorView y,
                        cudaStream_t stream, const char* op) {
  run<GatedForward, 2, 1>(act, op, {a, b}, {y}, stream);
}

void gated_backward_cuda(Activation act, const TensorView& dy, const TensorView& a,
                         const TensorView& b, TensorView da, TensorView db, const TensorView* y,
                         cudaStream_t stream, const char* op) {
  if (y != nullptr) {
    run<GatedBackwardAndForward, 3, 3>(act, op, {dy, a, b}, {da, db, *y}, stream);
  } else {
    run<GatedBackward, 3, 2>(act, op, {dy, a, b}, {da, db}, stream);
  }
}

}  // namespace trainscale::ops::activation
