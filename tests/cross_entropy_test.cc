// Cross-entropy and fused linear cross-entropy (the MSE tests live in loss_test.cc).
#include <cmath>
#include <limits>
#include <string>

#include "ops/loss/fused_linear_plan.h"
#include "ops/loss/loss_internal.h"
#include "trainscale/loss.h"
#include "util/gpu_util.h"
#include "util/test_util.h"

namespace trainscale {
namespace {

using test::HostTensor;

constexpr auto kAllFloatTypes = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64};
constexpr auto kReductions = {Reduction::kNone, Reduction::kMean, Reduction::kSum};

struct OptionsCase {
  const char* name;
  CrossEntropyOptions options;
};

// Each option on its own, then all of them together.
std::vector<OptionsCase> option_cases() {
  std::vector<OptionsCase> cases = {{"plain", {}},
                                    {"ignore_in_range", {}},
                                    {"label_smoothing", {}},
                                    {"z_loss", {}},
                                    {"softcap", {}},
                                    {"combined", {}}};
  cases[1].options.ignore_index = 3;
  cases[2].options.label_smoothing = 0.15;
  cases[3].options.z_loss = 0.05;
  cases[4].options.softcap = 2.5;
  cases[5].options = {.ignore_index = -1, .label_smoothing = 0.2, .z_loss = 0.03, .softcap = 3.0};
  return cases;
}

CrossEntropyOptions with_reduction(CrossEntropyOptions o, Reduction r) {
  o.reduction = r;
  return o;
}

// Random classes with every third row (from `first_ignored`) set to ignore_index.
HostTensor make_targets(DType dtype, std::int64_t rows, std::int64_t classes,
                        std::int64_t ignore_index, std::int64_t first_ignored = 1) {
  auto t = HostTensor::random(dtype, {rows}, 0, static_cast<double>(classes - 1));
  for (std::int64_t i = 0; i < rows; ++i) {
    const bool ignored = i >= first_ignored && (i - first_ignored) % 3 == 0;
    if (ignored) {
      t.set(i, static_cast<double>(ignore_index));
    } else if (static_cast<std::int64_t>(t.at(i)) == ignore_index) {
      // ignore_index may be a real class: keep the other rows counted, or a mean over
      // all-ignored rows would be NaN by chance.
      t.set(i, static_cast<double>((ignore_index + 1) % classes));
    }
  }
  return t;
}

std::vector<std::int64_t> index_values(const HostTensor& t) {
  std::vector<std::int64_t> v;
  for (double x : t.values()) v.push_back(static_cast<std::int64_t>(x));
  return v;
}

// Loss output: per row for kNone, else one element.
HostTensor loss_tensor(DType dtype, std::int64_t rows, Reduction r) {
  return r == Reduction::kNone ? HostTensor(dtype, {rows}) : HostTensor(dtype, {});
}

struct Expected {
  std::vector<double> loss;  // per row for kNone, else one value
  std::vector<double> lse;
};

// Independent formulation: log-softmax around the row mean, loss from log-probabilities:
// -(1-e) logp_t - e mean(logp) + lambda lse^2.
Expected reference_ce(const std::vector<double>& logits, const std::vector<std::int64_t>& targets,
                      std::int64_t classes, const CrossEntropyOptions& o) {
  const auto rows = static_cast<std::int64_t>(targets.size());
  Expected out{std::vector<double>(rows, 0.0), std::vector<double>(rows)};
  std::int64_t valid = 0;
  for (std::int64_t i = 0; i < rows; ++i) {
    std::vector<double> z(logits.begin() + i * classes, logits.begin() + (i + 1) * classes);
    if (o.softcap > 0) {
      for (double& v : z) v = o.softcap * std::tanh(v / o.softcap);
    }
    double mean = 0;
    for (double v : z) mean += v / static_cast<double>(classes);
    double sum = 0;
    for (double v : z) sum += std::exp(v - mean);
    const double lse = mean + std::log(sum);
    out.lse[i] = lse;
    if (targets[i] == o.ignore_index) continue;
    ++valid;
    double mean_logp = 0;
    for (double v : z) mean_logp += (v - lse) / static_cast<double>(classes);
    out.loss[i] = -(1 - o.label_smoothing) * (z[targets[i]] - lse) - o.label_smoothing * mean_logp +
                  o.z_loss * lse * lse;
  }
  if (o.reduction != Reduction::kNone) {
    double total = 0;
    for (double v : out.loss) total += v;
    if (o.reduction == Reduction::kMean) total /= static_cast<double>(valid);
    out.loss = {total};
  }
  return out;
}

// Gradient of dot(upstream, reference loss) by finite differences of the independent reference.
std::vector<double> reference_ce_gradient(const std::vector<double>& logits,
                                          const std::vector<std::int64_t>& targets,
                                          std::int64_t classes, const CrossEntropyOptions& o,
                                          const std::vector<double>& upstream) {
  return test::numeric_gradient(logits, [&](const std::vector<double>& x) {
    return test::dot(upstream, reference_ce(x, targets, classes, o).loss);
  });
}

// The library's forward in fp64, as a function of the logits, for finite differences.
double library_ce(const std::vector<double>& logits, const HostTensor& targets, std::int64_t classes,
                  const CrossEntropyOptions& o, const std::vector<double>& upstream) {
  const auto rows = static_cast<std::int64_t>(targets.numel());
  auto x = HostTensor::from_values(DType::kFloat64, {rows, classes}, logits);
  auto loss = loss_tensor(DType::kFloat64, rows, o.reduction);
  cross_entropy_forward(x.view(), targets.view(), loss.view(), TensorView(), TensorView(), o);
  return test::dot(upstream, loss.values());
}

std::string case_name(const OptionsCase& c, Reduction r, DType dt) {
  return std::string(c.name) + "/" + reduction_name(r) + "/" + dtype_name(dt);
}

TEST(CrossEntropy, ForwardMatchesLogSoftmaxEveryDtypeAndOption) {
  const std::int64_t rows = 7, classes = 37;
  for (const auto& oc : option_cases()) {
    for (Reduction red : kReductions) {
      const auto o = with_reduction(oc.options, red);
      for (DType dt : kAllFloatTypes) {
        const DType stat = dt == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
        auto logits = HostTensor::random(dt, {rows, classes}, -4, 4, /*row_pad=*/3);
        auto targets = make_targets(dt == DType::kFloat16 ? DType::kInt32 : DType::kInt64, rows,
                                    classes, o.ignore_index);
        auto loss = loss_tensor(stat, rows, red);
        HostTensor lse(stat, {rows}), grad(dt, {rows, classes}, /*row_pad=*/2);
        cross_entropy_forward(logits.view(), targets.view(), loss.view(), lse.view(), grad.view(), o);
        const auto x = logits.values();
        const auto t = index_values(targets);
        const Expected ref = reference_ce(x, t, classes, o);
        const std::string what = case_name(oc, red, dt);
        EXPECT_TRUE(test::matches_reference(loss.values(), ref.loss, test::tolerance(stat))) << what;
        EXPECT_TRUE(test::matches_reference(lse.values(), ref.lse, test::tolerance(stat))) << what;
        // The fused gradient is for an upstream gradient of 1.
        const auto upstream = std::vector<double>(ref.loss.size(), 1.0);
        const auto grad_ref = reference_ce_gradient(x, t, classes, o, upstream);
        EXPECT_TRUE(test::matches_reference(grad.values(), grad_ref, std::max(test::tolerance(dt), 1e-7)))
            << what;
      }
    }
  }
}

TEST(CrossEntropy, BackwardMatchesFiniteDifferencesForEveryOptionCombination) {
  const std::int64_t rows = 5, classes = 6;
  for (int mask = 0; mask < 16; ++mask) {
    CrossEntropyOptions base;
    if (mask & 1) base.label_smoothing = 0.3;
    if (mask & 2) base.z_loss = 0.1;
    if (mask & 4) base.softcap = 1.5;
    if (mask & 8) base.ignore_index = 2;  // a real class ignored
    for (Reduction red : kReductions) {
      const auto o = with_reduction(base, red);
      auto logits = HostTensor::random(DType::kFloat64, {rows, classes}, -3, 3);
      auto targets = make_targets(DType::kInt64, rows, classes, o.ignore_index);
      const auto upstream = test::random_values(red == Reduction::kNone ? rows : 1);
      auto grad_loss = red == Reduction::kNone ? HostTensor::from_values(DType::kFloat64, {rows}, upstream)
                                               : HostTensor::from_values(DType::kFloat64, {}, upstream);
      auto loss = loss_tensor(DType::kFloat64, rows, red);
      HostTensor lse(DType::kFloat64, {rows}), grad(DType::kFloat64, {rows, classes}, /*row_pad=*/1);
      cross_entropy_forward(logits.view(), targets.view(), loss.view(), lse.view(), TensorView(), o);
      cross_entropy_backward(grad_loss.view(), logits.view(), targets.view(), lse.view(), grad.view(), o);
      const auto numeric = test::numeric_gradient(logits.values(), [&](const std::vector<double>& x) {
        return library_ce(x, targets, classes, o, upstream);
      });
      EXPECT_TRUE(test::matches_reference(grad.values(), numeric, 1e-7))
          << "mask " << mask << " " << reduction_name(red);
    }
  }
}

TEST(CrossEntropy, BackwardEveryDtype) {
  const std::int64_t rows = 6, classes = 19;
  const auto o = with_reduction(option_cases().back().options, Reduction::kNone);
  for (DType dt : kAllFloatTypes) {
    auto logits = HostTensor::random(dt, {rows, classes}, -4, 4, /*row_pad=*/1);
    auto targets = make_targets(DType::kInt32, rows, classes, o.ignore_index);
    const auto upstream = test::random_values(rows);
    auto grad_loss = HostTensor::from_values(DType::kFloat32, {rows}, upstream);
    HostTensor loss(DType::kFloat32, {rows}), lse(DType::kFloat32, {rows}), grad(dt, {rows, classes});
    cross_entropy_forward(logits.view(), targets.view(), loss.view(), lse.view(), TensorView(), o);
    cross_entropy_backward(grad_loss.view(), logits.view(), targets.view(), lse.view(), grad.view(), o);
    const auto ref = reference_ce_gradient(logits.values(), index_values(targets), classes, o,
                                           grad_loss.values());
    // The float32 lse costs ~1e-7 relative on top of the output rounding.
    EXPECT_TRUE(test::matches_reference(grad.values(), ref, std::max(test::tolerance(dt), 1e-6)))
        << dtype_name(dt);
  }
}

TEST(CrossEntropy, FusedInPlaceGradientEqualsSeparateBackward) {
  const std::int64_t rows = 9, classes = 41;
  for (Reduction red : kReductions) {
    const auto o = with_reduction(option_cases().back().options, red);
    for (DType dt : kAllFloatTypes) {
      const DType stat = dt == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
      auto logits = HostTensor::random(dt, {rows, classes}, -5, 5, /*row_pad=*/4);
      auto targets = make_targets(DType::kInt64, rows, classes, o.ignore_index);
      auto loss = loss_tensor(stat, rows, red), fused_loss = loss_tensor(stat, rows, red);
      HostTensor lse(stat, {rows}), grad(dt, {rows, classes});
      cross_entropy_forward(logits.view(), targets.view(), loss.view(), lse.view(), TensorView(), o);
      auto ones = loss_tensor(stat, rows, red);
      for (std::int64_t i = 0; i < ones.numel(); ++i) ones.set(i, 1.0);
      cross_entropy_backward(ones.view(), logits.view(), targets.view(), lse.view(), grad.view(), o);

      auto in_place = logits;
      cross_entropy_forward(in_place.view(), targets.view(), fused_loss.view(), TensorView(),
                            in_place.view(), o);
      const std::string what = std::string(reduction_name(red)) + "/" + dtype_name(dt);
      EXPECT_EQ(fused_loss.values(), loss.values()) << what;
      if (dt == DType::kFloat64) {
        EXPECT_EQ(in_place.values(), grad.values()) << what;  // same lse, same arithmetic
      } else {
        EXPECT_TRUE(test::matches_reference(in_place.values(), grad.values(), test::tolerance(dt))) << what;
      }
    }
  }
}

TEST(CrossEntropy, IgnoredRowsContributeNothing) {
  const std::int64_t rows = 8, classes = 11;
  auto logits = HostTensor::random(DType::kFloat32, {rows, classes}, -3, 3);
  auto targets = make_targets(DType::kInt64, rows, classes, -100, /*first_ignored=*/0);
  const auto t = index_values(targets);
  CrossEntropyOptions o{.label_smoothing = 0.1, .z_loss = 0.01};
  HostTensor per_row(DType::kFloat64, {rows}), sum(DType::kFloat64, {}), mean(DType::kFloat64, {});
  HostTensor grad(DType::kFloat32, {rows, classes});
  cross_entropy_forward(logits.view(), targets.view(), per_row.view(), TensorView(), grad.view(),
                        with_reduction(o, Reduction::kNone));
  cross_entropy_forward(logits.view(), targets.view(), sum.view(), TensorView(), TensorView(),
                        with_reduction(o, Reduction::kSum));
  cross_entropy_forward(logits.view(), targets.view(), mean.view(), TensorView(), TensorView(),
                        with_reduction(o, Reduction::kMean));
  std::int64_t valid = 0;
  for (std::int64_t i = 0; i < rows; ++i) {
    if (t[i] == -100) {
      EXPECT_EQ(per_row.at(i), 0.0);
      for (std::int64_t j = 0; j < classes; ++j) EXPECT_EQ(grad.at(i * classes + j), 0.0);
    } else {
      ++valid;
      EXPECT_GT(per_row.at(i), 0.0);
    }
  }
  EXPECT_EQ(valid, 5);
  EXPECT_NEAR(mean.at(0), sum.at(0) / static_cast<double>(valid), 1e-12);
}

TEST(CrossEntropy, ReductionsOverManyRowsMatchPerRowLosses) {
  const std::int64_t rows = 2500, classes = 3;  // several reduction chunks
  auto logits = HostTensor::random(DType::kFloat64, {rows, classes}, -2, 2);
  auto targets = make_targets(DType::kInt32, rows, classes, -100);
  HostTensor per_row(DType::kFloat64, {rows}), sum(DType::kFloat64, {}), mean(DType::kFloat64, {});
  cross_entropy_forward(logits.view(), targets.view(), per_row.view(), TensorView(), TensorView(),
                        {.reduction = Reduction::kNone});
  cross_entropy_forward(logits.view(), targets.view(), sum.view(), TensorView(), TensorView(),
                        {.reduction = Reduction::kSum});
  cross_entropy_forward(logits.view(), targets.view(), mean.view(), TensorView(), TensorView());
  const Expected ref = reference_ce(logits.values(), index_values(targets), classes, {.reduction = Reduction::kSum});
  double total = 0;
  for (double v : per_row.values()) total += v;
  EXPECT_NEAR(sum.at(0), total, 1e-9 * total);
  EXPECT_NEAR(sum.at(0), ref.loss[0], 1e-9 * total);
  EXPECT_NEAR(mean.at(0), total / static_cast<double>(rows - rows / 3), 1e-9);
}

TEST(CrossEntropy, EveryRowIgnoredGivesNaNMeanLikeTorch) {
  const std::int64_t rows = 4, classes = 5;
  auto logits = HostTensor::random(DType::kBFloat16, {rows, classes});
  auto targets = HostTensor::from_values(DType::kInt32, {rows}, {-100, -100, -100, -100});
  HostTensor mean(DType::kFloat32, {}), sum(DType::kFloat32, {1}), lse(DType::kFloat32, {rows});
  HostTensor grad(DType::kBFloat16, {rows, classes});
  cross_entropy_forward(logits.view(), targets.view(), mean.view(), lse.view(), grad.view());
  EXPECT_TRUE(std::isnan(mean.at(0)));
  for (double g : grad.values()) EXPECT_EQ(g, 0.0);
  for (double v : lse.values()) EXPECT_TRUE(std::isfinite(v));  // lse covers ignored rows too
  cross_entropy_forward(logits.view(), targets.view(), sum.view(), TensorView(), TensorView(),
                        {.reduction = Reduction::kSum});
  EXPECT_EQ(sum.at(0), 0.0);
  auto one = HostTensor::from_values(DType::kFloat32, {}, {1.0});
  cross_entropy_backward(one.view(), logits.view(), targets.view(), lse.view(), grad.view());
  for (double g : grad.values()) EXPECT_EQ(g, 0.0);
}

TEST(CrossEntropy, HugeLogitsAreStable) {
  const std::int64_t rows = 3, classes = 9;
  auto logits = HostTensor::random(DType::kFloat64, {rows, classes}, -3, 3);
  auto shifted = logits;
  for (std::int64_t i = 0; i < logits.numel(); ++i) shifted.set(i, logits.at(i) + 1e4);
  auto targets = make_targets(DType::kInt64, rows, classes, -100, /*first_ignored=*/rows);
  HostTensor loss(DType::kFloat64, {rows}), shifted_loss(DType::kFloat64, {rows});
  HostTensor grad(DType::kFloat64, {rows, classes}), shifted_grad(DType::kFloat64, {rows, classes});
  const CrossEntropyOptions o{.label_smoothing = 0.1, .reduction = Reduction::kNone};
  cross_entropy_forward(logits.view(), targets.view(), loss.view(), TensorView(), grad.view(), o);
  cross_entropy_forward(shifted.view(), targets.view(), shifted_loss.view(), TensorView(),
                        shifted_grad.view(), o);
  EXPECT_TRUE(test::matches_reference(shifted_loss.values(), loss.values(), 1e-10));
  EXPECT_TRUE(test::matches_reference(shifted_grad.values(), grad.values(), 1e-10));
}

TEST(CrossEntropy, NaNPropagatesToItsRow) {
  const std::int64_t rows = 4, classes = 7;
  auto logits = HostTensor::random(DType::kFloat16, {rows, classes});
  auto targets = HostTensor::from_values(DType::kInt64, {rows}, {1, 2, 3, -100});
  logits.set(1 * classes + 4, NAN);
  logits.set(3 * classes + 0, NAN);  // an ignored row
  HostTensor loss(DType::kFloat32, {rows}), lse(DType::kFloat32, {rows}), mean(DType::kFloat32, {});
  HostTensor grad(DType::kFloat16, {rows, classes});
  const CrossEntropyOptions o{.reduction = Reduction::kNone};
  cross_entropy_forward(logits.view(), targets.view(), loss.view(), lse.view(), grad.view(), o);
  EXPECT_TRUE(std::isnan(loss.at(1)) && std::isnan(lse.at(1)));
  EXPECT_TRUE(std::isfinite(loss.at(0)) && std::isfinite(loss.at(2)));
  EXPECT_EQ(loss.at(3), 0.0);
  for (std::int64_t j = 0; j < classes; ++j) {
    EXPECT_TRUE(std::isnan(grad.at(classes + j)));
    EXPECT_TRUE(std::isfinite(grad.at(j)));
    EXPECT_EQ(grad.at(3 * classes + j), 0.0);
  }
  cross_entropy_forward(logits.view(), targets.view(), mean.view(), TensorView(), TensorView());
  EXPECT_TRUE(std::isnan(mean.at(0)));
}

TEST(CrossEntropy, SingleClassAndEmptyBatch) {
  auto logits = HostTensor::random(DType::kFloat32, {3, 1});
  auto targets = HostTensor::from_values(DType::kInt32, {3}, {0, 0, 0});
  HostTensor loss(DType::kFloat32, {3}), grad(DType::kFloat32, {3, 1});
  cross_entropy_forward(logits.view(), targets.view(), loss.view(), TensorView(), grad.view(),
                        {.reduction = Reduction::kNone});
  for (std::int64_t i = 0; i < 3; ++i) {
    EXPECT_NEAR(loss.at(i), 0.0, 1e-7);
    EXPECT_NEAR(grad.at(i), 0.0, 1e-7);
  }

  HostTensor empty_logits(DType::kFloat32, {0, 8}), empty_targets(DType::kInt64, {0});
  HostTensor none(DType::kFloat32, {0}), sum(DType::kFloat32, {}), mean(DType::kFloat32, {});
  HostTensor empty_grad(DType::kFloat32, {0, 8}), empty_lse(DType::kFloat32, {0});
  cross_entropy_forward(empty_logits.view(), empty_targets.view(), none.view(), empty_lse.view(),
                        empty_grad.view(), {.reduction = Reduction::kNone});
  cross_entropy_forward(empty_logits.view(), empty_targets.view(), sum.view(), TensorView(),
                        TensorView(), {.reduction = Reduction::kSum});
  cross_entropy_forward(empty_logits.view(), empty_targets.view(), mean.view(), TensorView(),
                        TensorView());
  EXPECT_EQ(sum.at(0), 0.0);
  EXPECT_TRUE(std::isnan(mean.at(0)));
  cross_entropy_backward(sum.view(), empty_logits.view(), empty_targets.view(), empty_lse.view(),
                         empty_grad.view(), {.reduction = Reduction::kSum});
}

TEST(CrossEntropy, OutOfRangeTargetIsRejectedBeforeAnyWrite) {
  auto logits = HostTensor::random(DType::kFloat32, {3, 5});
  const auto before = logits.values();
  HostTensor loss(DType::kFloat32, {}), lse(DType::kFloat32, {3}), grad(DType::kFloat32, {3, 5});
  auto too_big = HostTensor::from_values(DType::kInt64, {3}, {0, 5, 1});
  auto negative = HostTensor::from_values(DType::kInt32, {3}, {0, 1, -2});
  TS_EXPECT_ERROR(cross_entropy_forward(logits.view(), too_big.view(), loss.view(), TensorView(),
                                        logits.view()),
                  "cross_entropy_forward", "argument 'targets'", "[0, 5)", "targets[1] = 5");
  EXPECT_EQ(logits.values(), before);
  TS_EXPECT_ERROR(cross_entropy_backward(loss.view(), logits.view(), negative.view(), lse.view(),
                                         grad.view()),
                  "cross_entropy_backward", "argument 'targets'", "targets[2] = -2");
}

TEST(CrossEntropy, InputErrors) {
  const std::int64_t rows = 4, classes = 6;
  auto logits = HostTensor::random(DType::kFloat32, {rows, classes});
  auto targets = make_targets(DType::kInt64, rows, classes, -100);
  HostTensor loss(DType::kFloat32, {}), per_row(DType::kFloat32, {rows}), lse(DType::kFloat32, {rows});
  HostTensor grad(DType::kFloat32, {rows, classes});
  auto fwd = [&](const TensorView& x, const TensorView& t, TensorView l, TensorView s, TensorView g,
                 CrossEntropyOptions o = {}) { cross_entropy_forward(x, t, l, s, g, o); };
  const char* op = "cross_entropy_forward";
  HostTensor ints(DType::kInt32, {rows, classes}), flat(DType::kFloat32, {rows * classes});
  HostTensor no_classes(DType::kFloat32, {rows, 0}), float_targets(DType::kFloat32, {rows});
  HostTensor short_targets(DType::kInt64, {rows - 1}), two_losses(DType::kFloat32, {2});
  HostTensor int_loss(DType::kInt32, {}), f16_lse(DType::kFloat16, {rows}), short_lse(DType::kFloat32, {rows - 1});
  HostTensor f16_grad(DType::kFloat16, {rows, classes}), wide_grad(DType::kFloat32, {rows, classes + 1});
  TS_EXPECT_ERROR(fwd(TensorView(), targets.view(), loss.view(), {}, {}), op, "argument 'logits'", "none");
  TS_EXPECT_ERROR(fwd(ints.view(), targets.view(), loss.view(), {}, {}), op, "argument 'logits'", "int32");
  TS_EXPECT_ERROR(fwd(flat.view(), targets.view(), loss.view(), {}, {}), op, "argument 'logits'", "2 dimensions");
  TS_EXPECT_ERROR(fwd(no_classes.view(), targets.view(), loss.view(), {}, {}), op, "argument 'logits'", "V >= 1");
  TensorView column(logits.data(), DType::kFloat32, {rows, classes}, {1, rows});
  TS_EXPECT_ERROR(fwd(column, targets.view(), loss.view(), {}, {}), op, "argument 'logits'", "stride 1");
  TS_EXPECT_ERROR(fwd(logits.view(), TensorView(), loss.view(), {}, {}), op, "argument 'targets'", "none");
  TS_EXPECT_ERROR(fwd(logits.view(), float_targets.view(), loss.view(), {}, {}), op, "argument 'targets'", "float32");
  TS_EXPECT_ERROR(fwd(logits.view(), short_targets.view(), loss.view(), {}, {}), op, "argument 'targets'",
                  "size 4 in dim 0");
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), TensorView(), {}, {}), op, "argument 'loss'", "none");
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), two_losses.view(), {}, {}), op, "argument 'loss'",
                  "one element for reduction 'mean'");
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), int_loss.view(), {}, {}), op, "argument 'loss'", "int32");
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), loss.view(), {}, {}, {.reduction = Reduction::kNone}), op,
                  "argument 'loss'", "1 dimensions");
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), two_losses.view(), {}, {}, {.reduction = Reduction::kNone}),
                  op, "argument 'loss'", "size 4 in dim 0");
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), loss.view(), f16_lse.view(), {}), op, "argument 'lse'",
                  "float16");
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), loss.view(), short_lse.view(), {}), op, "argument 'lse'",
                  "size 4");
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), loss.view(), {}, f16_grad.view()), op,
                  "argument 'grad_logits'", "float16");
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), loss.view(), {}, wide_grad.view()), op,
                  "argument 'grad_logits'", "[4, 7]");
  // Rows [0, V-1) and [1, V) of the same storage: overlapping, but not the same view.
  TensorView head(logits.data(), DType::kFloat32, {rows, classes - 1}, {classes, 1});
  TensorView shifted_by_one(static_cast<float*>(logits.data()) + 1, DType::kFloat32,
                            {rows, classes - 1}, {classes, 1});
  TS_EXPECT_ERROR(fwd(head, targets.view(), loss.view(), {}, shifted_by_one), op,
                  "argument 'grad_logits'", "disjoint from 'logits'");
  TensorView loss_in_logits(logits.data(), DType::kFloat32, {});
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), loss_in_logits, {}, {}), op, "argument 'loss'",
                  "disjoint from 'logits'");
  TensorView lse_in_logits(logits.data(), DType::kFloat32, {rows});
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), loss.view(), lse_in_logits, {}), op, "argument 'lse'",
                  "disjoint from 'logits'");
  TensorView loss_in_targets(targets.data(), DType::kFloat32, {});
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), loss_in_targets, {}, {}), op, "argument 'loss'",
                  "disjoint from 'targets'");
  TensorView lse_in_loss(per_row.data(), DType::kFloat32, {rows});
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), per_row.view(), lse_in_loss, {}, {.reduction = Reduction::kNone}),
                  op, "argument 'lse'", "disjoint from 'loss'");
  TensorView logits_one_row(logits.data(), DType::kFloat32, {1, classes});
  auto one_target = HostTensor::from_values(DType::kInt64, {1}, {0});
  TensorView lse_one(lse.data(), DType::kFloat32, {1});
  TensorView grad_over_lse(lse.data(), DType::kFloat32, {1, classes});
  TS_EXPECT_ERROR(fwd(logits_one_row, one_target.view(), loss.view(), lse_one, grad_over_lse), op,
                  "argument 'grad_logits'", "memory disjoint from");
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), loss.view(), {}, {}, {.label_smoothing = 1.5}), op,
                  "argument 'options.label_smoothing'", "[0, 1]", "1.5");
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), loss.view(), {}, {}, {.label_smoothing = NAN}), op,
                  "argument 'options.label_smoothing'", "nan");
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), loss.view(), {}, {}, {.z_loss = -0.1}), op,
                  "argument 'options.z_loss'", ">= 0", "-0.1");
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), loss.view(), {}, {}, {.softcap = -1}), op,
                  "argument 'options.softcap'", ">= 0", "-1");
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), loss.view(), {}, {}, {.softcap = INFINITY}), op,
                  "argument 'options.softcap'", "inf");
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), loss.view(), {}, {}, {.reduction = static_cast<Reduction>(7)}),
                  op, "argument 'options.reduction'", "none, mean or sum", "7");
  TS_EXPECT_ERROR(fwd(logits.view(), targets.view(), loss.view(), {}, {}, {.kernel = static_cast<CrossEntropyKernel>(5)}),
                  op, "argument 'options.kernel'", "auto, held, streamed or held_direct", "5");
  TensorView cuda_logits = logits.view(), cuda_targets = targets.view(), cuda_loss = loss.view();
  cuda_logits.device = cuda_targets.device = cuda_loss.device = Device::cuda(0);
  TS_EXPECT_ERROR(fwd(cuda_logits, targets.view(), loss.view(), {}, {}), op, "argument 'targets'", "cuda:0");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) TS_EXPECT_ERROR(fwd(cuda_logits, cuda_targets, cuda_loss, {}, {}), op, "CUDA");

  const char* bop = "cross_entropy_backward";
  auto bwd = [&](const TensorView& g, const TensorView& x, const TensorView& t, const TensorView& s,
                 TensorView dx, CrossEntropyOptions o = {}) { cross_entropy_backward(g, x, t, s, dx, o); };
  TS_EXPECT_ERROR(bwd(loss.view(), ints.view(), targets.view(), lse.view(), grad.view()), bop, "argument 'logits'",
                  "int32");
  TS_EXPECT_ERROR(bwd(loss.view(), logits.view(), short_targets.view(), lse.view(), grad.view()), bop,
                  "argument 'targets'", "size 4");
  TS_EXPECT_ERROR(bwd(TensorView(), logits.view(), targets.view(), lse.view(), grad.view()), bop,
                  "argument 'grad_loss'", "none");
  TS_EXPECT_ERROR(bwd(two_losses.view(), logits.view(), targets.view(), lse.view(), grad.view(), {.reduction = Reduction::kSum}),
                  bop, "argument 'grad_loss'", "one element for reduction 'sum'");
  TS_EXPECT_ERROR(bwd(loss.view(), logits.view(), targets.view(), lse.view(), grad.view(), {.reduction = Reduction::kNone}),
                  bop, "argument 'grad_loss'", "1 dimensions");
  TS_EXPECT_ERROR(bwd(loss.view(), logits.view(), targets.view(), TensorView(), grad.view()), bop, "argument 'lse'",
                  "none");
  TS_EXPECT_ERROR(bwd(loss.view(), logits.view(), targets.view(), short_lse.view(), grad.view()), bop,
                  "argument 'lse'", "size 4");
  TS_EXPECT_ERROR(bwd(loss.view(), logits.view(), targets.view(), lse.view(), TensorView()), bop,
                  "argument 'grad_logits'", "none");
  TS_EXPECT_ERROR(bwd(loss.view(), logits.view(), targets.view(), lse.view(), f16_grad.view()), bop,
                  "argument 'grad_logits'", "float16");
  TS_EXPECT_ERROR(bwd(loss.view(), head, targets.view(), lse.view(), shifted_by_one),
                  bop, "argument 'grad_logits'", "disjoint from 'logits'");
  TS_EXPECT_ERROR(bwd(loss.view(), logits_one_row, one_target.view(), lse_one, grad_over_lse), bop,
                  "argument 'grad_logits'", "memory disjoint from");
  // The next three views are larger than the buffer they start in and may also reach a
  // neighbouring heap block checked earlier: only the argument and the error kind are certain.
  TensorView grad_loss_one(per_row.data(), DType::kFloat32, {1});
  TensorView grad_over_grad_loss(per_row.data(), DType::kFloat32, {1, classes});
  TS_EXPECT_ERROR(bwd(grad_loss_one, logits_one_row, one_target.view(), lse_one, grad_over_grad_loss,
                      {.reduction = Reduction::kNone}),
                  bop, "argument 'grad_logits'", "memory disjoint from");
  TS_EXPECT_ERROR(bwd(loss.view(), logits.view(), targets.view(), lse.view(),
                      TensorView(targets.data(), DType::kFloat32, {rows, classes})),
                  bop, "argument 'grad_logits'", "memory disjoint from");
  TS_EXPECT_ERROR(bwd(loss.view(), logits.view(), targets.view(), lse.view(), grad.view(), {.z_loss = NAN}), bop,
                  "argument 'options.z_loss'");
  TensorView cuda_lse = lse.view(), cuda_grad = grad.view();
  cuda_lse.device = cuda_grad.device = Device::cuda(0);
  if (!test::cuda_available()) TS_EXPECT_ERROR(bwd(cuda_loss, cuda_logits, cuda_targets, cuda_lse, cuda_grad), bop, "CUDA");
}

