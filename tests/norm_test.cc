#include <cmath>
#include <cstring>
#include <numeric>

#include "trainscale/norm.h"
#include "util/gpu_util.h"

namespace trainscale {
namespace {

using test::HostTensor;

constexpr DType kFloatTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16,
                                 DType::kFloat64};
constexpr DType kLowPrecisionTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
constexpr std::int64_t kRowLengths[] = {1, 7, 127, 1000};

// Saved statistics: float32, or float64 beside float64 activations (full precision for
// finite differences).
DType stat_dtype(DType activation) {
  return activation == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
}

// A tensor of `shape` (rows padded by `row_pad`) holding `values` rounded to `dtype`.
HostTensor make(DType dtype, std::vector<std::int64_t> shape, const std::vector<double>& values,
                std::int64_t row_pad = 0) {
  HostTensor t(dtype, std::move(shape), row_pad);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.set(i, values.at(i));
  return t;
}

// The same values in float64 (an absent tensor stays absent).
HostTensor to_float64(const HostTensor& t) {
  if (!t.view().defined()) return {};
  return make(DType::kFloat64, t.shape(), t.values());
}

TensorView on_cuda(TensorView v) {
  v.device = Device::cuda(0);
  return v;
}

bool bitwise_equal(const HostTensor& a, const HostTensor& b) {
  return a.storage_bytes() == b.storage_bytes() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.storage_bytes())) == 0;
}

// Independent forward computations over row-major values of M x N; an empty w means ones,
// an empty b zeros.
std::vector<double> expected_rmsnorm(const std::vector<double>& x, std::int64_t n,
                                     const std::vector<double>& w, double eps, double offset,
                                     std::vector<double>* rstd = nullptr) {
  std::vector<double> y(x.size());
  for (std::size_t row = 0; row * n < x.size(); ++row) {
    const auto begin = x.begin() + static_cast<std::ptrdiff_t>(row * n);
    const double mean_sq = std::inner_product(begin, begin + n, begin, 0.0) / n;
    const double r = 1.0 / std::sqrt(mean_sq + eps);
    if (rstd) rstd->push_back(r);
    for (std::int64_t j = 0; j < n; ++j) {
      y[row * n + j] = begin[j] * r * ((w.empty() ? 1.0 : w[j]) + offset);
    }
  }
  return y;
}

std::vector<double> expected_layernorm(const std::vector<double>& x, std::int64_t n,
                                       const std::vector<double>& w, const std::vector<double>& b,
                                       double eps, std::vector<double>* mean = nullptr,
                                       std::vector<double>* rstd = nullptr) {
  std::vector<double> y(x.size());
  for (std::size_t row = 0; row * n < x.size(); ++row) {
    const auto begin = x.begin() + static_cast<std::ptrdiff_t>(row * n);
    const double mu = std::accumulate(begin, begin + n, 0.0) / n;
    double var = 0;
    for (std::int64_t j = 0; j < n; ++j) var += (begin[j] - mu) * (begin[j] - mu) / n;
    const double r = 1.0 / std::sqrt(var + eps);
    if (mean) mean->push_back(mu);
    if (rstd) rstd->push_back(r);
    for (std::int64_t j = 0; j < n; ++j) {
      y[row * n + j] = (begin[j] - mu) * r * (w.empty() ? 1.0 : w[j]) + (b.empty() ? 0.0 : b[j]);
    }
  }
  return y;
}

// ---------------------------------------------------------------------------------------
// Forward passes

TEST(RMSNorm, ForwardMatchesClosedFormEveryDtypeAndRowLength) {
  for (DType dt : kFloatTypes) {
    for (std::int64_t n : kRowLengths) {
      for (DType weight_dt : {DType::kFloat32, dt}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " N=" + std::to_string(n) + " weight " +
                     dtype_name(weight_dt));
        const std::vector<std::int64_t> shape{2, 3, n};
        auto x = HostTensor::random(dt, shape, -2, 2, /*row_pad=*/3);
        auto w = HostTensor::random(weight_dt, {n}, -1.5, 1.5);
        HostTensor y(dt, shape, /*row_pad=*/5), rstd(stat_dtype(dt), {2, 3});
        const RMSNormOptions options{.eps = 1e-5, .weight_offset = 0.0};
        rmsnorm_forward(x.view(), w.view(), y.view(), rstd.view(), options);
        std::vector<double> rstd_ref;
        const auto y_ref =
            expected_rmsnorm(x.values(), n, w.values(), options.eps, 0.0, &rstd_ref);
        EXPECT_TRUE(test::matches_reference(y.values(), y_ref, test::tolerance(dt)));
        EXPECT_TRUE(test::matches_reference(rstd.values(), rstd_ref,
                                            test::tolerance(stat_dtype(dt))));
      }
    }
  }
}

TEST(RMSNorm, OutputWithoutWeightHasUnitRms) {
  const std::int64_t n = 256;
  auto x = HostTensor::random(DType::kFloat64, {4, n}, -1, 1);
  HostTensor y(DType::kFloat64, {4, n});
  for (double eps : {1e-6, 0.1}) {
    rmsnorm_forward(x.view(), TensorView{}, y.view(), TensorView{}, {.eps = eps});
    const auto xv = x.values(), yv = y.values();
    for (std::int64_t row = 0; row < 4; ++row) {
      double x_sq = 0, y_sq = 0;
      for (std::int64_t j = 0; j < n; ++j) {
        x_sq += xv[row * n + j] * xv[row * n + j] / n;
        y_sq += yv[row * n + j] * yv[row * n + j] / n;
      }
      // mean(y^2) = mean(x^2) / (mean(x^2) + eps): 1 up to eps.
      EXPECT_NEAR(y_sq, x_sq / (x_sq + eps), 1e-13);
      if (eps < 1e-5) {
        EXPECT_NEAR(std::sqrt(y_sq), 1.0, 1e-5);
      }
    }
  }
}

TEST(RMSNorm, WeightScalesEachColumnAndGemmaOffsetAddsToIt) {
  const std::int64_t n = 33;
  auto x = HostTensor::random(DType::kFloat64, {5, n}, -3, 3);
  auto w = HostTensor::random(DType::kFloat64, {n}, -2, 2);
  HostTensor plain(DType::kFloat64, {5, n}), scaled(DType::kFloat64, {5, n});
  rmsnorm_forward(x.view(), TensorView{}, plain.view(), TensorView{});
  rmsnorm_forward(x.view(), w.view(), scaled.view(), TensorView{});
  std::vector<double> expected = plain.values(), w_plus_one = w.values();
  for (std::int64_t i = 0; i < 5 * n; ++i) expected[i] *= w.at(i % n);
  EXPECT_TRUE(test::matches_reference(scaled.values(), expected, 1e-14));

  // Gemma: (w + 1) with offset 1 equals a weight of w + 1 without offset.
  for (double& v : w_plus_one) v += 1.0;
  auto shifted_weight = make(DType::kFloat64, {n}, w_plus_one);
  HostTensor gemma(DType::kFloat64, {5, n}), shifted(DType::kFloat64, {5, n});
  const RMSNormOptions gemma_options{.eps = 1e-6, .weight_offset = 1.0};
  rmsnorm_forward(x.view(), w.view(), gemma.view(), TensorView{}, gemma_options);
  rmsnorm_forward(x.view(), shifted_weight.view(), shifted.view(), TensorView{});
  EXPECT_TRUE(test::matches_reference(gemma.values(), shifted.values(), 1e-14));

  // The offset is added to the implicit all-ones weight too: y doubles.
  rmsnorm_forward(x.view(), TensorView{}, gemma.view(), TensorView{}, gemma_options);
  expected = plain.values();
  for (double& v : expected) v *= 2.0;
  EXPECT_TRUE(test::matches_reference(gemma.values(), expected, 1e-14));
}

