#include "trainscale/activation.h"

#include <cmath>
#include <functional>
#include <numbers>

#include "util/gpu_util.h"

namespace trainscale {
namespace {

using test::HostTensor;

constexpr auto kForwardDtypes = {DType::kFloat32, DType::kFloat16, DType::kBFloat16,
                                 DType::kFloat64};

// Independent scalar forms (erfc instead of erf, sigmoid(2u) instead of (1 + tanh u) / 2).
double gelu_erf_formula(double x) { return 0.5 * x * std::erfc(-x / std::numbers::sqrt2); }
double gelu_tanh_formula(double x) {
  const double u = std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * x * x * x);
  return x / (1.0 + std::exp(-2.0 * u));
}
double silu_formula(double x) { return x / (1.0 + std::exp(-x)); }

using UnaryFn = std::function<void(const TensorView&, TensorView)>;
using BinaryFn = std::function<void(const TensorView&, const TensorView&, TensorView)>;
using GatedBackwardFn = std::function<void(const TensorView&, const TensorView&, const TensorView&,
                                           TensorView, TensorView)>;

// One activation with its plain, gated and packed-gated entry points.
struct ActivationCase {
  const char* name;
  double (*formula)(double);
  UnaryFn forward;
  BinaryFn backward;               // (dy, x, dx)
  BinaryFn gated_forward;          // (a, b, y)
  GatedBackwardFn gated_backward;  // (dy, a, b, da, db)
  UnaryFn packed_forward;          // (ab, y)
  BinaryFn packed_backward;        // (dy, ab, dab)
};

ActivationCase gelu_case(GeluApproximation ap) {
  return {
      ap == GeluApproximation::kNone ? "gelu_erf" : "gelu_tanh",
      ap == GeluApproximation::kNone ? gelu_erf_formula : gelu_tanh_formula,
      [ap](const auto& x, auto y) { gelu_forward(x, y, ap); },
      [ap](const auto& dy, const auto& x, auto dx) { gelu_backward(dy, x, dx, ap); },
      [ap](const auto& a, const auto& b, auto y) { geglu_forward(a, b, y, ap); },
      [ap](const auto& dy, const auto& a, const auto& b, auto da, auto db) {
        geglu_backward(dy, a, b, da, db, ap);
      },
      [ap](const auto& ab, auto y) { geglu_forward_packed(ab, y, ap); },
      [ap](const auto& dy, const auto& ab, auto dab) { geglu_backward_packed(dy, ab, dab, ap); }};
}

ActivationCase silu_case() {
  return {"silu",
          silu_formula,
          [](const auto& x, auto y) { silu_forward(x, y); },
          [](const auto& dy, const auto& x, auto dx) { silu_backward(dy, x, dx); },
          [](const auto& a, const auto& b, auto y) { swiglu_forward(a, b, y); },
          [](const auto& dy, const auto& a, const auto& b, auto da, auto db) {
            swiglu_backward(dy, a, b, da, db);
          },
          [](const auto& ab, auto y) { swiglu_forward_packed(ab, y); },
          [](const auto& dy, const auto& ab, auto dab) { swiglu_backward_packed(dy, ab, dab); }};
}

ActivationCase case_at(int index) {
  switch (index) {
    case 0: return gelu_case(GeluApproximation::kNone);
    case 1: return gelu_case(GeluApproximation::kTanh);
    default: return silu_case();
  }
}

// Copies column range [first, first + cols) of every row of a [M, N] tensor into a new
// contiguous [M, cols] tensor.
HostTensor columns(const HostTensor& t, std::int64_t first, std::int64_t cols) {
  const std::int64_t m = t.shape()[0], n = t.shape()[1];
  HostTensor out(t.dtype(), {m, cols});
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) out.set(i * cols + j, t.at(i * n + first + j));
  }
  return out;
}

class ActivationOp : public ::testing::TestWithParam<int> {
 protected:
  ActivationCase op = case_at(GetParam());
};