// ---- fused linear cross-entropy ----

struct LinearProblem {
  HostTensor hidden, weight, bias, targets;
};

LinearProblem make_linear_problem(DType dt, std::int64_t tokens, std::int64_t dim,
                                  std::int64_t classes, std::int64_t ignore_index) {
  return {HostTensor::random(dt, {tokens, dim}, -1, 1, /*row_pad=*/2),
          HostTensor::random(dt, {classes, dim}, -1, 1, /*row_pad=*/1),
          HostTensor::random(dt, {classes}, -0.5, 0.5),
          make_targets(DType::kInt64, tokens, classes, ignore_index)};
}

// hidden @ weight^T + bias, in double, from the stored values.
std::vector<double> explicit_logits(const LinearProblem& p) {
  const std::int64_t tokens = p.hidden.shape()[0], dim = p.hidden.shape()[1];
  const std::int64_t classes = p.weight.shape()[0];
  const auto h = p.hidden.values(), w = p.weight.values(), b = p.bias.values();
  std::vector<double> logits(tokens * classes);
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t v = 0; v < classes; ++v) {
      double s = b[v];
      for (std::int64_t k = 0; k < dim; ++k) s += h[t * dim + k] * w[v * dim + k];
      logits[t * classes + v] = s;
    }
  }
  return logits;
}

