#include "trainscale/loss.h"
#include "util/gpu_util.h"

namespace trainscale {
namespace {

using test::HostTensor;

double mse_value(const std::vector<double>& a, const std::vector<double>& b, Reduction r) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
  return r == Reduction::kMean ? s / static_cast<double>(a.size()) : s;
}

class MseReduction : public ::testing::TestWithParam<Reduction> {};

TEST_P(MseReduction, ForwardMatchesClosedFormEveryDtype) {
  const Reduction red = GetParam();
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64}) {
    for (std::int64_t n : {1, 7, 128}) {
      auto a = HostTensor::random(dt, {5, n}, -2, 2, /*row_pad=*/3);
      auto b = HostTensor::random(dt, {5, n}, -2, 2);
      if (red == Reduction::kNone) {
        HostTensor out(dt, {5, n}, 1);
        mse_forward(a.view(), b.view(), out.view(), red);
        std::vector<double> ref(a.numel());
        for (std::int64_t i = 0; i < a.numel(); ++i) ref[i] = (a.at(i) - b.at(i)) * (a.at(i) - b.at(i));
        EXPECT_TRUE(test::matches_reference(out.values(), ref, test::tolerance(dt)));
      } else {
        HostTensor out(DType::kFloat32, {});
        mse_forward(a.view(), b.view(), out.view(), red);
        EXPECT_NEAR(out.at(0), mse_value(a.values(), b.values(), red),
                    1e-6 * std::max(1.0, out.at(0)));
      }
    }
  }
}

TEST_P(MseReduction, BackwardMatchesFiniteDifferences) {
  const Reduction red = GetParam();
  auto a = HostTensor::random(DType::kFloat64, {3, 5});
  auto b = HostTensor::random(DType::kFloat64, {3, 5});
  const auto w = test::random_values(red == Reduction::kNone ? 15 : 1);
  auto loss = [&](const std::vector<double>& av, const std::vector<double>& bv) {
    if (red != Reduction::kNone) return w[0] * mse_value(av, bv, red);
    double s = 0;
    for (std::size_t i = 0; i < av.size(); ++i) s += w[i] * (av[i] - bv[i]) * (av[i] - bv[i]);
    return s;
  };
  HostTensor grad_out = red == Reduction::kNone
                            ? HostTensor::from_values(DType::kFloat64, {3, 5}, w)
                            : HostTensor::from_values(DType::kFloat32, {}, w);
  if (red != Reduction::kNone) grad_out.set(0, w[0]);
  // The float32 upstream gradient is what the loss sees.
  const std::vector<double> w_used = grad_out.values();
  auto loss_used = [&](const std::vector<double>& av, const std::vector<double>& bv) {
    if (red != Reduction::kNone) return w_used[0] * mse_value(av, bv, red);
    return loss(av, bv);
  };
  HostTensor ga(DType::kFloat64, {3, 5}), gb(DType::kFloat64, {3, 5});
  mse_backward(grad_out.view(), a.view(), b.view(), ga.view(), gb.view(), red);
  const auto bv = b.values(), av = a.values();
  auto num_a = test::numeric_gradient(av, [&](const auto& x) { return loss_used(x, bv); });
  auto num_b = test::numeric_gradient(bv, [&](const auto& x) { return loss_used(av, x); });
  EXPECT_TRUE(test::matches_reference(ga.values(), num_a, 1e-7));
  EXPECT_TRUE(test::matches_reference(gb.values(), num_b, 1e-7));
}

INSTANTIATE_TEST_SUITE_P(All, MseReduction,
                         ::testing::Values(Reduction::kNone, Reduction::kMean, Reduction::kSum),
                         [](const auto& param_info) { return std::string(reduction_name(param_info.param)); });

TEST(Mse, EmptyAndNaN) {
  HostTensor a(DType::kFloat32, {0, 8}), b(DType::kFloat32, {0, 8}), out(DType::kFloat32, {});
  mse_forward(a.view(), b.view(), out.view(), Reduction::kSum);
  EXPECT_EQ(out.at(0), 0.0);
  auto x = HostTensor::random(DType::kBFloat16, {2, 3});
  auto y = HostTensor::random(DType::kBFloat16, {2, 3});
  x.set(4, NAN);
  mse_forward(x.view(), y.view(), out.view(), Reduction::kMean);
  EXPECT_TRUE(std::isnan(out.at(0)));
}

TEST(Mse, InputErrors) {
  auto a = HostTensor::random(DType::kFloat32, {4, 8});
  auto b = HostTensor::random(DType::kFloat32, {4, 7});
  auto b16 = HostTensor::random(DType::kFloat16, {4, 8});
  HostTensor out(DType::kFloat32, {}), out2(DType::kFloat32, {2});
  TS_EXPECT_ERROR(mse_forward(a.view(), b.view(), out.view(), Reduction::kSum), "mse_forward",
                  "argument 'b'", "shape [4, 8]", "[4, 7]");
  TS_EXPECT_ERROR(mse_forward(a.view(), b16.view(), out.view(), Reduction::kSum), "argument 'b'",
                  "float16");
  TS_EXPECT_ERROR(mse_forward(a.view(), a.view(), out2.view(), Reduction::kSum), "'out'",
                  "one element");
  TS_EXPECT_ERROR(mse_forward(a.view(), a.view(), a.view(), Reduction::kNone), "'out'",
                  "disjoint");
  HostTensor ints(DType::kInt32, {4, 8});
  TS_EXPECT_ERROR(mse_forward(ints.view(), ints.view(), out.view(), Reduction::kSum), "'a'",
                  "int32");
  TensorView cuda_a = a.view();
  cuda_a.device = Device::cuda(0);
  TensorView cuda_out = out.view();
  cuda_out.device = Device::cuda(0);
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(mse_forward(cuda_a, cuda_a, cuda_out, Reduction::kSum), "mse_forward",
                    "CUDA");
  }
  TS_EXPECT_ERROR(mse_backward(out.view(), a.view(), a.view(), TensorView(), b.view(),
                               Reduction::kSum),
                  "mse_backward", "'grad_b'");
}

}  // namespace
}  // namespace trainscale