TEST_P(ActivationOp, ForwardMatchesFormulaEveryDtype) {
  for (DType dt : kForwardDtypes) {
    for (std::int64_t n : {1, 7, 129}) {
      auto x = HostTensor::random(dt, {2, 3, n}, -5, 5, /*row_pad=*/3);
      HostTensor y(dt, {2, 3, n}, /*row_pad=*/1);
      op.forward(x.view(), y.view());
      std::vector<double> ref(x.numel());
      for (std::int64_t i = 0; i < x.numel(); ++i) ref[i] = op.formula(x.at(i));
      EXPECT_TRUE(test::matches_reference(y.values(), ref, test::tolerance(dt)))
          << op.name << " " << dtype_name(dt) << " n=" << n;
    }
  }
}

TEST_P(ActivationOp, GatedForwardMatchesFormulaAndPackedEqualsSeparate) {
  for (DType dt : kForwardDtypes) {
    for (std::int64_t f : {1, 6, 133}) {
      auto ab = HostTensor::random(dt, {5, 2 * f}, -5, 5, /*row_pad=*/2);
      HostTensor y_packed(dt, {5, f}, /*row_pad=*/1);
      op.packed_forward(ab.view(), y_packed.view());
      const HostTensor a = columns(ab, 0, f), b = columns(ab, f, f);
      HostTensor y(dt, {5, f});
      op.gated_forward(a.view(), b.view(), y.view());
      std::vector<double> ref(a.numel());
      for (std::int64_t i = 0; i < a.numel(); ++i) ref[i] = op.formula(a.at(i)) * b.at(i);
      EXPECT_TRUE(test::matches_reference(y.values(), ref, test::tolerance(dt)))
          << op.name << " " << dtype_name(dt) << " f=" << f;
      EXPECT_EQ(y_packed.values(), y.values()) << op.name << " " << dtype_name(dt);
    }
  }
}

TEST_P(ActivationOp, BackwardMatchesFiniteDifferences) {
  const std::vector<std::int64_t> shape = {3, 5};
  auto x = HostTensor::random(DType::kFloat64, shape, -4, 4);
  auto dy = HostTensor::random(DType::kFloat64, shape);
  HostTensor dx(DType::kFloat64, shape);
  op.backward(dy.view(), x.view(), dx.view());
  auto loss = [&](const std::vector<double>& xv) {
    auto xt = HostTensor::from_values(DType::kFloat64, shape, xv);
    HostTensor y(DType::kFloat64, shape);
    op.forward(xt.view(), y.view());
    return test::dot(dy.values(), y.values());
  };
  EXPECT_TRUE(test::matches_reference(dx.values(), test::numeric_gradient(x.values(), loss), 1e-7))
      << op.name;
}

TEST_P(ActivationOp, GatedBackwardMatchesFiniteDifferences) {
  const std::vector<std::int64_t> shape = {3, 5};
  auto a = HostTensor::random(DType::kFloat64, shape, -4, 4);
  auto b = HostTensor::random(DType::kFloat64, shape, -2, 2);
  auto dy = HostTensor::random(DType::kFloat64, shape);
  HostTensor da(DType::kFloat64, shape), db(DType::kFloat64, shape);
  op.gated_backward(dy.view(), a.view(), b.view(), da.view(), db.view());
  auto loss = [&](const std::vector<double>& av, const std::vector<double>& bv) {
    auto at = HostTensor::from_values(DType::kFloat64, shape, av);
    auto bt = HostTensor::from_values(DType::kFloat64, shape, bv);
    HostTensor y(DType::kFloat64, shape);
    op.gated_forward(at.view(), bt.view(), y.view());
    return test::dot(dy.values(), y.values());
  };
  const auto av = a.values(), bv = b.values();
  EXPECT_TRUE(test::matches_reference(
      da.values(), test::numeric_gradient(av, [&](const auto& v) { return loss(v, bv); }), 1e-7))
      << op.name;
  EXPECT_TRUE(test::matches_reference(
      db.values(), test::numeric_gradient(bv, [&](const auto& v) { return loss(av, v); }), 1e-7))
      << op.name;
}

