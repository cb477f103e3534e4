// MSE kernels, through the public entry points, against the fp64 CPU reference on float64
// copies of the same rounded inputs: every reduction, every dtype, the 16-byte and scalar
// paths, M = 0, NaN/Inf, optional gradients, determinism of the reduction (bit-identical
// across calls and concurrent streams) and CUDA-graph capture.
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "util/strided_device_buffer.h"
#include "trainscale/loss.h"

namespace trainscale {
namespace {

using test::HostTensor;
using test::Layout;
using test::StridedDeviceBuffer;
using Values = std::vector<double>;

constexpr DType kDtypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
constexpr Reduction kReductions[] = {Reduction::kNone, Reduction::kMean, Reduction::kSum};

std::vector<Layout> layouts() {
  return {{1, 1, 0, false},    {3, 7, 0, false},    {5, 127, 0, false},   {4, 1000, 0, false},
          {2, 4097, 0, false}, {9, 1000, 24, false}, {5, 1003, 13, false}, {64, 8, 8, false},
          {7, 127, 3, false},  {6, 520, 8, true},   {0, 64, 0, false},
          // Many times the units the reduction's 8 x 1024 threads take in one step (the
          // elementwise kernel's multi-step walk is covered by activation_cuda_test).
          {160, 4100, 4, false}};
}

// One float32 on the device (a reduced loss or its upstream gradient).
class DeviceScalar {
 public:
  explicit DeviceScalar(double v = std::nan(""))
      : host_(test::HostTensor::from_values(DType::kFloat32, {1}, {v})), device_(host_) {}
  TensorView view() const { return device_.view(); }
  float value() const {
    const test::HostTensor h = device_.to_host();
    float v;
    std::memcpy(&v, h.data(), sizeof(v));
    return v;
  }

 private:
  test::HostTensor host_;
  test::DeviceTensor device_;
};

std::string trace(DType dt, const Layout& l, Reduction r) {
  return test::describe(dt, l) + " reduction " + reduction_name(r);
}

void check_forward(DType dt, const Layout& l, Reduction r, bool specials) {
  SCOPED_TRACE(trace(dt, l, r) + (specials ? " with NaN/Inf" : ""));
  const std::int64_t n = l.rows * l.cols;
  const Values a = test::random_inputs(dt, n, 0, -3, 3, specials);
  const Values b = test::random_inputs(dt, n, 1, -3, 3, specials);
  StridedDeviceBuffer d_a(dt, l, &a), d_b(dt, l, &b);
  auto a64 = test::as_f64(a, l.rows, l.cols), b64 = test::as_f64(b, l.rows, l.cols);
  if (r == Reduction::kNone) {
    const double tol = test::tolerance(dt);
    StridedDeviceBuffer d_out(dt, l);
    mse_forward(d_a.view(), d_b.view(), d_out.view(), r);
    HostTensor out64(DType::kFloat64, {l.rows, l.cols});
    mse_forward(a64.view(), b64.view(), out64.view(), r);
    EXPECT_TRUE(test::matches_reference(d_out.values(), test::rounded(dt, out64), tol)) << "out";
    EXPECT_TRUE(d_out.padding_untouched());
    return;
  }
  DeviceScalar d_out;
  mse_forward(d_a.view(), d_b.view(), d_out.view(), r);
  HostTensor out64(DType::kFloat64, {1});
  mse_forward(a64.view(), b64.view(), out64.view(), r);
  const double ref = detail::round_to(DType::kFloat32, out64.at(0));
  // The loss is a sum of squares: fp32 accumulation error only (inputs are exact in fp32).
  EXPECT_TRUE(test::matches_reference({d_out.value()}, {ref}, 1e-5)) << "out";
  // Deterministic: the same bits on a second call.
  DeviceScalar again;
  mse_forward(d_a.view(), d_b.view(), again.view(), r);
  const float first = d_out.value(), second = again.value();
  EXPECT_EQ(0, std::memcmp(&first, &second, sizeof(float))) << first << " vs " << second;
}

void check_backward(DType dt, const Layout& l, Reduction r, int which) {
  // which: 0 both gradients, 1 grad_a only, 2 grad_b only.
  SCOPED_TRACE(trace(dt, l, r) + " gradients " + std::to_string(which));
  const std::int64_t n = l.rows * l.cols;
  const Values a = test::random_inputs(dt, n, 0, -3, 3);
  const Values b = test::random_inputs(dt, n, 1, -3, 3);
  StridedDeviceBuffer d_a(dt, l, &a), d_b(dt, l, &b), d_ga(dt, l), d_gb(dt, l);
  auto a64 = test::as_f64(a, l.rows, l.cols), b64 = test::as_f64(b, l.rows, l.cols);
  HostTensor ga64(DType::kFloat64, {l.rows, l.cols}), gb64(DType::kFloat64, {l.rows, l.cols});
  const TensorView ga = which == 2 ? TensorView{} : d_ga.view();
  const TensorView gb = which == 1 ? TensorView{} : d_gb.view();
  if (r == Reduction::kNone) {
    const Values g = test::random_inputs(dt, n, 2, -1, 1);
    StridedDeviceBuffer d_g(dt, l, &g);
    mse_backward(d_g.view(), d_a.view(), d_b.view(), ga, gb, r);
    auto g64 = test::as_f64(g, l.rows, l.cols);
    mse_backward(g64.view(), a64.view(), b64.view(), ga64.view(), gb64.view(), r);
  } else {
    const double g = 0.75;
    DeviceScalar d_g(g);
    mse_backward(d_g.view(), d_a.view(), d_b.view(), ga, gb, r);
    auto g64 = HostTensor::from_values(DType::kFloat64, {1}, {g});
    mse_backward(g64.view(), a64.view(), b64.view(), ga64.view(), gb64.view(), r);
  }
  const double tol = test::tolerance(dt);
  if (which != 2) {
    EXPECT_TRUE(test::matches_reference(d_ga.values(), test::rounded(dt, ga64), tol)) << "grad_a";
    EXPECT_TRUE(d_ga.padding_untouched());
  }
  if (which != 1) {
    EXPECT_TRUE(test::matches_reference(d_gb.values(), test::rounded(dt, gb64), tol)) << "grad_b";
    EXPECT_TRUE(d_gb.padding_untouched());
  }
  // An absent gradient's memory is never written.
  const Values poison(static_cast<std::size_t>(n), std::nan(""));
  if (which == 2) {
    EXPECT_TRUE(test::matches_reference(d_ga.values(), poison, 0));
  }
  if (which == 1) {
    EXPECT_TRUE(test::matches_reference(d_gb.values(), poison, 0));
  }
}

TEST(MseCuda, ForwardMatchesReference) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (const Layout& l : layouts())
      for (Reduction r : kReductions)
        for (bool specials : {false, true}) check_forward(dt, l, r, specials);
}

TEST(MseCuda, BackwardMatchesReference) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (const Layout& l : layouts())
      for (Reduction r : kReductions)
        for (int which : {0, 1, 2}) check_backward(dt, l, r, which);
}