TEST(LayerNorm, ForwardMatchesClosedFormEveryDtypeAndRowLength) {
  for (DType dt : kFloatTypes) {
    for (std::int64_t n : kRowLengths) {
      for (DType param_dt : {DType::kFloat32, dt}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " N=" + std::to_string(n) + " params " +
                     dtype_name(param_dt));
        const std::vector<std::int64_t> shape{3, 2, n};
        // Off-center inputs, so mean subtraction matters.
        auto x = HostTensor::random(dt, shape, -1, 3, /*row_pad=*/2);
        auto w = HostTensor::random(param_dt, {n}, -1.5, 1.5);
        auto b = HostTensor::random(param_dt, {n}, -1, 1);
        HostTensor y(dt, shape, /*row_pad=*/1), mean(stat_dtype(dt), {6}),
            rstd(stat_dtype(dt), {3, 2});
        layernorm_forward(x.view(), w.view(), b.view(), y.view(), mean.view(), rstd.view());
        std::vector<double> mean_ref, rstd_ref;
        const auto y_ref = expected_layernorm(x.values(), n, w.values(), b.values(),
                                              LayerNormOptions{}.eps, &mean_ref, &rstd_ref);
        EXPECT_TRUE(test::matches_reference(y.values(), y_ref, test::tolerance(dt)));
        EXPECT_TRUE(test::matches_reference(mean.values(), mean_ref,
                                            test::tolerance(stat_dtype(dt))));
        EXPECT_TRUE(test::matches_reference(rstd.values(), rstd_ref,
                                            test::tolerance(stat_dtype(dt))));
      }
    }
  }
}

TEST(LayerNorm, OutputWithoutParametersHasZeroMeanAndUnitVariance) {
  const std::int64_t n = 300;
  auto x = HostTensor::random(DType::kFloat64, {4, n}, 2, 5);
  HostTensor y(DType::kFloat64, {4, n});
  layernorm_forward(x.view(), TensorView{}, TensorView{}, y.view(), TensorView{}, TensorView{},
                    {.eps = 0.0});
  const auto yv = y.values();
  for (std::int64_t row = 0; row < 4; ++row) {
    double mean = 0, var = 0;
    for (std::int64_t j = 0; j < n; ++j) mean += yv[row * n + j] / n;
    for (std::int64_t j = 0; j < n; ++j) {
      var += (yv[row * n + j] - mean) * (yv[row * n + j] - mean) / n;
    }
    EXPECT_NEAR(mean, 0.0, 1e-13);
    EXPECT_NEAR(var, 1.0, 1e-12);
  }
}

TEST(LayerNorm, SingleElementRowsHaveZeroVariance) {
  auto x = HostTensor::random(DType::kFloat32, {6, 1}, -4, 4);
  auto w = HostTensor::random(DType::kFloat32, {1}, 0.5, 2);
  auto b = HostTensor::random(DType::kFloat32, {1}, -1, 1);
  HostTensor y(DType::kFloat32, {6, 1}), mean(DType::kFloat32, {6}), rstd(DType::kFloat32, {6});
  const LayerNormOptions options{.eps = 1e-4};
  layernorm_forward(x.view(), w.view(), b.view(), y.view(), mean.view(), rstd.view(), options);
  for (std::int64_t i = 0; i < 6; ++i) {
    EXPECT_EQ(mean.at(i), x.at(i));
    EXPECT_EQ(rstd.at(i), static_cast<float>(1.0 / std::sqrt(options.eps)));
    EXPECT_EQ(y.at(i), b.at(0));  // (x - mean) = 0, so only the bias remains
  }
}

TEST(FusedAddRMSNorm, EqualsAddThenRMSNormAndUpdatesResidual) {
  const std::pair<DType, DType> dtype_pairs[] = {{DType::kBFloat16, DType::kBFloat16},
                                                 {DType::kBFloat16, DType::kFloat32},
                                                 {DType::kFloat16, DType::kFloat32},
                                                 {DType::kFloat32, DType::kFloat32},
                                                 {DType::kFloat64, DType::kFloat64}};
  for (auto [x_dt, residual_dt] : dtype_pairs) {
    for (std::int64_t n : {1, 7, 127}) {
      SCOPED_TRACE(std::string(dtype_name(x_dt)) + " + " + dtype_name(residual_dt) +
                   " N=" + std::to_string(n));
      const std::vector<std::int64_t> shape{5, n};
      auto x = HostTensor::random(x_dt, shape, -2, 2, /*row_pad=*/1);
      auto residual = HostTensor::random(residual_dt, shape, -2, 2, /*row_pad=*/4);
      auto w = HostTensor::random(DType::kFloat32, {n}, -1, 1);
      const RMSNormOptions options{.eps = 1e-5, .weight_offset = 1.0};

      // Separately: the sum stored in the residual's dtype, then rmsnorm (in float64, exact
      // on those values) rounded once to x's dtype.
      HostTensor sum(residual_dt, shape), y64(DType::kFloat64, shape), rstd64(DType::kFloat64, {5});
      for (std::int64_t i = 0; i < sum.numel(); ++i) sum.set(i, x.at(i) + residual.at(i));
      rmsnorm_forward(to_float64(sum).view(), w.view(), y64.view(), rstd64.view(), options);
      const auto y = make(x_dt, shape, y64.values());
      const auto rstd = make(stat_dtype(x_dt), {5}, rstd64.values());

      HostTensor fused_rstd(stat_dtype(x_dt), {5});
      fused_add_rmsnorm_forward(x.view(), residual.view(), w.view(), fused_rstd.view(), options);
      EXPECT_EQ(residual.values(), sum.values());
      EXPECT_EQ(x.values(), y.values());
      EXPECT_TRUE(bitwise_equal(fused_rstd, rstd));
    }
  }
}

TEST(FusedAddRMSNorm, OutOfPlaceMatchesInPlaceAndKeepsItsInputs) {
  for (auto [x_dt, residual_dt] : {std::pair{DType::kBFloat16, DType::kBFloat16},
                                   std::pair{DType::kFloat16, DType::kFloat32},
                                   std::pair{DType::kFloat32, DType::kFloat32}}) {
    SCOPED_TRACE(std::string(dtype_name(x_dt)) + " + " + dtype_name(residual_dt));
    const std::vector<std::int64_t> shape{6, 37};
    const auto x = HostTensor::random(x_dt, shape, -2, 2, /*row_pad=*/3);
    const auto residual = HostTensor::random(residual_dt, shape, -2, 2);
    const auto w = HostTensor::random(x_dt, {37}, 0.5, 1.5);
    const RMSNormOptions options{.eps = 1e-5, .weight_offset = 0.5};
    HostTensor y(x_dt, shape), sum(residual_dt, shape, /*row_pad=*/5), rstd(stat_dtype(x_dt), {6});
    for (HostTensor* out : {&y, &sum, &rstd}) {
      for (std::int64_t i = 0; i < out->numel(); ++i) out->set(i, NAN);
    }
    const auto x_before = x.values(), residual_before = residual.values();
    fused_add_rmsnorm_forward(x.view(), residual.view(), w.view(), y.view(), sum.view(), rstd.view(),
                              options);
    EXPECT_EQ(x.values(), x_before);
    EXPECT_EQ(residual.values(), residual_before);

    auto x_in_place = x, residual_in_place = residual;
    HostTensor rstd_in_place(stat_dtype(x_dt), {6});
    fused_add_rmsnorm_forward(x_in_place.view(), residual_in_place.view(), w.view(),
                              rstd_in_place.view(), options);
    EXPECT_EQ(y.values(), x_in_place.values());
    EXPECT_EQ(sum.values(), residual_in_place.values());
    EXPECT_TRUE(bitwise_equal(rstd, rstd_in_place));
  }
}

// ---------------------------------------------------------------------------------------
// Backward passes: float64 against central finite differences of loss = sum(g * y).

constexpr double kGradTolerance = 1e-7;