TEST_P(ActivationOp, PackedBackwardMatchesFiniteDifferences) {
  const std::int64_t m = 3, f = 4;
  auto ab = HostTensor::random(DType::kFloat64, {m, 2 * f}, -4, 4);
  auto dy = HostTensor::random(DType::kFloat64, {m, f});
  HostTensor dab(DType::kFloat64, {m, 2 * f}, /*row_pad=*/3);
  op.packed_backward(dy.view(), ab.view(), dab.view());
  auto loss = [&](const std::vector<double>& abv) {
    auto t = HostTensor::from_values(DType::kFloat64, {m, 2 * f}, abv);
    HostTensor y(DType::kFloat64, {m, f});
    op.packed_forward(t.view(), y.view());
    return test::dot(dy.values(), y.values());
  };
  EXPECT_TRUE(
      test::matches_reference(dab.values(), test::numeric_gradient(ab.values(), loss), 1e-7))
      << op.name;
}

TEST_P(ActivationOp, InPlaceEqualsOutOfPlace) {
  const DType dt = DType::kBFloat16;
  auto x = HostTensor::random(dt, {4, 9}, -3, 3, 2), dy = HostTensor::random(dt, {4, 9}, -1, 1, 1);
  HostTensor y(dt, {4, 9}), dx(dt, {4, 9});
  op.forward(x.view(), y.view());
  op.backward(dy.view(), x.view(), dx.view());
  HostTensor x_in_place = x, dy_in_place = dy, x_for_dx = x;
  op.forward(x_in_place.view(), x_in_place.view());
  EXPECT_EQ(x_in_place.values(), y.values());
  op.backward(dy_in_place.view(), x.view(), dy_in_place.view());
  EXPECT_EQ(dy_in_place.values(), dx.values());
  op.backward(dy.view(), x_for_dx.view(), x_for_dx.view());
  EXPECT_EQ(x_for_dx.values(), dx.values());

  // Gated: y over b; da over a and db over b; packed gradient over ab.
  auto ab = HostTensor::random(dt, {4, 18}, -3, 3, 1);
  const HostTensor a = columns(ab, 0, 9), b = columns(ab, 9, 9);
  HostTensor gy(dt, {4, 9}), da(dt, {4, 9}), db(dt, {4, 9}), dab(dt, {4, 18});
  op.gated_forward(a.view(), b.view(), gy.view());
  op.gated_backward(dy.view(), a.view(), b.view(), da.view(), db.view());
  op.packed_backward(dy.view(), ab.view(), dab.view());
  HostTensor b_in_place = b;
  op.gated_forward(a.view(), b_in_place.view(), b_in_place.view());
  EXPECT_EQ(b_in_place.values(), gy.values());
  HostTensor a2 = a, b2 = b;
  op.gated_backward(dy.view(), a2.view(), b2.view(), a2.view(), b2.view());
  EXPECT_EQ(a2.values(), da.values());
  EXPECT_EQ(b2.values(), db.values());
  op.packed_backward(dy.view(), ab.view(), ab.view());
  EXPECT_EQ(ab.values(), dab.values());
  EXPECT_EQ(columns(dab, 0, 9).values(), da.values());
  EXPECT_EQ(columns(dab, 9, 9).values(), db.values());
}