struct LinearResult {
  HostTensor loss, lse, grad_hidden, grad_weight, grad_bias;
};

LinearResult run_flce(const LinearProblem& p, DType stat, const CrossEntropyOptions& o,
                      std::int64_t chunk_rows = 0) {
  const std::int64_t tokens = p.hidden.shape()[0];
  LinearResult r{loss_tensor(stat, tokens, o.reduction), HostTensor(stat, {tokens}),
                 HostTensor(p.hidden.dtype(), p.hidden.shape(), /*row_pad=*/3),
                 HostTensor(p.weight.dtype(), p.weight.shape()), HostTensor(p.bias.dtype(), p.bias.shape())};
  if (chunk_rows == 0) {
    fused_linear_cross_entropy_forward({.hidden = p.hidden.view(), .weight = p.weight.view(),
                                        .bias = p.bias.view(), .targets = p.targets.view(),
                                        .loss = r.loss.view(), .lse = r.lse.view(),
                                        .grad_hidden = r.grad_hidden.view(),
                                        .grad_weight = r.grad_weight.view(),
                                        .grad_bias = r.grad_bias.view()}, o);
  } else {
    ops::loss::fused_linear_cross_entropy_forward_cpu(
        {.hidden = p.hidden.view(), .weight = p.weight.view(), .bias = p.bias.view(),
         .targets = p.targets.view(), .loss = r.loss.view(), .lse = r.lse.view(),
         .grad_hidden = r.grad_hidden.view(), .grad_weight = r.grad_weight.view(),
         .grad_bias = r.grad_bias.view()},
        o, chunk_rows);
  }
  return r;
}