TEST(RMSNorm, BackwardMatchesFiniteDifferences) {
  const std::vector<std::int64_t> shape{3, 7};
  for (bool with_weight : {true, false}) {
    for (double offset : {0.0, 1.0}) {
      SCOPED_TRACE(std::string(with_weight ? "weight" : "no weight") + " offset " +
                   std::to_string(offset));
      const RMSNormOptions options{.eps = 1e-3, .weight_offset = offset};
      auto x = HostTensor::random(DType::kFloat64, shape, -2, 2, /*row_pad=*/2);
      const HostTensor w =
          with_weight ? HostTensor::random(DType::kFloat64, {7}, -1.5, 1.5) : HostTensor{};
      const auto g = test::random_values(x.numel());
      auto loss = [&](const std::vector<double>& xv, const std::vector<double>& wv) {
        auto xt = make(DType::kFloat64, shape, xv);
        const HostTensor wt = with_weight ? make(DType::kFloat64, {7}, wv) : HostTensor{};
        HostTensor y(DType::kFloat64, shape);
        rmsnorm_forward(xt.view(), wt.view(), y.view(), TensorView{}, options);
        return test::dot(g, y.values());
      };
      HostTensor y(DType::kFloat64, shape), rstd(DType::kFloat64, {3});
      rmsnorm_forward(x.view(), w.view(), y.view(), rstd.view(), options);
      auto dy = make(DType::kFloat64, shape, g, /*row_pad=*/1);
      HostTensor dx(DType::kFloat64, shape, /*row_pad=*/3);
      HostTensor dw = with_weight ? HostTensor(DType::kFloat64, {7}) : HostTensor{};
      rmsnorm_backward(dy.view(), x.view(), w.view(), rstd.view(), dx.view(), dw.view(),
                       TensorView{}, options);
      const auto xv = x.values(), wv = w.values();
      EXPECT_TRUE(test::matches_reference(
          dx.values(),
          test::numeric_gradient(xv, [&](const auto& v) { return loss(v, wv); }),
          kGradTolerance));
      if (with_weight) {
        EXPECT_TRUE(test::matches_reference(
            dw.values(),
            test::numeric_gradient(wv, [&](const auto& v) { return loss(xv, v); }),
            kGradTolerance));
      }
    }
  }
}

TEST(FusedAddRMSNorm, BackwardMatchesFiniteDifferences) {
  const std::vector<std::int64_t> shape{4, 7};
  for (bool with_residual_grad : {true, false}) {
    SCOPED_TRACE(with_residual_grad ? "with d_residual" : "without d_residual");
    const RMSNormOptions options{.eps = 1e-3, .weight_offset = 0.5};
    auto x = HostTensor::random(DType::kFloat64, shape, -2, 2);
    auto residual = HostTensor::random(DType::kFloat64, shape, -2, 2, /*row_pad=*/1);
    auto w = HostTensor::random(DType::kFloat64, {7}, -1.5, 1.5);
    const auto g = test::random_values(x.numel());
    const auto g_residual =
        with_residual_grad ? test::random_values(x.numel()) : std::vector<double>(x.numel(), 0.0);
    // loss = sum(g * normalized) + sum(g_residual * residual_out), both outputs of the op.
    auto loss = [&](const std::vector<double>& xv, const std::vector<double>& rv,
                    const std::vector<double>& wv) {
      auto xt = make(DType::kFloat64, shape, xv), rt = make(DType::kFloat64, shape, rv);
      auto wt = make(DType::kFloat64, {7}, wv);
      fused_add_rmsnorm_forward(xt.view(), rt.view(), wt.view(), TensorView{}, options);
      return test::dot(g, xt.values()) + test::dot(g_residual, rt.values());
    };
    const auto xv = x.values(), rv = residual.values(), wv = w.values();
    HostTensor rstd(DType::kFloat64, {4});
    fused_add_rmsnorm_forward(x.view(), residual.view(), w.view(), rstd.view(), options);
    auto dy = make(DType::kFloat64, shape, g, /*row_pad=*/2);
    const HostTensor d_residual =
        with_residual_grad ? make(DType::kFloat64, shape, g_residual) : HostTensor{};
    HostTensor dx(DType::kFloat64, shape, /*row_pad=*/1), dw(DType::kFloat64, {7});
    fused_add_rmsnorm_backward(dy.view(), d_residual.view(), residual.view(), w.view(),
                               rstd.view(), dx.view(), dw.view(), TensorView{}, options);
    // Both inputs get the same gradient.
    EXPECT_TRUE(test::matches_reference(
        dx.values(),
        test::numeric_gradient(xv, [&](const auto& v) { return loss(v, rv, wv); }),
        kGradTolerance));
    EXPECT_TRUE(test::matches_reference(
        dx.values(),
        test::numeric_gradient(rv, [&](const auto& v) { return loss(xv, v, wv); }),
        kGradTolerance));
    EXPECT_TRUE(test::matches_reference(
        dw.values(),
        test::numeric_gradient(wv, [&](const auto& v) { return loss(xv, rv, v); }),
        kGradTolerance));
  }
}

TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  const std::vector<std::int64_t> shape{2, 3, 7};
  for (bool with_params : {true, false}) {
    SCOPED_TRACE(with_params ? "weight and bias" : "no parameters");
    const LayerNormOptions options{.eps = 1e-3};
    auto x = HostTensor::random(DType::kFloat64, shape, -1, 3, /*row_pad=*/2);
    const HostTensor w =
        with_params ? HostTensor::random(DType::kFloat64, {7}, -1.5, 1.5) : HostTensor{};
    const HostTensor b =
        with_params ? HostTensor::random(DType::kFloat64, {7}, -1, 1) : HostTensor{};
    const auto g = test::random_values(x.numel());
    auto loss = [&](const std::vector<double>& xv, const std::vector<double>& wv,
                    const std::vector<double>& bv) {
      auto xt = make(DType::kFloat64, shape, xv);
      const HostTensor wt = with_params ? make(DType::kFloat64, {7}, wv) : HostTensor{};
      const HostTensor bt = with_params ? make(DType::kFloat64, {7}, bv) : HostTensor{};
      HostTensor y(DType::kFloat64, shape);
      layernorm_forward(xt.view(), wt.view(), bt.view(), y.view(), TensorView{}, TensorView{},
                        options);
      return test::dot(g, y.values());
    };
    HostTensor y(DType::kFloat64, shape), mean(DType::kFloat64, {6}), rstd(DType::kFloat64, {6});
    layernorm_forward(x.view(), w.view(), b.view(), y.view(), mean.view(), rstd.view(), options);
    auto dy = make(DType::kFloat64, shape, g, /*row_pad=*/1);
    HostTensor dx(DType::kFloat64, shape, /*row_pad=*/4);
    HostTensor dw = with_params ? HostTensor(DType::kFloat64, {7}) : HostTensor{};
    HostTensor db = with_params ? HostTensor(DType::kFloat64, {7}) : HostTensor{};
    layernorm_backward({.dy = dy.view(), .x = x.view(), .weight = w.view(), .mean = mean.view(),
                        .rstd = rstd.view(), .dx = dx.view(), .dw = dw.view(), .db = db.view()},
                       options);
    const auto xv = x.values(), wv = w.values(), bv = b.values();
    EXPECT_TRUE(test::matches_reference(
        dx.values(),
        test::numeric_gradient(xv, [&](const auto& v) { return loss(v, wv, bv); }),
        kGradTolerance));
    if (with_params) {
      EXPECT_TRUE(test::matches_reference(
          dw.values(),
          test::numeric_gradient(wv, [&](const auto& v) { return loss(xv, v, bv); }),
          kGradTolerance));
      EXPECT_TRUE(test::matches_reference(
          db.values(),
          test::numeric_gradient(bv, [&](const auto& v) { return loss(xv, wv, v); }),
          kGradTolerance));
    }
  }
}