TEST(MseCuda, ReductionOfEmptyInput) {
  TS_REQUIRE_GPU();
  const Layout l{0, 64, 0, false};
  StridedDeviceBuffer d_a(DType::kBFloat16, l), d_b(DType::kBFloat16, l);
  DeviceScalar sum(5.0), mean(5.0);
  mse_forward(d_a.view(), d_b.view(), sum.view(), Reduction::kSum);
  mse_forward(d_a.view(), d_b.view(), mean.view(), Reduction::kMean);
  EXPECT_EQ(sum.value(), 0.f);
  EXPECT_TRUE(std::isnan(mean.value()));  // 0 / 0, as the reference
}

// Concurrent reductions on two streams (nothing shared between calls) give the same bits as
// a serial call, and a captured graph replays to them too.
TEST(MseCuda, ConcurrentStreamsAndGraphAreBitIdentical) {
  TS_REQUIRE_GPU();
  const Layout l{512, 4096, 0, false};
  const DType dt = DType::kBFloat16;
  const Values a = test::random_inputs(dt, l.rows * l.cols, 0, -3, 3, false);
  const Values b = test::random_inputs(dt, l.rows * l.cols, 1, -3, 3, false);
  const Values c = test::random_inputs(dt, l.rows * l.cols, 2, -3, 3, false);
  StridedDeviceBuffer d_a(dt, l, &a), d_b(dt, l, &b), d_c(dt, l, &c);
  DeviceScalar serial_ab, serial_ac, s1, s2, graph_ab;
  mse_forward(d_a.view(), d_b.view(), serial_ab.view(), Reduction::kMean);
  mse_forward(d_a.view(), d_c.view(), serial_ac.view(), Reduction::kMean);
  cudaStream_t st1 = nullptr, st2 = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&st1, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&st2, cudaStreamNonBlocking), cudaSuccess);
  for (int rep = 0; rep < 4; ++rep) {
    mse_forward(d_a.view(), d_b.view(), s1.view(), Reduction::kMean, st1);
    mse_forward(d_a.view(), d_c.view(), s2.view(), Reduction::kMean, st2);
  }
  ASSERT_EQ(cudaStreamSynchronize(st1), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(st2), cudaSuccess);
  const auto bits = [](float v) {
    std::uint32_t u;
    std::memcpy(&u, &v, sizeof(u));
    return u;
  };
  EXPECT_EQ(bits(s1.value()), bits(serial_ab.value()));
  EXPECT_EQ(bits(s2.value()), bits(serial_ac.value()));

  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(st1, cudaStreamCaptureModeGlobal), cudaSuccess);
  mse_forward(d_a.view(), d_b.view(), graph_ab.view(), Reduction::kMean, st1);
  ASSERT_EQ(cudaStreamEndCapture(st1, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, st1), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(st1), cudaSuccess);
  EXPECT_EQ(bits(graph_ab.value()), bits(serial_ab.value()));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st1);
  cudaStreamDestroy(st2);
}

}  // namespace
}  // namespace trainscale