TEST(FusedLinearCrossEntropy, EqualsCrossEntropyOnExplicitLogits) {
  const std::int64_t tokens = 11, dim = 9, classes = 13;
  for (const auto& oc : option_cases()) {
    for (Reduction red : kReductions) {
      const auto o = with_reduction(oc.options, red);
      for (DType dt : kAllFloatTypes) {
        const DType stat = dt == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
        const auto p = make_linear_problem(dt, tokens, dim, classes, o.ignore_index);
        const LinearResult r = run_flce(p, stat, o);

        // cross_entropy_forward in fp64 on the explicit logits, then the chain rule by hand.
        auto logits = HostTensor::from_values(DType::kFloat64, {tokens, classes}, explicit_logits(p));
        auto loss = loss_tensor(DType::kFloat64, tokens, red);
        HostTensor lse(DType::kFloat64, {tokens}), grad_logits(DType::kFloat64, {tokens, classes});
        cross_entropy_forward(logits.view(), p.targets.view(), loss.view(), lse.view(), grad_logits.view(), o);
        const auto g = grad_logits.values(), h = p.hidden.values(), w = p.weight.values();
        std::vector<double> gh(tokens * dim, 0.0), gw(classes * dim, 0.0), gb(classes, 0.0);
        for (std::int64_t t = 0; t < tokens; ++t) {
          for (std::int64_t v = 0; v < classes; ++v) {
            gb[v] += g[t * classes + v];
            for (std::int64_t k = 0; k < dim; ++k) {
              gh[t * dim + k] += g[t * classes + v] * w[v * dim + k];
              gw[v * dim + k] += g[t * classes + v] * h[t * dim + k];
            }
          }
        }
        const std::string what = case_name(oc, red, dt);
        EXPECT_TRUE(test::matches_reference(r.loss.values(), loss.values(), test::tolerance(stat))) << what;
        EXPECT_TRUE(test::matches_reference(r.lse.values(), lse.values(), test::tolerance(stat))) << what;
        EXPECT_TRUE(test::matches_reference(r.grad_hidden.values(), gh, test::tolerance(dt))) << what;
        EXPECT_TRUE(test::matches_reference(r.grad_weight.values(), gw, test::tolerance(dt))) << what;
        EXPECT_TRUE(test::matches_reference(r.grad_bias.values(), gb, test::tolerance(dt))) << what;
      }
    }
  }
}