// swiglu_backward_recompute: swiglu_backward's da / db and swiglu_forward's y, bit for bit, in
// every dtype, out of place and with da / db over a / b.
TEST(Activation, SwigluBackwardRecomputeIsBackwardPlusForward) {
  for (DType dt : {DType::kFloat64, DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    const auto a = HostTensor::random(dt, {5, 37}, -6, 6, /*row_pad=*/3);
    const auto b = HostTensor::random(dt, {5, 37}, -2, 2), dy = HostTensor::random(dt, {5, 37});
    HostTensor y(dt, {5, 37}), da(dt, {5, 37}), db(dt, {5, 37});
    swiglu_forward(a.view(), b.view(), y.view());
    swiglu_backward(dy.view(), a.view(), b.view(), da.view(), db.view());
    HostTensor y2(dt, {5, 37}), da2(dt, {5, 37}), db2(dt, {5, 37});
    swiglu_backward_recompute(dy.view(), a.view(), b.view(), da2.view(), db2.view(), y2.view());
    EXPECT_EQ(y2.values(), y.values());
    EXPECT_EQ(da2.values(), da.values());
    EXPECT_EQ(db2.values(), db.values());
    HostTensor a3 = a, b3 = b, y3(dt, {5, 37});
    swiglu_backward_recompute(dy.view(), a3.view(), b3.view(), a3.view(), b3.view(), y3.view());
    EXPECT_EQ(y3.values(), y.values());
    EXPECT_EQ(a3.values(), da.values());
    EXPECT_EQ(b3.values(), db.values());
  }
}

TEST(Activation, SwigluBackwardRecomputeErrors) {
  auto a = HostTensor::random(DType::kBFloat16, {3, 6}), b = HostTensor::random(DType::kBFloat16, {3, 6});
  auto dy = HostTensor::random(DType::kBFloat16, {3, 6});
  HostTensor da(DType::kBFloat16, {3, 6}), db(DType::kBFloat16, {3, 6}), y(DType::kBFloat16, {3, 6}),
      wide(DType::kBFloat16, {3, 7}), y32(DType::kFloat32, {3, 6});
  TS_EXPECT_ERROR(swiglu_backward_recompute(dy.view(), a.view(), b.view(), da.view(), db.view(), wide.view()),
                  "swiglu_backward_recompute", "argument 'y'", "[3, 7]");
  TS_EXPECT_ERROR(swiglu_backward_recompute(dy.view(), a.view(), b.view(), da.view(), db.view(), y32.view()),
                  "swiglu_backward_recompute", "argument 'y'", "float32");
  TS_EXPECT_ERROR(swiglu_backward_recompute(dy.view(), a.view(), b.view(), da.view(), db.view(), TensorView()),
                  "swiglu_backward_recompute", "argument 'y'");
  for (const HostTensor* t : {&dy, &a, &b, &da, &db}) {
    TS_EXPECT_ERROR(swiglu_backward_recompute(dy.view(), a.view(), b.view(), da.view(), db.view(), t->view()),
                    "swiglu_backward_recompute", "argument 'y'", "disjoint from");
  }
}

TEST_P(ActivationOp, EmptyNaNAndInfinity) {
  for (std::vector<std::int64_t> shape : {std::vector<std::int64_t>{0, 8}, {3, 0}}) {
    HostTensor x(DType::kFloat32, shape), y(DType::kFloat32, shape);
    op.forward(x.view(), y.view());
    op.backward(x.view(), x.view(), y.view());
    HostTensor ab(DType::kFloat32, {shape[0], 2 * shape[1]});
    op.packed_forward(ab.view(), y.view());
    op.packed_backward(y.view(), ab.view(), ab.view());
  }
  auto x = HostTensor::random(DType::kFloat16, {2, 5}, -2, 2);
  x.set(3, NAN);
  x.set(7, INFINITY);
  HostTensor y(DType::kFloat16, {2, 5}), dx(DType::kFloat16, {2, 5});
  op.forward(x.view(), y.view());
  op.backward(x.view(), x.view(), dx.view());
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    if (i == 3) {
      EXPECT_TRUE(std::isnan(y.at(i)) && std::isnan(dx.at(i))) << op.name;
    } else if (i == 7) {
      EXPECT_EQ(y.at(i), INFINITY) << op.name;
    } else {
      EXPECT_TRUE(std::isfinite(y.at(i)) && std::isfinite(dx.at(i))) << op.name << " " << i;
    }
  }
  auto b = HostTensor::random(DType::kFloat16, {2, 5});
  HostTensor gy(DType::kFloat16, {2, 5});
  op.gated_forward(x.view(), b.view(), gy.view());
  EXPECT_TRUE(std::isnan(gy.at(3))) << op.name;
  op.gated_forward(b.view(), x.view(), gy.view());
  EXPECT_TRUE(std::isnan(gy.at(3))) << op.name;
}

INSTANTIATE_TEST_SUITE_P(All, ActivationOp, ::testing::Values(0, 1, 2), [](const auto& param_info) {
  return std::string(case_at(param_info.param).name);
});

// Closed forms at known points, run through the library in float64.
double apply(const ActivationCase& op, double x) {
  auto t = HostTensor::from_values(DType::kFloat64, {1}, {x});
  HostTensor y(DType::kFloat64, {1});
  op.forward(t.view(), y.view());
  return y.at(0);
}