// Low-precision backward passes against the (finite-difference checked) float64 one on the
// same stored values: the dtype handling of every operand, parameters in float32 or x's dtype.
TEST(NormBackward, EveryDtypeMatchesFloat64OnTheSameValues) {
  for (DType dt : kLowPrecisionTypes) {
    for (DType param_dt : {DType::kFloat32, dt}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " params " + dtype_name(param_dt));
      const std::int64_t n = 127;
      const std::vector<std::int64_t> shape{9, n};
      auto x = HostTensor::random(dt, shape, -2, 2, /*row_pad=*/1);
      auto dy = HostTensor::random(dt, shape, -1, 1);
      auto d_residual = HostTensor::random(dt, shape, -1, 1);
      auto w = HostTensor::random(param_dt, {n}, -1.5, 1.5);
      HostTensor y(dt, shape), mean(DType::kFloat32, {9}), rstd(DType::kFloat32, {9});
      const auto x64 = to_float64(x), dy64 = to_float64(dy), w64 = to_float64(w);
      const auto d_residual64 = to_float64(d_residual);
      auto check = [&](const HostTensor& dx, const HostTensor& dx64, const HostTensor& dw,
                       const HostTensor& dw64) {
        EXPECT_TRUE(test::matches_reference(dx.values(), dx64.values(), test::tolerance(dt)));
        EXPECT_TRUE(
            test::matches_reference(dw.values(), dw64.values(), test::tolerance(param_dt)));
      };
      HostTensor dx(dt, shape, /*row_pad=*/2), dw(param_dt, {n}), db(param_dt, {n});
      HostTensor dx64(DType::kFloat64, shape), dw64(DType::kFloat64, {n}),
          db64(DType::kFloat64, {n});

      const RMSNormOptions rms_options{.eps = 1e-6, .weight_offset = 0.25};
      rmsnorm_forward(x.view(), w.view(), y.view(), rstd.view(), rms_options);
      const auto rstd64 = to_float64(rstd);
      rmsnorm_backward(dy.view(), x.view(), w.view(), rstd.view(), dx.view(), dw.view(),
                       TensorView{}, rms_options);
      rmsnorm_backward(dy64.view(), x64.view(), w64.view(), rstd64.view(), dx64.view(),
                       dw64.view(), TensorView{}, rms_options);
      check(dx, dx64, dw, dw64);

      fused_add_rmsnorm_backward(dy.view(), d_residual.view(), x.view(), w.view(), rstd.view(),
                                 dx.view(), dw.view(), TensorView{}, rms_options);
      fused_add_rmsnorm_backward(dy64.view(), d_residual64.view(), x64.view(), w64.view(),
                                 rstd64.view(), dx64.view(), dw64.view(), TensorView{},
                                 rms_options);
      check(dx, dx64, dw, dw64);

      layernorm_forward(x.view(), w.view(), TensorView{}, y.view(), mean.view(), rstd.view());
      const auto mean64 = to_float64(mean), ln_rstd64 = to_float64(rstd);
      layernorm_backward({.dy = dy.view(), .x = x.view(), .weight = w.view(), .mean = mean.view(),
                          .rstd = rstd.view(), .dx = dx.view(), .dw = dw.view(), .db = db.view()});
      layernorm_backward({.dy = dy64.view(), .x = x64.view(), .weight = w64.view(),
                          .mean = mean64.view(), .rstd = ln_rstd64.view(), .dx = dx64.view(),
                          .dw = dw64.view(), .db = db64.view()});
      check(dx, dx64, dw, dw64);
      EXPECT_TRUE(test::matches_reference(db.values(), db64.values(), test::tolerance(param_dt)));
    }
  }
}

TEST(NormBackward, Float32WeightWithBFloat16Activations) {
  const std::int64_t n = 64;
  auto x = HostTensor::random(DType::kBFloat16, {8, n}, -2, 2);
  auto dy = HostTensor::random(DType::kBFloat16, {8, n}, -1, 1);
  // Values that bfloat16 cannot hold, so a weight narrowed on the way would show.
  auto w = HostTensor::random(DType::kFloat32, {n}, 0.9, 1.1);
  HostTensor y(DType::kBFloat16, {8, n}), rstd(DType::kFloat32, {8});
  rmsnorm_forward(x.view(), w.view(), y.view(), rstd.view());
  std::vector<double> rstd_ref;
  const auto y_ref = expected_rmsnorm(x.values(), n, w.values(), 1e-6, 0.0, &rstd_ref);
  EXPECT_TRUE(test::matches_reference(y.values(), y_ref, test::tolerance(DType::kBFloat16)));

  HostTensor dx(DType::kBFloat16, {8, n}), dw(DType::kFloat32, {n});
  rmsnorm_backward(dy.view(), x.view(), w.view(), rstd.view(), dx.view(), dw.view(), TensorView{});
  // dw_j = sum_rows dy * x * rstd, accumulated in double and rounded once to float32.
  std::vector<double> dw_ref(n, 0.0);
  for (std::int64_t i = 0; i < 8; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      dw_ref[j] += dy.at(i * n + j) * x.at(i * n + j) * rstd.at(i);
    }
  }
  EXPECT_TRUE(test::matches_reference(dw.values(), dw_ref, test::tolerance(DType::kFloat32)));
}

TEST(NormBackward, InPlaceEqualsOutOfPlace) {
  const std::vector<std::int64_t> shape{6, 31};
  auto x = HostTensor::random(DType::kFloat32, shape, -2, 2, /*row_pad=*/3);
  auto w = HostTensor::random(DType::kFloat32, {31}, -1, 1);
  const auto dy = HostTensor::random(DType::kFloat32, shape, -1, 1, /*row_pad=*/2);
  auto d_residual = HostTensor::random(DType::kFloat32, shape, -1, 1);
  HostTensor y(DType::kFloat32, shape), mean(DType::kFloat32, {6}), rstd(DType::kFloat32, {6});
  HostTensor dx(DType::kFloat32, shape, /*row_pad=*/2), dw(DType::kFloat32, {31}),
      db(DType::kFloat32, {31});

  rmsnorm_forward(x.view(), w.view(), y.view(), rstd.view());
  HostTensor in_place = dy;
  rmsnorm_backward(dy.view(), x.view(), w.view(), rstd.view(), dx.view(), dw.view(), TensorView{});
  rmsnorm_backward(in_place.view(), x.view(), w.view(), rstd.view(), in_place.view(), dw.view(),
                   TensorView{});
  EXPECT_TRUE(bitwise_equal(in_place, dx));

  in_place = dy;
  fused_add_rmsnorm_backward(dy.view(), d_residual.view(), x.view(), w.view(), rstd.view(),
                             dx.view(), dw.view(), TensorView{});
  fused_add_rmsnorm_backward(in_place.view(), d_residual.view(), x.view(), w.view(), rstd.view(),
                             in_place.view(), dw.view(), TensorView{});
  EXPECT_TRUE(bitwise_equal(in_place, dx));

  in_place = dy;
  layernorm_forward(x.view(), w.view(), TensorView{}, y.view(), mean.view(), rstd.view());
  layernorm_backward({.dy = dy.view(), .x = x.view(), .weight = w.view(), .mean = mean.view(),
                      .rstd = rstd.view(), .dx = dx.view(), .dw = dw.view(), .db = db.view()});
  layernorm_backward({.dy = in_place.view(), .x = x.view(), .weight = w.view(),
                      .mean = mean.view(), .rstd = rstd.view(), .dx = in_place.view(),
                      .dw = dw.view(), .db = db.view()});
  EXPECT_TRUE(bitwise_equal(in_place, dx));
}