TEST(FusedLinearCrossEntropy, GradientsMatchFiniteDifferences) {
  const std::int64_t tokens = 4, dim = 3, classes = 5;
  for (Reduction red : kReductions) {
    for (const auto& oc : {option_cases().front(), option_cases().back()}) {
      const auto o = with_reduction(oc.options, red);
      const auto p = make_linear_problem(DType::kFloat64, tokens, dim, classes, o.ignore_index);
      const LinearResult r = run_flce(p, DType::kFloat64, o);
      // Upstream gradient 1: the sum of the loss output (per row for kNone).
      auto total_loss = [&](const LinearProblem& q) {
        const auto values = run_flce(q, DType::kFloat64, o).loss.values();
        return test::dot(values, std::vector<double>(values.size(), 1.0));
      };
      auto perturbed = [&](HostTensor LinearProblem::*member) {
        return test::numeric_gradient((p.*member).values(), [&](const std::vector<double>& x) {
          LinearProblem q = p;
          for (std::size_t i = 0; i < x.size(); ++i) (q.*member).set(static_cast<std::int64_t>(i), x[i]);
          return total_loss(q);
        });
      };
      const std::string what = case_name(oc, red, DType::kFloat64);
      EXPECT_TRUE(test::matches_reference(r.grad_hidden.values(), perturbed(&LinearProblem::hidden), 1e-7)) << what;
      EXPECT_TRUE(test::matches_reference(r.grad_weight.values(), perturbed(&LinearProblem::weight), 1e-7)) << what;
      EXPECT_TRUE(test::matches_reference(r.grad_bias.values(), perturbed(&LinearProblem::bias), 1e-7)) << what;
    }
  }
}