double derivative(const ActivationCase& op, double x) {
  auto t = HostTensor::from_values(DType::kFloat64, {1}, {x});
  auto one = HostTensor::from_values(DType::kFloat64, {1}, {1.0});
  HostTensor dx(DType::kFloat64, {1});
  op.backward(one.view(), t.view(), dx.view());
  return dx.at(0);
}

TEST(Activation, ClosedForms) {
  const auto gelu_erf = gelu_case(GeluApproximation::kNone);
  const auto gelu_tanh = gelu_case(GeluApproximation::kTanh);
  const auto silu = silu_case();
  for (const auto* op : {&gelu_erf, &gelu_tanh, &silu}) {
    EXPECT_EQ(apply(*op, 0.0), 0.0) << op->name;
    EXPECT_DOUBLE_EQ(derivative(*op, 0.0), 0.5) << op->name;
    EXPECT_NEAR(apply(*op, 40.0), 40.0, 1e-12) << op->name;
    EXPECT_NEAR(apply(*op, -40.0), 0.0, 1e-12) << op->name;
    EXPECT_NEAR(derivative(*op, 40.0), 1.0, 1e-12) << op->name;
  }
  // Phi(1) = 0.841344746068543 (standard normal CDF); sigmoid(1) = 1 / (1 + e^-1).
  EXPECT_NEAR(apply(gelu_erf, 1.0), 0.8413447460685429, 1e-15);
  EXPECT_NEAR(apply(gelu_erf, -1.0), -(1.0 - 0.8413447460685429), 1e-15);
  EXPECT_NEAR(apply(silu, 1.0), 0.7310585786300049, 1e-15);
  EXPECT_NEAR(apply(silu, -2.0), -2.0 / (1.0 + std::exp(2.0)), 1e-15);
  // The tanh form approximates the erf form to well under 1e-3 everywhere.
  for (double x = -6.0; x <= 6.0; x += 0.01) {
    EXPECT_NEAR(apply(gelu_tanh, x), apply(gelu_erf, x), 1e-3) << x;
  }
}

TEST(Activation, NamesOfApproximations) {
  EXPECT_STREQ(gelu_approximation_name(GeluApproximation::kNone), "none");
  EXPECT_STREQ(gelu_approximation_name(GeluApproximation::kTanh), "tanh");
  EXPECT_STREQ(gelu_approximation_name(static_cast<GeluApproximation>(9)), "unknown");
}

TensorView on_cuda(TensorView t) {
  t.device = Device::cuda(0);
  return t;
}

// The same memory seen one element further on: a partial overlap.
TensorView shifted(TensorView t) {
  t.data = static_cast<char*>(t.data) + t.element_size();
  return t;
}