TEST(NormBackward, ParameterGradientsAreBitwiseReproducible) {
  // Enough rows for several reduction chunks on several threads.
  const std::vector<std::int64_t> shape{5003, 24};
  auto x = HostTensor::random(DType::kFloat32, shape, -2, 2);
  auto dy = HostTensor::random(DType::kFloat32, shape, -1, 1);
  auto w = HostTensor::random(DType::kFloat32, {24}, -1, 1);
  HostTensor y(DType::kFloat32, shape), dx(DType::kFloat32, shape);
  HostTensor mean(DType::kFloat32, {5003}), rstd(DType::kFloat32, {5003});
  HostTensor dw1(DType::kFloat32, {24}), dw2(DType::kFloat32, {24});
  HostTensor db1(DType::kFloat32, {24}), db2(DType::kFloat32, {24});

  rmsnorm_forward(x.view(), w.view(), y.view(), rstd.view());
  rmsnorm_backward(dy.view(), x.view(), w.view(), rstd.view(), dx.view(), dw1.view(), TensorView{});
  rmsnorm_backward(dy.view(), x.view(), w.view(), rstd.view(), dx.view(), dw2.view(), TensorView{});
  EXPECT_TRUE(bitwise_equal(dw1, dw2));
  // Every chunk counts: dw = sum over all rows of dy * x * rstd, db = sum of dy.
  std::vector<double> dw_ref(24, 0.0), db_ref(24, 0.0);
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    dw_ref[i % 24] += dy.at(i) * x.at(i) * rstd.at(i / 24);
    db_ref[i % 24] += dy.at(i);
  }
  EXPECT_TRUE(test::matches_reference(dw1.values(), dw_ref, test::tolerance(DType::kFloat32)));

  layernorm_forward(x.view(), w.view(), TensorView{}, y.view(), mean.view(), rstd.view());
  layernorm_backward({.dy = dy.view(), .x = x.view(), .weight = w.view(), .mean = mean.view(),
                      .rstd = rstd.view(), .dx = dx.view(), .dw = dw1.view(), .db = db1.view()});
  layernorm_backward({.dy = dy.view(), .x = x.view(), .weight = w.view(), .mean = mean.view(),
                      .rstd = rstd.view(), .dx = dx.view(), .dw = dw2.view(), .db = db2.view()});
  EXPECT_TRUE(bitwise_equal(dw1, dw2));
  EXPECT_TRUE(bitwise_equal(db1, db2));
  EXPECT_TRUE(test::matches_reference(db1.values(), db_ref, test::tolerance(DType::kFloat32)));
}

// ---------------------------------------------------------------------------------------
// Edge cases

TEST(Norm, ZeroRowsWriteZeroParameterGradients) {
  const std::vector<std::int64_t> shape{0, 8};
  HostTensor x(DType::kFloat32, shape), y(DType::kFloat32, shape), dx(DType::kFloat32, shape);
  HostTensor residual(DType::kFloat32, shape), stat(DType::kFloat32, {0}),
      stat2(DType::kFloat32, {0});
  auto w = HostTensor::random(DType::kFloat32, {8});
  HostTensor dw(DType::kFloat32, {8}), db(DType::kFloat32, {8});
  rmsnorm_forward(x.view(), w.view(), y.view(), stat.view());
  fused_add_rmsnorm_forward(x.view(), residual.view(), w.view(), stat.view());
  layernorm_forward(x.view(), w.view(), w.view(), y.view(), stat.view(), stat2.view());
  const std::vector<double> zeros(8, 0.0);
  rmsnorm_backward(y.view(), x.view(), w.view(), stat.view(), dx.view(), dw.view(), TensorView{});
  EXPECT_EQ(dw.values(), zeros);
  dw.fill_nan();
  fused_add_rmsnorm_backward(y.view(), TensorView{}, x.view(), w.view(), stat.view(), dx.view(),
                             dw.view(), TensorView{});
  EXPECT_EQ(dw.values(), zeros);
  dw.fill_nan();
  layernorm_backward({.dy = y.view(), .x = x.view(), .weight = w.view(), .mean = stat.view(),
                      .rstd = stat2.view(), .dx = dx.view(), .dw = dw.view(), .db = db.view()});
  EXPECT_EQ(dw.values(), zeros);
  EXPECT_EQ(db.values(), zeros);
}

// Row `row` of an M x N tensor is all NaN and every other row is finite.
void expect_only_row_nan(const HostTensor& t, std::int64_t n, std::int64_t row) {
  const auto v = t.values();
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (static_cast<std::int64_t>(i) / n == row) {
      EXPECT_TRUE(std::isnan(v[i])) << "element " << i;
    } else {
      EXPECT_TRUE(std::isfinite(v[i])) << "element " << i;
    }
  }
}

TEST(Norm, NaNPropagatesThroughItsRow) {
  const std::int64_t n = 5;
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    auto x = HostTensor::random(dt, {3, n}, -2, 2);
    x.set(1 * n + 2, NAN);
    auto w = HostTensor::random(dt, {n}, -1, 1);
    auto dy = HostTensor::random(dt, {3, n}, -1, 1);
    HostTensor y(dt, {3, n}), mean(DType::kFloat32, {3}), rstd(DType::kFloat32, {3});
    HostTensor dx(dt, {3, n}), dw(dt, {n}), db(dt, {n});

    rmsnorm_forward(x.view(), w.view(), y.view(), rstd.view());
    expect_only_row_nan(y, n, 1);
    expect_only_row_nan(rstd, 1, 1);
    rmsnorm_backward(dy.view(), x.view(), w.view(), rstd.view(), dx.view(), dw.view(),
                     TensorView{});
    expect_only_row_nan(dx, n, 1);
    expect_only_row_nan(dw, n, 0);  // every column sees the NaN row

    layernorm_forward(x.view(), w.view(), w.view(), y.view(), mean.view(), rstd.view());
    expect_only_row_nan(y, n, 1);
    expect_only_row_nan(mean, 1, 1);
    layernorm_backward({.dy = dy.view(), .x = x.view(), .weight = w.view(), .mean = mean.view(),
                        .rstd = rstd.view(), .dx = dx.view(), .dw = dw.view(), .db = db.view()});
    expect_only_row_nan(dx, n, 1);
    expect_only_row_nan(dw, n, 0);
    EXPECT_TRUE(std::isfinite(db.at(0)));  // db = sum(dy) never touches x

    auto residual = HostTensor::random(dt, {3, n}, -2, 2);
    fused_add_rmsnorm_forward(x.view(), residual.view(), w.view(), rstd.view());
    for (std::int64_t i = 0; i < residual.numel(); ++i) {  // the sum is elementwise
      EXPECT_EQ(std::isnan(residual.at(i)), i == 1 * n + 2) << "element " << i;
    }
    expect_only_row_nan(x, n, 1);

    // A NaN in the upstream gradient reaches its row of dx.
    auto finite_x = HostTensor::random(dt, {3, n}, -2, 2);
    rmsnorm_forward(finite_x.view(), w.view(), y.view(), rstd.view());
    dy.set(2 * n, NAN);
    fused_add_rmsnorm_backward(dy.view(), TensorView{}, finite_x.view(), w.view(), rstd.view(),
                               dx.view(), dw.view(), TensorView{});
    expect_only_row_nan(dx, n, 2);
  }
}

// ---------------------------------------------------------------------------------------
// Argument errors

struct ErrorFixture : ::testing::Test {
  static constexpr std::int64_t kRows = 4, kCols = 8;
  HostTensor x = HostTensor::random(DType::kFloat32, {kRows, kCols});
  HostTensor dy = HostTensor::random(DType::kFloat32, {kRows, kCols});
  HostTensor y{DType::kFloat32, {kRows, kCols}};
  HostTensor dx{DType::kFloat32, {kRows, kCols}};
  HostTensor residual = HostTensor::random(DType::kFloat32, {kRows, kCols});
  HostTensor w = HostTensor::random(DType::kFloat32, {kCols});
  HostTensor b = HostTensor::random(DType::kFloat32, {kCols});
  HostTensor dw{DType::kFloat32, {kCols}};
  HostTensor db{DType::kFloat32, {kCols}};
  HostTensor mean = HostTensor::random(DType::kFloat32, {kRows}, 0, 1);
  HostTensor rstd = HostTensor::random(DType::kFloat32, {kRows}, 1, 2);
  HostTensor x16 = HostTensor::random(DType::kFloat16, {kRows, kCols});
  HostTensor bf16 = HostTensor::random(DType::kBFloat16, {kRows, kCols});
  HostTensor ints{DType::kInt32, {kRows, kCols}};
  HostTensor buffer = HostTensor::random(DType::kFloat32, {4 * kRows * kCols});