// With grad_loss, the gradients are those of sum_t grad_loss[t] * loss[t] (kNone) or of
// grad_loss * loss (reduced).
TEST(FusedLinearCrossEntropy, UpstreamGradientScalesTheGradients) {
  const std::int64_t tokens = 4, dim = 3, classes = 5;
  for (Reduction red : kReductions) {
    const auto o = with_reduction(option_cases().back().options, red);
    const auto p = make_linear_problem(DType::kFloat64, tokens, dim, classes, o.ignore_index);
    const bool per_row = red == Reduction::kNone;
    const std::vector<double> upstream = per_row ? std::vector<double>{0.5, -2.0, 3.0, 0.25} : std::vector<double>{-1.5};
    const auto grad_loss = HostTensor::from_values(DType::kFloat64, per_row ? std::vector<std::int64_t>{tokens}
                                                                           : std::vector<std::int64_t>{},
                                                   upstream);
    auto run = [&](const LinearProblem& q, bool with_upstream) {
      LinearResult r{loss_tensor(DType::kFloat64, tokens, red), HostTensor(DType::kFloat64, {tokens}),
                     HostTensor(DType::kFloat64, q.hidden.shape()), HostTensor(DType::kFloat64, q.weight.shape()),
                     HostTensor(DType::kFloat64, q.bias.shape())};
      fused_linear_cross_entropy_forward({.hidden = q.hidden.view(), .weight = q.weight.view(),
                                          .bias = q.bias.view(), .targets = q.targets.view(),
                                          .loss = r.loss.view(), .lse = r.lse.view(),
                                          .grad_loss = with_upstream ? grad_loss.view() : TensorView{},
                                          .grad_hidden = r.grad_hidden.view(),
                                          .grad_weight = r.grad_weight.view(),
                                          .grad_bias = r.grad_bias.view()},
                                         o);
      return r;
    };
    const LinearResult r = run(p, true);
    auto weighted_loss = [&](const LinearProblem& q) { return test::dot(run(q, false).loss.values(), upstream); };
    auto perturbed = [&](HostTensor LinearProblem::*member) {
      return test::numeric_gradient((p.*member).values(), [&](const std::vector<double>& x) {
        LinearProblem q = p;
        for (std::size_t i = 0; i < x.size(); ++i) (q.*member).set(static_cast<std::int64_t>(i), x[i]);
        return weighted_loss(q);
      });
    };
    const char* what = reduction_name(red);
    EXPECT_TRUE(test::matches_reference(r.grad_hidden.values(), perturbed(&LinearProblem::hidden), 1e-7)) << what;
    EXPECT_TRUE(test::matches_reference(r.grad_weight.values(), perturbed(&LinearProblem::weight), 1e-7)) << what;
    EXPECT_TRUE(test::matches_reference(r.grad_bias.values(), perturbed(&LinearProblem::bias), 1e-7)) << what;
  }
}