TEST(Activation, PlainErrors) {
  auto x = HostTensor::random(DType::kFloat32, {4, 8});
  auto x16 = HostTensor::random(DType::kFloat16, {4, 8});
  HostTensor y(DType::kFloat32, {4, 8}), y_wide(DType::kFloat32, {4, 9}),
      big(DType::kFloat32, {5, 8});
  HostTensor ints(DType::kInt32, {4, 8});
  const TensorView column_major(x.data(), DType::kFloat32, {4, 8}, {1, 4});
  const auto bad = static_cast<GeluApproximation>(7);

  TS_EXPECT_ERROR(gelu_forward(x.view(), y.view(), bad), "gelu_forward", "argument 'approx'",
                  "kNone or kTanh", "7");
  TS_EXPECT_ERROR(gelu_forward(TensorView(), y.view()), "gelu_forward", "argument 'x'", "none");
  TS_EXPECT_ERROR(gelu_forward(ints.view(), y.view()), "gelu_forward", "argument 'x'", "int32");
  TS_EXPECT_ERROR(gelu_forward(column_major, y.view()), "gelu_forward", "argument 'x'", "stride 1");
  TS_EXPECT_ERROR(gelu_forward(x.view(), TensorView()), "gelu_forward", "argument 'y'", "none");
  TS_EXPECT_ERROR(gelu_forward(x.view(), x16.view()), "gelu_forward", "argument 'y'", "float16");
  TS_EXPECT_ERROR(gelu_forward(x.view(), y_wide.view()), "gelu_forward", "argument 'y'", "[4, 8]",
                  "[4, 9]");
  TS_EXPECT_ERROR(gelu_forward(x.view(), shifted(x.view())), "gelu_forward", "argument 'y'",
                  "disjoint from 'x'", "partially overlapping");
  TS_EXPECT_ERROR(gelu_forward(x.view(), TensorView(nullptr, DType::kFloat32, {4, 8})),
                  "gelu_forward", "argument 'y'", "non-null");
  TS_EXPECT_ERROR(gelu_forward(x.view(), on_cuda(y.view())), "gelu_forward", "argument 'y'",
                  "cuda:0");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(gelu_forward(on_cuda(x.view()), on_cuda(y.view())), "gelu_forward", "CUDA");
  }
  TS_EXPECT_ERROR(silu_forward(x.view(), big.view()), "silu_forward", "argument 'y'", "[4, 8]");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(silu_forward(on_cuda(x.view()), on_cuda(y.view())), "silu_forward", "CUDA");
  }

  TS_EXPECT_ERROR(gelu_backward(x.view(), x.view(), y.view(), bad), "gelu_backward",
                  "argument 'approx'");
  TS_EXPECT_ERROR(gelu_backward(x.view(), TensorView(), y.view()), "gelu_backward", "argument 'x'");
  TS_EXPECT_ERROR(gelu_backward(x16.view(), x.view(), y.view()), "gelu_backward", "argument 'dy'",
                  "float32", "float16");
  TS_EXPECT_ERROR(gelu_backward(y_wide.view(), x.view(), y.view()), "gelu_backward",
                  "argument 'dy'", "[4, 9]");
  TS_EXPECT_ERROR(gelu_backward(x.view(), x.view(), y_wide.view()), "gelu_backward",
                  "argument 'dx'", "[4, 9]");
  TS_EXPECT_ERROR(gelu_backward(y.view(), x.view(), shifted(y.view())), "gelu_backward",
                  "argument 'dx'", "disjoint from 'dy'");
  TS_EXPECT_ERROR(gelu_backward(y.view(), x.view(), shifted(x.view())), "gelu_backward",
                  "argument 'dx'", "disjoint from 'x'");
  TS_EXPECT_ERROR(gelu_backward(on_cuda(y.view()), on_cuda(x.view()), on_cuda(big.view())),
                  "gelu_backward", "argument 'dx'", "[5, 8]");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(gelu_backward(on_cuda(y.view()), on_cuda(x.view()), on_cuda(y.view())),
                    "gelu_backward", "CUDA");
  }
  TS_EXPECT_ERROR(silu_backward(y.view(), x.view(), x16.view()), "silu_backward", "argument 'dx'",
                  "float16");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(silu_backward(on_cuda(y.view()), on_cuda(x.view()), on_cuda(y.view())),
                    "silu_backward", "CUDA");
  }
}

