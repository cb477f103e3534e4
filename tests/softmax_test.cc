#include <cmath>
#include <limits>

#include "trainscale/softmax.h"
#include "util/test_util.h"

namespace trainscale {
namespace {

using test::HostTensor;

constexpr auto kAllFloatTypes = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64};
constexpr double kInf = std::numeric_limits<double>::infinity();

// Independent formulation: exp(x - log(sum exp(x))), with the log-sum taken around the mean
// rather than the maximum.
std::vector<double> softmax_rows(const std::vector<double>& x, std::int64_t n) {
  std::vector<double> y(x.size());
  for (std::size_t r = 0; r < x.size() / n; ++r) {
    const double* row = &x[r * n];
    double mean = 0;
    for (std::int64_t j = 0; j < n; ++j) mean += row[j] / static_cast<double>(n);
    double sum = 0;
    for (std::int64_t j = 0; j < n; ++j) sum += std::exp(row[j] - mean);
    const double log_z = mean + std::log(sum);
    for (std::int64_t j = 0; j < n; ++j) y[r * n + j] = std::exp(row[j] - log_z);
  }
  return y;
}

std::vector<double> run_softmax(const HostTensor& x) {
  HostTensor y(x.dtype(), x.shape());
  softmax_forward(x.view(), y.view());
  return y.values();
}

TEST(Softmax, ForwardMatchesDirectComputationEveryDtype) {
  for (DType dt : kAllFloatTypes) {
    for (std::int64_t n : {1, 7, 257}) {
      auto x = HostTensor::random(dt, {2, 3, n}, -4, 4, /*row_pad=*/5);
      HostTensor y(dt, {2, 3, n}, /*row_pad=*/2);
      softmax_forward(x.view(), y.view());
      EXPECT_TRUE(test::matches_reference(y.values(), softmax_rows(x.values(), n), test::tolerance(dt)))
          << dtype_name(dt) << " n=" << n;
    }
  }
}

TEST(Softmax, ForwardInPlace) {
  for (DType dt : kAllFloatTypes) {
    auto x = HostTensor::random(dt, {9, 33}, -3, 3, /*row_pad=*/1);
    const auto ref = softmax_rows(x.values(), 33);
    softmax_forward(x.view(), x.view());
    EXPECT_TRUE(test::matches_reference(x.values(), ref, test::tolerance(dt))) << dtype_name(dt);
  }
}

TEST(Softmax, RowsSumToOneAndShiftInvariant) {
  const std::int64_t m = 70, n = 31;  // more rows than one thread's chunk
  auto x = HostTensor::random(DType::kFloat64, {m, n}, -10, 10);
  const auto y = run_softmax(x);
  for (std::int64_t i = 0; i < m; ++i) {
    double s = 0;
    for (std::int64_t j = 0; j < n; ++j) s += y[i * n + j];
    EXPECT_NEAR(s, 1.0, 1e-13) << "row " << i;
  }
  auto shifted = x;
  for (std::int64_t i = 0; i < x.numel(); ++i) shifted.set(i, x.at(i) + 37.0);
  EXPECT_TRUE(test::matches_reference(run_softmax(shifted), y, 1e-12));
}

TEST(Softmax, HugeLogitsStayFinite) {
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    auto x = HostTensor::random(dt, {4, 9}, -3, 3);
    auto big = x;
    for (std::int64_t i = 0; i < x.numel(); ++i) big.set(i, x.at(i) + 1e4);
    const auto y = run_softmax(big);
    for (double v : y) EXPECT_TRUE(std::isfinite(v));
    // float32 stores 1e4 + x with spacing ~1e-3, so compare against the stored values.
    auto centered = HostTensor(DType::kFloat64, {4, 9});
    for (std::int64_t i = 0; i < x.numel(); ++i) centered.set(i, big.at(i) - 1e4);
    EXPECT_TRUE(test::matches_reference(y, softmax_rows(centered.values(), 9), test::tolerance(dt)));
  }
}