TEST(FusedLinearCrossEntropy, PlanBoundsTheLiveLogits) {
  using ops::loss::default_chunk_tokens;
  // Llama-3 8B's head: 512 MiB of bf16 logits hold 2092 rows of 128256; a multiple of 128.
  EXPECT_EQ(default_chunk_tokens(8192, 128256, 2), 2048);
  EXPECT_EQ(default_chunk_tokens(100, 128256, 2), 100);  // all fit
  EXPECT_EQ(default_chunk_tokens(1 << 20, std::int64_t{1} << 40, 4), 128);  // at least a tile
  const std::int64_t tokens = 8192, dim = 4096, classes = 128256;
  TensorView h(nullptr, DType::kBFloat16, {tokens, dim}), w(nullptr, DType::kBFloat16, {classes, dim});
  TensorView t(nullptr, DType::kInt64, {tokens}), loss(nullptr, DType::kFloat32, {});
  TensorView gw(nullptr, DType::kBFloat16, {classes, dim});
  FusedLinearCrossEntropyArgs a{.hidden = h, .weight = w, .targets = t, .loss = loss, .grad_weight = gw};
  // Summed in float32: all 8192 tokens' logits (2 GiB) cost less than a 2048-token chunk and
  // the [V, H] float32 buffer, so one chunk (the product accumulates in float32 by itself).
  auto p = ops::loss::plan_fused_linear(a, {});
  EXPECT_EQ(p.chunks, 1);
  EXPECT_EQ(p.logits_ld, classes);
  EXPECT_FALSE(p.float_weight_acc);
  EXPECT_LT(p.bytes, std::size_t{tokens} * classes * 2 + (std::size_t{64} << 20));
  a.chunk_tokens = 2048;  // asked for: four chunks and the buffer
  p = ops::loss::plan_fused_linear(a, {});
  EXPECT_EQ(p.chunks, 4);
  EXPECT_TRUE(p.float_weight_acc);
  EXPECT_GE(p.bytes, std::size_t{2048} * classes * 2 + std::size_t{classes} * dim * 4);
  a.chunk_tokens = 0;
  a.hidden = TensorView(nullptr, DType::kBFloat16, {4 * tokens, dim});  // logits exceed that
  a.targets = TensorView(nullptr, DType::kInt64, {4 * tokens});
  p = ops::loss::plan_fused_linear(a, {});
  EXPECT_EQ(p.chunk_tokens, 2 * dim);  // as many logits bytes as the float32 buffer
  EXPECT_EQ(p.chunks, 4);
  EXPECT_TRUE(p.float_weight_acc);
  a.grad_weight_accumulation = DType::kBFloat16;  // in place: no [V, H] buffer, bounded memory
  p = ops::loss::plan_fused_linear(a, {});
  EXPECT_EQ(p.chunk_tokens, 2048);
  EXPECT_FALSE(p.float_weight_acc);
  EXPECT_LT(p.bytes, std::size_t{600} << 20);
  // Odd vocabularies pad the logits' rows to 16 bytes.
  a.weight = TensorView(nullptr, DType::kBFloat16, {13, dim});
  EXPECT_EQ(ops::loss::plan_fused_linear(a, {}).logits_ld, 16);
}

TEST(FusedLinearCrossEntropy, ChunkSizeDoesNotChangeABit) {
  const auto o = with_reduction(option_cases().back().options, Reduction::kMean);
  const auto p = make_linear_problem(DType::kBFloat16, 2 * ops::loss::kFusedLinearChunkRows + 5, 8, 17,
                                     o.ignore_index);
  const LinearResult by_default = run_flce(p, DType::kFloat32, o);
  for (std::int64_t chunk_rows : {1, 7}) {
    const LinearResult r = run_flce(p, DType::kFloat32, o, chunk_rows);
    EXPECT_EQ(r.loss.values(), by_default.loss.values()) << chunk_rows;
    EXPECT_EQ(r.lse.values(), by_default.lse.values()) << chunk_rows;
    EXPECT_EQ(r.grad_hidden.values(), by_default.grad_hidden.values()) << chunk_rows;
    EXPECT_EQ(r.grad_weight.values(), by_default.grad_weight.values()) << chunk_rows;
    EXPECT_EQ(r.grad_bias.values(), by_default.grad_bias.values()) << chunk_rows;
  }
}

TEST(FusedLinearCrossEntropy, WithoutBiasOrGradients) {
  const std::int64_t tokens = 5, dim = 4, classes = 6;
  const auto p = make_linear_problem(DType::kFloat32, tokens, dim, classes, -100);
  HostTensor loss(DType::kFloat32, {}), grad_weight(DType::kFloat32, {classes, dim});
  fused_linear_cross_entropy_forward({.hidden = p.hidden.view(), .weight = p.weight.view(),
                                      .targets = p.targets.view(), .loss = loss.view(),
                                      .grad_weight = grad_weight.view()});
  LinearProblem no_bias = p;
  for (std::int64_t v = 0; v < classes; ++v) no_bias.bias.set(v, 0.0);
  const LinearResult r = run_flce(no_bias, DType::kFloat32, {});
  EXPECT_TRUE(test::matches_reference(loss.values(), r.loss.values(), 1e-6));
  EXPECT_TRUE(test::matches_reference(grad_weight.values(), r.grad_weight.values(), 1e-6));
}

TEST(FusedLinearCrossEntropy, EmptyBatchAndNaN) {
  const auto empty = make_linear_problem(DType::kFloat32, 0, 4, 6, -100);
  const LinearResult r = run_flce(empty, DType::kFloat32, {.reduction = Reduction::kSum});
  EXPECT_EQ(r.loss.at(0), 0.0);
  for (double g : r.grad_weight.values()) EXPECT_EQ(g, 0.0);
  for (double g : r.grad_bias.values()) EXPECT_EQ(g, 0.0);

  auto p = make_linear_problem(DType::kFloat16, 4, 3, 5, -100);
  p.targets = HostTensor::from_values(DType::kInt32, {4}, {0, 1, 2, 3});
  p.hidden.set(1 * 3 + 2, NAN);
  const LinearResult n = run_flce(p, DType::kFloat32, {.reduction = Reduction::kNone});
  EXPECT_TRUE(std::isnan(n.loss.at(1)) && std::isnan(n.lse.at(1)));
  EXPECT_TRUE(std::isfinite(n.loss.at(0)) && std::isfinite(n.loss.at(2)) && std::isfinite(n.loss.at(3)));
  EXPECT_TRUE(std::isnan(n.grad_hidden.at(1 * 3)));
  EXPECT_TRUE(std::isfinite(n.grad_hidden.at(0)));
}

