// fp64 reference for the activation family: one elementwise driver, instantiated per
// activation and per form (plain / gated, forward / backward).
#include <algorithm>
#include <array>
#include <cmath>
#include <numbers>

#include "core/host_dtype.h"
#include "core/parallel.h"
#include "ops/activation/activation_internal.h"

namespace trainscale::ops::activation {

using detail::load_as_double;
using detail::store_from_double;

namespace {

struct GeluErf {
  // Phi(x) = erfc(-x / sqrt2) / 2: no cancellation for negative x, as 1 + erf(x / sqrt2) has.
  static double cdf(double x) { return 0.5 * std::erfc(-x * std::numbers::sqrt2 / 2); }
  static double value(double x) { return x * cdf(x); }
  // Phi(x) + x phi(x).
  static double derivative(double x) {
    const double pdf = std::exp(-0.5 * x * x) * std::numbers::inv_sqrtpi / std::numbers::sqrt2;
    return cdf(x) + x * pdf;
  }
};

struct GeluTanh {
  static constexpr double kScale = std::numbers::sqrt2 * std::numbers::inv_sqrtpi;  // sqrt(2/pi)
  static constexpr double kCubic = 0.044715;
  static double value(double x) {
    return 0.5 * x * (1.0 + std::tanh(kScale * (x + kCubic * x * x * x)));
  }
  static double derivative(double x) {
    const double t = std::tanh(kScale * (x + kCubic * x * x * x));
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kScale * (1.0 + 3.0 * kCubic * x * x);
  }
};

struct Silu {
  static double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
  static double value(double x) { return x * sigmoid(x); }
  static double derivative(double x) {
    const double s = sigmoid(x);
    return s * (1.0 + x * (1.0 - s));
  }
};

// Calls fn with the functor of `act`, so the element loop is compiled once per activation.
template <class Fn>
void with_activation(Activation act, Fn&& fn) {
  switch (act) {
    case Activation::kGeluErf: return fn(GeluErf{});
    case Activation::kGeluTanh: return fn(GeluTanh{});
    case Activation::kSilu: return fn(Silu{});
  }
}

// out[k](i, j) = fn(in(i, j))[k] for every element of views sharing one rows x cols shape.
// Every input of an element is read before any output of it is written, so an output may be
// the same view as an input.
template <std::size_t NumIn, std::size_t NumOut, class Fn>
void for_each_element(const std::array<TensorView, NumIn>& in,
                      const std::array<TensorView, NumOut>& out, Fn fn) {
  std::array<std::int64_t, NumIn> in_stride;
  std::array<std::int64_t, NumOut> out_stride;
  for (std::size_t k = 0; k < NumIn; ++k) in_stride[k] = detail::row_layout(in[k]).row_stride;
  for (std::size_t k = 0; k < NumOut; ++k) out_stride[k] = detail::row_layout(out[k]).row_stride;
  const detail::Rows shape = detail::row_layout(out[0]);
  const std::int64_t rows_per_chunk =
      std::max<std::int64_t>(1, 16384 / std::max<std::int64_t>(shape.cols, 1));
  detail::parallel_for(shape.rows, rows_per_chunk, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      for (std::int64_t j = 0; j < shape.cols; ++j) {
        std::array<double, NumIn> v;
        for (std::size_t k = 0; k < NumIn; ++k) {
          v[k] = load_as_double(in[k].dtype, in[k].data, i * in_stride[k] + j);
        }
        const std::array<double, NumOut> r = fn(v);
        for (std::size_t k = 0; k < NumOut; ++k) {
          store_from_double(out[k].dtype, out[k].data, i * out_stride[k] + j, r[k]);
        }
      }
    }
  });
}

}  // namespace

void activation_forward_cpu(Activation act, const TensorView& x, TensorView y) {
  with_activation(act, [&](auto f) {
    for_each_element<1, 1>({x}, {y}, [f](const auto& v) { return std::array{f.value(v[0])}; });
  });
}

void activation_backward_cpu(Activation act, const TensorView& dy, const TensorView& x,
                             TensorView dx) {
  with_activation(act, [&](auto f) {
    for_each_element<2, 1>({dy, x}, {dx},
                           [f](const auto& v) { return std::array{v[0] * f.derivative(v[1])}; });
  });
}

void gated_forward_cpu(Activation act, const TensorView& a, const TensorView& b, TensorView y) {
  with_activation(act, [&](auto f) {
    for_each_element<2, 1>({a, b}, {y},
                           [f](const auto& v) { return std::array{f.value(v[0]) * v[1]}; });
  });
}

void gated_backward_cpu(Activation act, const TensorView& dy, const TensorView& a,
                        const TensorView& b, TensorView da, TensorView db) {
  with_activation(act, [&](auto f) {
    for_each_element<3, 2>({dy, a, b}, {da, db}, [f](const auto& v) {
      const double g = v[0], av = v[1], bv = v[2];
      return std::array{g * bv * f.derivative(av), g * f.value(av)};
    });
  });
}

}  // namespace trainscale::ops::activation