TEST(Softmax, InfinitiesAndNaN) {
  auto x = HostTensor::random(DType::kFloat32, {4, 6}, -2, 2);
  x.set(1, -kInf);  // row 0: one masked entry
  for (std::int64_t j = 0; j < 6; ++j) x.set(6 + j, -kInf);  // row 1: fully masked
  x.set(14, NAN);  // row 2
  const auto y = run_softmax(x);
  EXPECT_EQ(y[1], 0.0);
  double row0 = 0;
  for (std::int64_t j = 0; j < 6; ++j) row0 += y[j];
  EXPECT_NEAR(row0, 1.0, 1e-6);
  for (std::int64_t j = 0; j < 6; ++j) {
    EXPECT_TRUE(std::isnan(y[6 + j])) << "all -inf row, column " << j;
    EXPECT_TRUE(std::isnan(y[12 + j])) << "NaN row, column " << j;
    EXPECT_TRUE(std::isfinite(y[18 + j])) << "clean row, column " << j;
  }
}

TEST(Softmax, EmptyRowsAreFine) {
  HostTensor x(DType::kBFloat16, {0, 16}), y(DType::kBFloat16, {0, 16});
  softmax_forward(x.view(), y.view());
  softmax_backward(x.view(), x.view(), y.view());
}

TEST(Softmax, BackwardMatchesFiniteDifferences) {
  const std::int64_t m = 3, n = 7;
  auto x = HostTensor::random(DType::kFloat64, {m, n}, -2, 2);
  const auto w = test::random_values(m * n);
  auto loss = [&](const std::vector<double>& xv) {
    auto t = HostTensor::from_values(DType::kFloat64, {m, n}, xv);
    return test::dot(w, run_softmax(t));
  };
  HostTensor y(DType::kFloat64, {m, n}), dx(DType::kFloat64, {m, n}, /*row_pad=*/3);
  softmax_forward(x.view(), y.view());
  auto dy = HostTensor::from_values(DType::kFloat64, {m, n}, w);
  softmax_backward(dy.view(), y.view(), dx.view());
  EXPECT_TRUE(test::matches_reference(dx.values(), test::numeric_gradient(x.values(), loss), 1e-7));
}

TEST(Softmax, BackwardEveryDtypeAndInPlace) {
  for (DType dt : kAllFloatTypes) {
    const std::int64_t n = 129;
    auto x = HostTensor::random(dt, {5, n}, -3, 3);
    HostTensor y(dt, {5, n}, /*row_pad=*/4);
    softmax_forward(x.view(), y.view());
    auto dy = HostTensor::random(dt, {5, n}, -1, 1, /*row_pad=*/2);
    std::vector<double> ref(dy.numel());
    for (std::int64_t i = 0; i < 5; ++i) {
      double dot = 0;
      for (std::int64_t j = 0; j < n; ++j) dot += dy.at(i * n + j) * y.at(i * n + j);
      for (std::int64_t j = 0; j < n; ++j) ref[i * n + j] = y.at(i * n + j) * (dy.at(i * n + j) - dot);
    }
    HostTensor dx(dt, {5, n});
    softmax_backward(dy.view(), y.view(), dx.view());
    EXPECT_TRUE(test::matches_reference(dx.values(), ref, test::tolerance(dt))) << dtype_name(dt);
    softmax_backward(dy.view(), y.view(), dy.view());
    EXPECT_EQ(dy.values(), dx.values()) << dtype_name(dt);
  }
}

TEST(Softmax, BackwardPropagatesNaN) {
  auto y = HostTensor::random(DType::kFloat32, {3, 4}, 0, 1);
  auto dy = HostTensor::random(DType::kFloat32, {3, 4});
  dy.set(5, NAN);
  HostTensor dx(DType::kFloat32, {3, 4});
  softmax_backward(dy.view(), y.view(), dx.view());
  for (std::int64_t j = 0; j < 4; ++j) {
    EXPECT_TRUE(std::isnan(dx.at(4 + j)));
    EXPECT_TRUE(std::isfinite(dx.at(j)) && std::isfinite(dx.at(8 + j)));
  }
}