TEST(FusedLinearCrossEntropy, InputErrors) {
  const std::int64_t tokens = 4, dim = 3, classes = 5;
  const auto p = make_linear_problem(DType::kFloat32, tokens, dim, classes, -100);
  const char* op = "fused_linear_cross_entropy_forward";
  HostTensor loss(DType::kFloat32, {}), lse(DType::kFloat32, {tokens});
  HostTensor gh(DType::kFloat32, {tokens, dim}), gw(DType::kFloat32, {classes, dim}), gb(DType::kFloat32, {classes});
  struct Args {
    TensorView hidden, weight, bias, targets, loss, lse, gh, gw, gb;
    CrossEntropyOptions o;
  };
  const Args good{p.hidden.view(), p.weight.view(), p.bias.view(), p.targets.view(), loss.view(), lse.view(),
                  gh.view(), gw.view(), gb.view(), {}};
  auto call = [](const Args& a) {
    fused_linear_cross_entropy_forward({.hidden = a.hidden, .weight = a.weight, .bias = a.bias,
                                        .targets = a.targets, .loss = a.loss, .lse = a.lse,
                                        .grad_hidden = a.gh, .grad_weight = a.gw, .grad_bias = a.gb},
                                       a.o);
  };
  call(good);
  HostTensor h16(DType::kFloat16, {tokens, dim}), w_wide(DType::kFloat32, {classes, dim + 1});
  HostTensor w_empty(DType::kFloat32, {0, dim}), b_short(DType::kFloat32, {classes - 1});
  HostTensor b2d(DType::kFloat32, {1, classes}), t_short(DType::kInt64, {tokens + 1});
  HostTensor l_rows(DType::kFloat32, {tokens - 1}), gb_short(DType::kFloat32, {classes - 1});
  HostTensor gh_wide(DType::kFloat32, {tokens, dim + 1}), gw16(DType::kFloat16, {classes, dim});
  HostTensor h1d(DType::kFloat32, {tokens * dim});
  auto with = [&](auto edit) {
    Args a = good;
    edit(a);
    return a;
  };
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.hidden = TensorView(); })), op, "argument 'hidden'", "none");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.hidden = h1d.view(); })), op, "argument 'hidden'", "2 dimensions");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.weight = h16.view(); })), op, "argument 'weight'", "float16");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.weight = w_wide.view(); a.gw = TensorView(); })), op,
                  "argument 'weight'", "hidden size of 'hidden'");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.weight = w_empty.view(); })), op, "argument 'weight'", "V >= 1");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.bias = b_short.view(); })), op, "argument 'bias'", "size 5");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.bias = b2d.view(); })), op, "argument 'bias'", "1 dimensions");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.bias = h16.view(); })), op, "argument 'bias'", "float16");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.targets = t_short.view(); })), op, "argument 'targets'",
                  "one per row of 'hidden'");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.loss = l_rows.view(); a.o.reduction = Reduction::kNone; })), op,
                  "argument 'loss'", "size 4");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.lse = l_rows.view(); })), op, "argument 'lse'", "size 4");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.o.softcap = -2; })), op, "argument 'options.softcap'");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.gh = gh_wide.view(); })), op, "argument 'grad_hidden'", "[4, 4]");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.gw = gw16.view(); })), op, "argument 'grad_weight'", "float16");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.gb = gb_short.view(); })), op, "argument 'grad_bias'", "[5]");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.bias = TensorView(); })), op, "argument 'grad_bias'", "'bias'");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.gh = a.hidden; })), op, "argument 'grad_hidden'",
                  "disjoint from 'hidden'");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.gw = a.weight; })), op, "argument 'grad_weight'",
                  "disjoint from 'weight'");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.gb = a.bias; })), op, "argument 'grad_bias'", "disjoint from 'bias'");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.loss = TensorView(a.targets.data, DType::kFloat32, {}); })), op,
                  "argument 'loss'", "disjoint from 'targets'");
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.gb = TensorView(gw.data(), DType::kFloat32, {classes}); })), op,
                  "argument 'grad_bias'", "disjoint from 'grad_weight'");
  const auto bad_targets = HostTensor::from_values(DType::kInt64, {tokens}, {0, 1, 9, 2});
  TS_EXPECT_ERROR(call(with([&](Args& a) { a.targets = bad_targets.view(); })),
                  op, "argument 'targets'", "targets[2] = 9");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(call(with([&](Args& a) {
                      for (TensorView* t : {&a.hidden, &a.weight, &a.bias, &a.targets, &a.loss, &a.lse, &a.gh, &a.gw, &a.gb}) {
                        t->device = Device::cuda(0);
                      }
                    })),
                    op, "CUDA");
  }
}

// kAuto streams the loss alone on long rows when there are enough of them (a gradient keeps the
// row held); a forced kernel is obeyed.
TEST(CrossEntropyHeuristics, LossAloneStreamsLongRows) {
  using ops::loss::cross_entropy_streams_loss;
  constexpr auto kAuto = CrossEntropyKernel::kAuto;
  EXPECT_TRUE(cross_entropy_streams_loss(kAuto, 8192, 128256 / 8, false));
  EXPECT_TRUE(cross_entropy_streams_loss(kAuto, 256, 1025, false));
  EXPECT_FALSE(cross_entropy_streams_loss(kAuto, 8192, 128256 / 8, true));
  EXPECT_FALSE(cross_entropy_streams_loss(kAuto, 255, 1025, false));
  EXPECT_FALSE(cross_entropy_streams_loss(kAuto, 32768, 1024, false));
  EXPECT_TRUE(cross_entropy_streams_loss(CrossEntropyKernel::kStreamed, 1, 1, false));
  EXPECT_FALSE(cross_entropy_streams_loss(CrossEntropyKernel::kHeld, 8192, 128256 / 8, false));
}

// kAuto loads the loss alone's aligned rows of 129-1024 slots over 4096 rows or more straight
// into registers; a gradient, a misaligned row or another length keeps the ring; a forced kernel
// is obeyed.
TEST(CrossEntropyHeuristics, LossAloneOnShortAlignedRowsTakesTheDirectFeed) {
  using ops::loss::cross_entropy_held_direct;
  constexpr auto kAuto = CrossEntropyKernel::kAuto;
  EXPECT_TRUE(cross_entropy_held_direct(kAuto, true, 4096, 129, false));
  EXPECT_TRUE(cross_entropy_held_direct(kAuto, true, 32768, 1024, false));
  EXPECT_FALSE(cross_entropy_held_direct(kAuto, true, 32768, 1024, true));
  EXPECT_FALSE(cross_entropy_held_direct(kAuto, false, 32768, 1024, false));
  EXPECT_FALSE(cross_entropy_held_direct(kAuto, true, 4095, 1024, false));
  EXPECT_FALSE(cross_entropy_held_direct(kAuto, true, 32768, 128, false));
  EXPECT_FALSE(cross_entropy_held_direct(kAuto, true, 32768, 1025, false));
  EXPECT_TRUE(cross_entropy_held_direct(CrossEntropyKernel::kHeldDirect, true, 1, 4096, true));
  EXPECT_FALSE(cross_entropy_held_direct(CrossEntropyKernel::kHeld, true, 32768, 1024, false));
}

}  // namespace
}  // namespace trainscale