  // A [rows, cols] view into `buffer` starting `offset` elements in.
  TensorView slice(std::int64_t offset, std::int64_t rows = kRows, std::int64_t cols = kCols) {
    return TensorView(static_cast<float*>(buffer.data()) + offset, DType::kFloat32, {rows, cols});
  }
};

TEST_F(ErrorFixture, RMSNormForward) {
  const TensorView none;
  TS_EXPECT_ERROR(rmsnorm_forward(none, w.view(), y.view(), rstd.view()), "rmsnorm_forward",
                  "argument 'x'", "a tensor", "none");
  TS_EXPECT_ERROR(rmsnorm_forward(ints.view(), w.view(), y.view(), rstd.view()),
                  "rmsnorm_forward", "argument 'x'", "int32");
  TensorView null_x = x.view();
  null_x.data = nullptr;
  TS_EXPECT_ERROR(rmsnorm_forward(null_x, w.view(), y.view(), rstd.view()), "rmsnorm_forward",
                  "argument 'x'", "non-null");
  TS_EXPECT_ERROR(rmsnorm_forward(TensorView(x.data(), DType::kFloat32, {4, 4}, {1, 4}),
                                  TensorView{}, y.view(), TensorView{}),
                  "rmsnorm_forward", "argument 'x'", "stride 1");
  TS_EXPECT_ERROR(rmsnorm_forward(bf16.view(), x16.view(), y.view(), rstd.view()),
                  "rmsnorm_forward", "argument 'weight'", "float32 or bfloat16", "float16");
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), x16.view(), y.view(), rstd.view()),
                  "rmsnorm_forward", "argument 'weight'", "expected float32 (the dtype", "float16");
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), x.view(), y.view(), rstd.view()), "rmsnorm_forward",
                  "argument 'weight'", "1 dimensions");
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), rstd.view(), y.view(), TensorView{}),
                  "rmsnorm_forward", "argument 'weight'", "size 8");
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), TensorView(buffer.data(), DType::kFloat32, {8}, {2}),
                                  y.view(), rstd.view()),
                  "rmsnorm_forward", "argument 'weight'", "contiguous");
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), w.view(), none, rstd.view()), "rmsnorm_forward",
                  "argument 'y'", "a tensor", "none");
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), w.view(), x16.view(), rstd.view()),
                  "rmsnorm_forward", "argument 'y'", "float16");
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), w.view(),
                                  TensorView(buffer.data(), DType::kFloat32, {4, 8}, {16, 2}),
                                  rstd.view()),
                  "rmsnorm_forward", "argument 'y'", "stride 1");
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), w.view(), slice(0, 4, 7), rstd.view()),
                  "rmsnorm_forward", "argument 'y'", "shape [4, 8]", "[4, 7]");
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), w.view(), y.view(), w.view()), "rmsnorm_forward",
                  "argument 'rstd'", "4 elements");
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), w.view(), y.view(), to_float64(rstd).view()),
                  "rmsnorm_forward", "argument 'rstd'", "float32", "float64");
  TS_EXPECT_ERROR(rmsnorm_forward(to_float64(x).view(), w.view(), to_float64(y).view(),
                                  HostTensor(DType::kFloat16, {4}).view()),
                  "rmsnorm_forward", "argument 'rstd'", "{float32, float64}", "float16");
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), w.view(), y.view(),
                                  TensorView(buffer.data(), DType::kFloat32, {4}, {3})),
                  "rmsnorm_forward", "argument 'rstd'", "contiguous");
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), w.view(), y.view(), rstd.view(), {.eps = -1e-6}),
                  "rmsnorm_forward", "argument 'options.eps'", ">= 0", "-1e-06");
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), w.view(), y.view(), rstd.view(), {.eps = NAN}),
                  "rmsnorm_forward", "argument 'options.eps'", "finite");
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), w.view(), y.view(), rstd.view(),
                                  {.eps = 1e-6, .weight_offset = INFINITY}),
                  "rmsnorm_forward", "argument 'options.weight_offset'", "finite", "inf");
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), w.view(), y.view(), rstd.view(),
                                  {.variant = static_cast<NormVariant>(9)}),
                  "rmsnorm_forward", "argument 'options.variant'", "9");
  TS_EXPECT_ERROR(layernorm_forward(x.view(), w.view(), {}, y.view(), {}, rstd.view(),
                                    {.variant = static_cast<NormVariant>(-1)}),
                  "layernorm_forward", "argument 'options.variant'", "-1");
  // The CPU path ignores a valid variant, forward-only ones included.
  for (NormVariant v : {NormVariant::kRegisters, NormVariant::kTwoPass, NormVariant::kRows,
                        NormVariant::kPipelined, NormVariant::kRing}) {
    rmsnorm_forward(x.view(), w.view(), y.view(), rstd.view(), {.variant = v});
  }
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), w.view(), x.view(), rstd.view()), "rmsnorm_forward",
                  "argument 'y'", "disjoint from 'x'");
  TS_EXPECT_ERROR(rmsnorm_forward(slice(0), w.view(), slice(8), rstd.view()), "rmsnorm_forward",
                  "argument 'y'", "disjoint from 'x'");
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), w.view(), y.view(),
                                  TensorView(w.data(), DType::kFloat32, {4})),
                  "rmsnorm_forward", "argument 'rstd'", "disjoint from 'weight'");
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), w.view(), y.view(),
                                  TensorView(y.data(), DType::kFloat32, {4})),
                  "rmsnorm_forward", "argument 'rstd'", "disjoint from 'y'");
  TS_EXPECT_ERROR(rmsnorm_forward(x.view(), on_cuda(w.view()), y.view(), rstd.view()),
                  "rmsnorm_forward", "argument 'weight'", "cpu", "cuda:0");
  TS_EXPECT_ERROR(rmsnorm_forward(on_cuda(to_float64(x).view()), TensorView{}, TensorView{},
                                  TensorView{}),
                  "rmsnorm_forward", "argument 'x'", "float64 tensors on the CPU only");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(rmsnorm_forward(on_cuda(x.view()), on_cuda(w.view()), on_cuda(y.view()),
                                    on_cuda(rstd.view())),
                    "rmsnorm_forward", "CUDA");
  }
}