TEST(Softmax, InputErrors) {
  auto x = HostTensor::random(DType::kFloat32, {4, 8});
  HostTensor y(DType::kFloat32, {4, 8}), y_short(DType::kFloat32, {4, 7}), y16(DType::kFloat16, {4, 8});
  HostTensor ints(DType::kInt32, {4, 8});
  TS_EXPECT_ERROR(softmax_forward(TensorView(), y.view()), "softmax_forward", "argument 'x'", "a tensor", "none");
  TS_EXPECT_ERROR(softmax_forward(ints.view(), y.view()), "softmax_forward", "argument 'x'", "int32");
  TS_EXPECT_ERROR(softmax_forward(x.view(), TensorView()), "softmax_forward", "argument 'y'", "none");
  TS_EXPECT_ERROR(softmax_forward(x.view(), y_short.view()), "softmax_forward", "argument 'y'", "[4, 8]", "[4, 7]");
  TS_EXPECT_ERROR(softmax_forward(x.view(), y16.view()), "softmax_forward", "argument 'y'", "float16");
  TensorView null_x = x.view();
  null_x.data = nullptr;
  TS_EXPECT_ERROR(softmax_forward(null_x, y.view()), "softmax_forward", "argument 'x'", "non-null");
  TensorView column(x.data(), DType::kFloat32, {4, 8}, {1, 4});
  TS_EXPECT_ERROR(softmax_forward(column, y.view()), "softmax_forward", "argument 'x'", "stride 1");
  TensorView shifted(static_cast<float*>(x.data()) + 1, DType::kFloat32, {4, 8});
  TS_EXPECT_ERROR(softmax_forward(x.view(), shifted), "softmax_forward", "argument 'y'", "disjoint from 'x'");
  TensorView cuda_x = x.view(), cuda_y = y.view();
  cuda_x.device = cuda_y.device = Device::cuda(0);
  TS_EXPECT_ERROR(softmax_forward(cuda_x, y.view()), "softmax_forward", "argument 'y'", "cuda:0");
  TS_EXPECT_ERROR(softmax_forward(cuda_x, cuda_y), "softmax_forward", "CUDA");

  auto dy = HostTensor::random(DType::kFloat32, {4, 8});
  HostTensor dx(DType::kFloat32, {4, 8});
  TS_EXPECT_ERROR(softmax_backward(ints.view(), y.view(), dx.view()), "softmax_backward", "argument 'dy'", "int32");
  TS_EXPECT_ERROR(softmax_backward(dy.view(), y16.view(), dx.view()), "softmax_backward", "argument 'y'", "float16");
  TS_EXPECT_ERROR(softmax_backward(dy.view(), y.view(), y_short.view()), "softmax_backward", "argument 'dx'", "[4, 7]");
  TS_EXPECT_ERROR(softmax_backward(dy.view(), y.view(), TensorView()), "softmax_backward", "argument 'dx'", "none");
  TS_EXPECT_ERROR(softmax_backward(dy.view(), y.view(), y.view()), "softmax_backward", "argument 'dx'", "disjoint from 'y'");
  TensorView dy_shifted(static_cast<float*>(dy.data()) + 8, DType::kFloat32, {3, 8});
  TensorView dx_overlap(static_cast<float*>(dy.data()), DType::kFloat32, {3, 8});
  TS_EXPECT_ERROR(softmax_backward(dy_shifted, y.view(), dx_overlap), "softmax_backward", "argument 'y'", "[3, 8]");
  TensorView y3(y.data(), DType::kFloat32, {3, 8});
  TS_EXPECT_ERROR(softmax_backward(dy_shifted, y3, dx_overlap), "softmax_backward", "argument 'dx'", "disjoint from 'dy'");
  TensorView cuda_dx = dx.view();
  cuda_dx.device = Device::cuda(0);
  TS_EXPECT_ERROR(softmax_backward(cuda_x, cuda_y, cuda_dx), "softmax_backward", "CUDA");
}

}  // namespace
}  // namespace trainscale