TEST(Activation, GatedErrors) {
  auto a = HostTensor::random(DType::kBFloat16, {3, 6}),
       b = HostTensor::random(DType::kBFloat16, {3, 6});
  auto b32 = HostTensor::random(DType::kFloat32, {3, 6});
  HostTensor y(DType::kBFloat16, {3, 6}), other(DType::kBFloat16, {3, 6}),
      wide(DType::kBFloat16, {3, 7});
  const auto bad = static_cast<GeluApproximation>(-1);

  TS_EXPECT_ERROR(swiglu_forward(TensorView(), b.view(), y.view()), "swiglu_forward",
                  "argument 'a'");
  TS_EXPECT_ERROR(swiglu_forward(a.view(), b32.view(), y.view()), "swiglu_forward", "argument 'b'",
                  "bfloat16", "float32");
  TS_EXPECT_ERROR(swiglu_forward(a.view(), wide.view(), y.view()), "swiglu_forward", "argument 'b'",
                  "[3, 7]");
  TS_EXPECT_ERROR(swiglu_forward(a.view(), b.view(), wide.view()), "swiglu_forward", "argument 'y'",
                  "[3, 7]");
  TS_EXPECT_ERROR(swiglu_forward(a.view(), b.view(), shifted(a.view())), "swiglu_forward",
                  "argument 'y'", "disjoint from 'a'");
  TS_EXPECT_ERROR(swiglu_forward(a.view(), b.view(), shifted(b.view())), "swiglu_forward",
                  "argument 'y'", "disjoint from 'b'");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(swiglu_forward(on_cuda(a.view()), on_cuda(b.view()), on_cuda(y.view())),
                    "swiglu_forward", "CUDA");
  }
  TS_EXPECT_ERROR(geglu_forward(a.view(), b.view(), y.view(), bad), "geglu_forward",
                  "argument 'approx'", "-1");
  TS_EXPECT_ERROR(geglu_forward(a.view(), b.view(), TensorView()), "geglu_forward", "argument 'y'");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(geglu_forward(on_cuda(a.view()), on_cuda(b.view()), on_cuda(y.view())),
                    "geglu_forward", "CUDA");
  }

  TS_EXPECT_ERROR(swiglu_backward(y.view(), a.view(), TensorView(), other.view(), b.view()),
                  "swiglu_backward", "argument 'b'");
  TS_EXPECT_ERROR(swiglu_backward(wide.view(), a.view(), b.view(), other.view(), y.view()),
                  "swiglu_backward", "argument 'dy'", "[3, 7]");
  TS_EXPECT_ERROR(swiglu_backward(y.view(), a.view(), b.view(), TensorView(), other.view()),
                  "swiglu_backward", "argument 'da'");
  TS_EXPECT_ERROR(swiglu_backward(y.view(), a.view(), b.view(), other.view(), b32.view()),
                  "swiglu_backward", "argument 'db'", "float32");
  TS_EXPECT_ERROR(swiglu_backward(y.view(), a.view(), b.view(), shifted(y.view()), other.view()),
                  "swiglu_backward", "argument 'da'", "disjoint from 'dy'");
  TS_EXPECT_ERROR(swiglu_backward(y.view(), a.view(), b.view(), other.view(), shifted(a.view())),
                  "swiglu_backward", "argument 'db'", "disjoint from 'a'");
  TS_EXPECT_ERROR(swiglu_backward(y.view(), a.view(), b.view(), other.view(), shifted(b.view())),
                  "swiglu_backward", "argument 'db'", "disjoint from 'b'");
  TS_EXPECT_ERROR(swiglu_backward(y.view(), a.view(), b.view(), other.view(), other.view()),
                  "swiglu_backward", "argument 'da'", "disjoint from 'db'");
  TS_EXPECT_ERROR(swiglu_backward(on_cuda(y.view()), on_cuda(a.view()), on_cuda(b.view()),
                                  on_cuda(other.view()), on_cuda(wide.view())),
                  "swiglu_backward", "argument 'db'");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(swiglu_backward(on_cuda(y.view()), on_cuda(a.view()), on_cuda(b.view()),
                                    on_cuda(a.view()), on_cuda(b.view())),
                    "swiglu_backward", "CUDA");
  }
  TS_EXPECT_ERROR(geglu_backward(y.view(), a.view(), b.view(), a.view(), b.view(), bad),
                  "geglu_backward", "argument 'approx'");
  TS_EXPECT_ERROR(geglu_backward(y.view(), a.view(), b.view(), other.view(), other.view()),
                  "geglu_backward", "argument 'da'", "disjoint from 'db'");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(geglu_backward(on_cuda(y.view()), on_cuda(a.view()), on_cuda(b.view()),
                                   on_cuda(a.view()), on_cuda(b.view())),
                    "geglu_backward", "CUDA");
  }
}