TEST_F(ErrorFixture, RMSNormBackward) {
  const TensorView none;
  TS_EXPECT_ERROR(rmsnorm_backward(slice(0, 4, 7), x.view(), w.view(), rstd.view(), dx.view(),
                                   dw.view(), none),
                  "rmsnorm_backward", "argument 'dy'", "shape [4, 8]");
  TS_EXPECT_ERROR(rmsnorm_backward(dy.view(), x.view(), w.view(), none, dx.view(), dw.view(),
                                   none),
                  "rmsnorm_backward", "argument 'rstd'", "a tensor", "none");
  TS_EXPECT_ERROR(rmsnorm_backward(dy.view(), x.view(), w.view(), rstd.view(), bf16.view(),
                                   dw.view(), none),
                  "rmsnorm_backward", "argument 'dx'", "bfloat16");
  TS_EXPECT_ERROR(rmsnorm_backward(dy.view(), x.view(), w.view(), rstd.view(), dx.view(), none,
                                   none),
                  "rmsnorm_backward", "argument 'dw'", "a tensor", "none");
  TS_EXPECT_ERROR(rmsnorm_backward(dy.view(), x.view(), none, rstd.view(), dx.view(), dw.view(),
                                   none),
                  "rmsnorm_backward", "argument 'dw'", "no tensor (there is no 'weight')");
  TS_EXPECT_ERROR(rmsnorm_backward(dy.view(), x.view(), w.view(), rstd.view(), dx.view(),
                                   to_float64(dw).view(), none),
                  "rmsnorm_backward", "argument 'dw'", "float32 (the dtype of 'weight')");
  TS_EXPECT_ERROR(rmsnorm_backward(dy.view(), x.view(), w.view(), rstd.view(), dx.view(),
                                   mean.view(), none),
                  "rmsnorm_backward", "argument 'dw'", "shape [8]", "[4]");
  TS_EXPECT_ERROR(rmsnorm_backward(dy.view(), x.view(), w.view(), rstd.view(), dx.view(),
                                   TensorView(buffer.data(), DType::kFloat32, {8}, {2}), none),
                  "rmsnorm_backward", "argument 'dw'", "contiguous");
  TS_EXPECT_ERROR(rmsnorm_backward(slice(0), x.view(), w.view(), rstd.view(), slice(8),
                                   dw.view(), none),
                  "rmsnorm_backward", "argument 'dx'", "disjoint from 'dy'");
  // Same pointer, other strides: not the same view, so not in place.
  TS_EXPECT_ERROR(rmsnorm_backward(TensorView(buffer.data(), DType::kFloat32, {4, 8}, {16, 1}),
                                   x.view(), w.view(), rstd.view(), slice(0), dw.view(), none),
                  "rmsnorm_backward", "argument 'dx'", "disjoint from 'dy'");
  TS_EXPECT_ERROR(rmsnorm_backward(dy.view(), x.view(), w.view(), rstd.view(), x.view(),
                                   dw.view(), none),
                  "rmsnorm_backward", "argument 'dx'", "disjoint from 'x'");
  TS_EXPECT_ERROR(rmsnorm_backward(dy.view(), x.view(), w.view(), rstd.view(), dx.view(),
                                   TensorView(dx.data(), DType::kFloat32, {8}), none),
                  "rmsnorm_backward", "argument 'dw'", "disjoint from 'dx'");
  TS_EXPECT_ERROR(rmsnorm_backward(dy.view(), x.view(), w.view(), rstd.view(), dx.view(),
                                   dw.view(), dy.view()),
                  "rmsnorm_backward", "argument 'workspace'", "disjoint from 'dy'");
  TS_EXPECT_ERROR(rmsnorm_backward(dy.view(), x.view(), w.view(), rstd.view(), dx.view(),
                                   dw.view(), on_cuda(buffer.view())),
                  "rmsnorm_backward", "argument 'workspace'", "cuda:0");
  TS_EXPECT_ERROR(rmsnorm_backward(dy.view(), x.view(), w.view(), rstd.view(), dx.view(),
                                   dw.view(), none, {.eps = -1.0}),
                  "rmsnorm_backward", "argument 'options.eps'");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(rmsnorm_backward(on_cuda(dy.view()), on_cuda(x.view()), on_cuda(w.view()),
                                     on_cuda(rstd.view()), on_cuda(dx.view()), on_cuda(dw.view()),
                                     none),
                    "rmsnorm_backward", "CUDA");
  }
}

TEST_F(ErrorFixture, FusedAddRMSNormForward) {
  TS_EXPECT_ERROR(fused_add_rmsnorm_forward(bf16.view(), x16.view(), w.view(), rstd.view()),
                  "fused_add_rmsnorm_forward", "argument 'residual'", "float32 or bfloat16",
                  "float16");
  TS_EXPECT_ERROR(fused_add_rmsnorm_forward(x.view(), slice(0, 4, 7), w.view(), rstd.view()),
                  "fused_add_rmsnorm_forward", "argument 'residual'", "shape [4, 8]");
  TS_EXPECT_ERROR(fused_add_rmsnorm_forward(x.view(), TensorView{}, w.view(), rstd.view()),
                  "fused_add_rmsnorm_forward", "argument 'residual'", "a tensor");
  TS_EXPECT_ERROR(fused_add_rmsnorm_forward(x.view(), x.view(), w.view(), rstd.view()),
                  "fused_add_rmsnorm_forward", "argument 'residual'", "disjoint from 'x'");
  TS_EXPECT_ERROR(fused_add_rmsnorm_forward(
                      slice(0), residual.view(),
                      TensorView(static_cast<float*>(buffer.data()) + 8, DType::kFloat32, {8}),
                      rstd.view()),
                  "fused_add_rmsnorm_forward", "argument 'x'", "disjoint from 'weight'");
  TS_EXPECT_ERROR(fused_add_rmsnorm_forward(x.view(), residual.view(), w.view(), mean.view(),
                                            {.eps = 0.0, .weight_offset = NAN}),
                  "fused_add_rmsnorm_forward", "argument 'options.weight_offset'");
  TS_EXPECT_ERROR(fused_add_rmsnorm_forward(x.view(), residual.view(), w.view(), b.view()),
                  "fused_add_rmsnorm_forward", "argument 'rstd'", "4 elements");
  TS_EXPECT_ERROR(fused_add_rmsnorm_forward(x.view(), residual.view(), w.view(),
                                            TensorView(residual.data(), DType::kFloat32, {4})),
                  "fused_add_rmsnorm_forward", "argument 'rstd'", "disjoint from 'residual'");
  // Out of place: the outputs are checked like the inputs and written only where nothing is read.
  HostTensor sum{DType::kFloat32, {kRows, kCols}};
  TS_EXPECT_ERROR(fused_add_rmsnorm_forward(x.view(), residual.view(), w.view(), x.view(), sum.view(),
                                            rstd.view()),
                  "fused_add_rmsnorm_forward", "argument 'y'", "disjoint from 'x'");
  TS_EXPECT_ERROR(fused_add_rmsnorm_forward(x.view(), residual.view(), w.view(), y.view(),
                                            residual.view(), rstd.view()),
                  "fused_add_rmsnorm_forward", "argument 'residual_out'", "disjoint from 'residual'");
  TS_EXPECT_ERROR(fused_add_rmsnorm_forward(x.view(), residual.view(), w.view(), y.view(), x16.view(),
                                            rstd.view()),
                  "fused_add_rmsnorm_forward", "argument 'residual_out'", "float32", "float16");
  TS_EXPECT_ERROR(fused_add_rmsnorm_forward(x.view(), residual.view(), w.view(), slice(0, 4, 7),
                                            sum.view(), rstd.view()),
                  "fused_add_rmsnorm_forward", "argument 'y'", "shape [4, 8]");
  TS_EXPECT_ERROR(fused_add_rmsnorm_forward(x.view(), residual.view(), w.view(), y.view(), TensorView{},
                                            rstd.view()),
                  "fused_add_rmsnorm_forward", "argument 'residual_out'", "a tensor");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(fused_add_rmsnorm_forward(on_cuda(x.view()), on_cuda(residual.view()),
                                              TensorView{}, TensorView{}),
                    "fused_add_rmsnorm_forward", "CUDA");
  }
}