TEST(Activation, PackedErrors) {
  auto ab = HostTensor::random(DType::kFloat16, {3, 10}),
       odd = HostTensor::random(DType::kFloat16, {3, 9});
  auto ab32 = HostTensor::random(DType::kFloat32, {3, 10});
  HostTensor y(DType::kFloat16, {3, 5}), y32(DType::kFloat32, {3, 5}),
      y_wide(DType::kFloat16, {3, 10});
  HostTensor dab(DType::kFloat16, {3, 10}), dab_narrow(DType::kFloat16, {3, 8});
  const TensorView packed_row_major(ab.data(), DType::kFloat16, {3, 10}, {10, 3});
  const auto bad = static_cast<GeluApproximation>(3);
  // y living inside ab's storage (the a half of ab's first row and beyond).
  const TensorView y_in_ab(ab.data(), DType::kFloat16, {3, 5}, {10, 1});

  TS_EXPECT_ERROR(swiglu_forward_packed(TensorView(), y.view()), "swiglu_forward_packed",
                  "argument 'ab'", "none");
  TS_EXPECT_ERROR(swiglu_forward_packed(odd.view(), y.view()), "swiglu_forward_packed",
                  "argument 'ab'", "even last dim", "[3, 9]");
  TS_EXPECT_ERROR(swiglu_forward_packed(packed_row_major, y.view()), "swiglu_forward_packed",
                  "argument 'ab'", "stride 1");
  TS_EXPECT_ERROR(swiglu_forward_packed(ab.view(), y32.view()), "swiglu_forward_packed",
                  "argument 'y'", "float16", "float32");
  TS_EXPECT_ERROR(swiglu_forward_packed(ab.view(), y_wide.view()), "swiglu_forward_packed",
                  "argument 'y'", "shape [3, 5]", "last dim halved", "[3, 10]");
  TS_EXPECT_ERROR(swiglu_forward_packed(ab.view(), y_in_ab), "swiglu_forward_packed",
                  "argument 'y'", "disjoint from 'ab'");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(swiglu_forward_packed(on_cuda(ab.view()), on_cuda(y.view())),
                    "swiglu_forward_packed", "CUDA");
  }
  TS_EXPECT_ERROR(geglu_forward_packed(ab.view(), y.view(), bad), "geglu_forward_packed",
                  "argument 'approx'");
  TS_EXPECT_ERROR(geglu_forward_packed(ab32.view(), y.view()), "geglu_forward_packed",
                  "argument 'y'", "float32");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(geglu_forward_packed(on_cuda(ab.view()), on_cuda(y.view())),
                    "geglu_forward_packed", "CUDA");
  }

  TS_EXPECT_ERROR(swiglu_backward_packed(y.view(), odd.view(), dab.view()),
                  "swiglu_backward_packed", "argument 'ab'", "even");
  TS_EXPECT_ERROR(swiglu_backward_packed(y_wide.view(), ab.view(), dab.view()),
                  "swiglu_backward_packed", "argument 'dy'", "last dim halved");
  TS_EXPECT_ERROR(swiglu_backward_packed(y.view(), ab.view(), dab_narrow.view()),
                  "swiglu_backward_packed", "argument 'dab'", "[3, 10]", "[3, 8]");
  TS_EXPECT_ERROR(swiglu_backward_packed(y.view(), ab.view(), shifted(ab.view())),
                  "swiglu_backward_packed", "argument 'dab'", "disjoint from 'ab'");
  TS_EXPECT_ERROR(swiglu_backward_packed(y_in_ab, ab32.view(), ab.view()), "swiglu_backward_packed",
                  "argument 'dy'", "float32");
  const TensorView dy_in_dab(dab.data(), DType::kFloat16, {3, 5}, {10, 1});
  TS_EXPECT_ERROR(swiglu_backward_packed(dy_in_dab, ab.view(), dab.view()),
                  "swiglu_backward_packed", "argument 'dab'", "disjoint from 'dy'");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(swiglu_backward_packed(on_cuda(y.view()), on_cuda(ab.view()), on_cuda(ab.view())),
                    "swiglu_backward_packed", "CUDA");
  }
  TS_EXPECT_ERROR(geglu_backward_packed(y.view(), ab.view(), dab.view(), bad),
                  "geglu_backward_packed", "argument 'approx'");
  TS_EXPECT_ERROR(geglu_backward_packed(y.view(), ab.view(), TensorView()), "geglu_backward_packed",
                  "argument 'dab'");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(geglu_backward_packed(on_cuda(y.view()), on_cuda(ab.view()), on_cuda(ab.view())),
                    "geglu_backward_packed", "CUDA");
  }
}

}  // namespace
}  // namespace trainscale