TEST_F(ErrorFixture, FusedAddRMSNormBackward) {
  const TensorView none;
  TS_EXPECT_ERROR(fused_add_rmsnorm_backward(none, none, residual.view(), w.view(), rstd.view(),
                                             dx.view(), dw.view(), none),
                  "fused_add_rmsnorm_backward", "argument 'dy'", "a tensor");
  TS_EXPECT_ERROR(fused_add_rmsnorm_backward(dy.view(), none, x16.view(), w.view(), rstd.view(),
                                             dx.view(), dw.view(), none),
                  "fused_add_rmsnorm_backward", "argument 'residual'",
                  "float32 (the dtype of 'dy')");
  TS_EXPECT_ERROR(fused_add_rmsnorm_backward(dy.view(), x16.view(), residual.view(), w.view(),
                                             rstd.view(), dx.view(), dw.view(), none),
                  "fused_add_rmsnorm_backward", "argument 'd_residual'", "the dtype of 'residual'");
  TS_EXPECT_ERROR(fused_add_rmsnorm_backward(dy.view(), slice(0, 4, 7), residual.view(),
                                             w.view(), rstd.view(), dx.view(), dw.view(), none),
                  "fused_add_rmsnorm_backward", "argument 'd_residual'", "shape [4, 8]");
  TS_EXPECT_ERROR(fused_add_rmsnorm_backward(dy.view(), none, residual.view(), w.view(), none,
                                             dx.view(), dw.view(), none),
                  "fused_add_rmsnorm_backward", "argument 'rstd'", "a tensor");
  TS_EXPECT_ERROR(fused_add_rmsnorm_backward(dy.view(), none, residual.view(), w.view(),
                                             rstd.view(), dx.view(), none, none),
                  "fused_add_rmsnorm_backward", "argument 'dw'", "a tensor");
  TS_EXPECT_ERROR(fused_add_rmsnorm_backward(dy.view(), none, residual.view(), w.view(),
                                             rstd.view(), x16.view(), dw.view(), none),
                  "fused_add_rmsnorm_backward", "argument 'dx'", "float16");
  TS_EXPECT_ERROR(fused_add_rmsnorm_backward(dy.view(), slice(0), residual.view(), w.view(),
                                             rstd.view(), slice(0), dw.view(), none),
                  "fused_add_rmsnorm_backward", "argument 'dx'", "disjoint from 'd_residual'");
  TS_EXPECT_ERROR(fused_add_rmsnorm_backward(dy.view(), none, residual.view(), w.view(),
                                             rstd.view(), residual.view(), dw.view(), none),
                  "fused_add_rmsnorm_backward", "argument 'dx'", "disjoint from 'residual'");
  TS_EXPECT_ERROR(fused_add_rmsnorm_backward(dy.view(), none, residual.view(), w.view(),
                                             rstd.view(), dx.view(), dw.view(), none,
                                             {.eps = INFINITY}),
                  "fused_add_rmsnorm_backward", "argument 'options.eps'");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(fused_add_rmsnorm_backward(on_cuda(dy.view()), none, on_cuda(residual.view()),
                                               none, on_cuda(rstd.view()), on_cuda(dx.view()),
                                               none, none),
                    "fused_add_rmsnorm_backward", "CUDA");
  }
}

TEST_F(ErrorFixture, LayerNormForward) {
  const TensorView none;
  TS_EXPECT_ERROR(layernorm_forward(x16.view(), w.view(), b.view(), x16.view(), none, none),
                  "layernorm_forward", "argument 'y'", "disjoint from 'x'");
  TS_EXPECT_ERROR(layernorm_forward(x.view(), w.view(), rstd.view(), y.view(), none, none),
                  "layernorm_forward", "argument 'bias'", "size 8");
  TS_EXPECT_ERROR(layernorm_forward(bf16.view(), w.view(), x16.view(), bf16.view(), none, none),
                  "layernorm_forward", "argument 'bias'", "float32 or bfloat16");
  TS_EXPECT_ERROR(layernorm_forward(x.view(), w.view(), b.view(), y.view(),
                                    HostTensor(DType::kFloat16, {4}).view(), none),
                  "layernorm_forward", "argument 'mean'", "float32", "float16");
  TS_EXPECT_ERROR(layernorm_forward(x.view(), w.view(), b.view(), y.view(), mean.view(),
                                    HostTensor(DType::kFloat32, {5}).view()),
                  "layernorm_forward", "argument 'rstd'", "4 elements", "[5]");
  TS_EXPECT_ERROR(layernorm_forward(x.view(), w.view(), b.view(), y.view(), mean.view(),
                                    mean.view()),
                  "layernorm_forward", "argument 'rstd'", "disjoint from 'mean'");
  TS_EXPECT_ERROR(layernorm_forward(x.view(), w.view(), b.view(),
                                    TensorView(b.data(), DType::kFloat32, {1, 8}, {8, 1}), none,
                                    none),
                  "layernorm_forward", "argument 'y'", "shape [4, 8]");
  TS_EXPECT_ERROR(layernorm_forward(x.view(), w.view(), b.view(), slice(0), slice(0, 4, 1), none),
                  "layernorm_forward", "argument 'mean'", "disjoint from 'y'");
  TS_EXPECT_ERROR(layernorm_forward(x.view(), w.view(), b.view(), y.view(), mean.view(),
                                    rstd.view(), {.eps = -0.5}),
                  "layernorm_forward", "argument 'options.eps'", "-0.5");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(layernorm_forward(on_cuda(x.view()), none, none, on_cuda(y.view()), none, none),
                    "layernorm_forward", "CUDA");
  }
}

TEST_F(ErrorFixture, LayerNormBackward) {
  const TensorView none;
  TS_EXPECT_ERROR(layernorm_backward({.dy = dy.view(), .x = x.view(), .weight = w.view(),
                                      .rstd = rstd.view(), .dx = dx.view(), .dw = dw.view(),
                                      .db = db.view()}),
                  "layernorm_backward", "argument 'mean'", "a tensor");
  TS_EXPECT_ERROR(layernorm_backward({.dy = dy.view(), .x = x.view(), .weight = w.view(),
                                      .mean = mean.view(), .dx = dx.view(), .dw = dw.view(),
                                      .db = db.view()}),
                  "layernorm_backward", "argument 'rstd'", "a tensor");
  TS_EXPECT_ERROR(layernorm_backward({.dy = x16.view(), .x = x.view(), .weight = w.view(),
                                      .mean = mean.view(), .rstd = rstd.view(), .dx = dx.view(),
                                      .dw = dw.view(), .db = db.view()}),
                  "layernorm_backward", "argument 'dy'", "float16");
  TS_EXPECT_ERROR(layernorm_backward({.dy = dy.view(), .x = x.view(), .mean = mean.view(),
                                      .rstd = rstd.view(), .dx = dx.view(), .dw = dw.view(),
                                      .db = db.view()}),
                  "layernorm_backward", "argument 'dw'", "no tensor");
  TS_EXPECT_ERROR(layernorm_backward({.dy = dy.view(), .x = x.view(), .weight = w.view(),
                                      .mean = mean.view(), .rstd = rstd.view(), .dx = dx.view(),
                                      .dw = dw.view(), .db = mean.view()}),
                  "layernorm_backward", "argument 'db'", "size 8");
  TS_EXPECT_ERROR(layernorm_backward({.dy = dy.view(), .x = x.view(), .weight = w.view(),
                                      .mean = mean.view(), .rstd = rstd.view(), .dx = dx.view(),
                                      .dw = dw.view(), .db = dw.view()}),
                  "layernorm_backward", "argument 'db'", "disjoint from 'dw'");
  TS_EXPECT_ERROR(layernorm_backward({.dy = dy.view(), .x = x.view(), .weight = w.view(),
                                      .mean = mean.view(), .rstd = rstd.view(), .dx = dx.view(),
                                      .dw = dw.view(), .db = db.view(), .workspace = mean.view()}),
                  "layernorm_backward", "argument 'workspace'", "disjoint from 'mean'");
  TS_EXPECT_ERROR(layernorm_backward({.dy = dy.view(), .x = x.view(), .weight = w.view(),
                                      .mean = mean.view(), .rstd = rstd.view(), .dx = slice(0),
                                      .dw = dw.view(), .db = db.view(), .workspace = slice(4)}),
                  "layernorm_backward", "argument 'workspace'", "disjoint from 'dx'");
  TS_EXPECT_ERROR(layernorm_backward({.dy = dy.view(), .x = x.view(), .weight = w.view(),
                                      .mean = mean.view(), .rstd = rstd.view(), .dx = dx.view(),
                                      .dw = dw.view(), .db = db.view()}, {.eps = NAN}),
                  "layernorm_backward", "argument 'options.eps'");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(layernorm_backward({.dy = on_cuda(dy.view()), .x = on_cuda(x.view()),
                                        .mean = on_cuda(mean.view()), .rstd = on_cuda(rstd.view()),
                                        .dx = on_cuda(dx.view())}),
                    "layernorm_backward", "CUDA");
  }
}

}  // namespace
}  // namespace trainscale
