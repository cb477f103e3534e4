// Cross-entropy kernels, through the public entry points, against the fp64 CPU reference on
// float64 copies of the same rounded logits: every dtype, vocabularies from 1 to 262144,
// strided and misaligned rows, every option, int32 and int64 targets, every reduction, the
// gradient in the forward pass (also in place over the logits) and from the saved lse, NaN / Inf
// logits, all rows ignored, out-of-range targets, and bit-identical losses run to run.
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "trainscale/error.h"
#include "trainscale/loss.h"
#include "util/strided_device_buffer.h"

namespace trainscale {
namespace {

using test::DeviceTensor;
using test::HostTensor;
using test::Layout;
using test::StridedDeviceBuffer;
using Values = std::vector<double>;

constexpr DType kDtypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
constexpr Reduction kReductions[] = {Reduction::kNone, Reduction::kMean, Reduction::kSum};
constexpr double kInf = std::numeric_limits<double>::infinity();
// loss and lse are float32 whatever the logits' dtype, computed in float32 from exact inputs.
constexpr double kStatTolerance = 1e-5;

struct Case {
  DType dt;
  Layout l;
  DType target_dt = DType::kInt64;
  CrossEntropyOptions o{};
  bool grad = true;
  bool in_place = false;
  double lo = -6, hi = 6;  // logits
  double ignored_fraction = 0.2;
};

std::string describe(const Case& c) {
  return test::describe(c.dt, c.l) + " targets " + dtype_name(c.target_dt) + " reduction " +
         reduction_name(c.o.reduction) + " smoothing " + std::to_string(c.o.label_smoothing) +
         " z " + std::to_string(c.o.z_loss) + " softcap " + std::to_string(c.o.softcap) +
         (c.grad ? c.in_place ? " grad in place" : " grad" : "");
}

Values random_targets(const Case& c) {
  Values t(static_cast<std::size_t>(c.l.rows));
  std::uniform_int_distribution<std::int64_t> cls(0, c.l.cols - 1);
  std::uniform_real_distribution<double> u(0, 1);
  for (double& v : t) {
    v = u(test::rng()) < c.ignored_fraction ? static_cast<double>(c.o.ignore_index)
                                            : static_cast<double>(cls(test::rng()));
  }
  return t;
}

// One element of float32 on the host (a reduced loss) or [rows].
HostTensor loss_like(const Case& c, DType dt) {
  return c.o.reduction == Reduction::kNone ? HostTensor(dt, {c.l.rows}) : HostTensor(dt, {1});
}

struct Outputs {
  Values loss, lse, grad;
};

// The forward on the device (poisoned outputs), given logits values and targets.
Outputs run_device_forward(const Case& c, const Values& x, const HostTensor& targets) {
  StridedDeviceBuffer d_x(c.dt, c.l, &x), d_g(c.dt, c.l);
  DeviceTensor d_t(targets);
  DeviceTensor d_loss(loss_like(c, DType::kFloat32), false), d_lse(HostTensor(DType::kFloat32, {c.l.rows}), false);
  const TensorView grad = !c.grad ? TensorView{} : c.in_place ? d_x.view() : d_g.view();
  cross_entropy_forward(d_x.view(), d_t.view(), d_loss.view(), d_lse.view(), grad, c.o);
  Outputs out{d_loss.to_host().values(), d_lse.to_host().values(), {}};
  if (c.grad) {
    const StridedDeviceBuffer& g = c.in_place ? d_x : d_g;
    out.grad = g.values();
    EXPECT_TRUE(g.padding_untouched());
  }
  return out;
}

Outputs run_reference_forward(const Case& c, const Values& x, const HostTensor& targets) {
  auto x64 = test::as_f64(x, c.l.rows, c.l.cols);
  HostTensor loss = loss_like(c, DType::kFloat64), lse(DType::kFloat64, {c.l.rows});
  HostTensor grad(DType::kFloat64, {c.l.rows, c.l.cols});
  cross_entropy_forward(x64.view(), targets.view(), loss.view(), lse.view(),
                        c.grad ? grad.view() : TensorView{}, c.o);
  Outputs out{test::rounded(DType::kFloat32, loss), test::rounded(DType::kFloat32, lse), {}};
  if (c.grad) out.grad = test::rounded(c.dt, grad);
  return out;
}

void check_forward(const Case& c, bool specials = false) {
  SCOPED_TRACE(describe(c) + (specials ? " with NaN/Inf" : ""));
  Values x = test::random_inputs(c.dt, c.l.rows * c.l.cols, 0, c.lo, c.hi, false);
  if (specials && c.l.rows >= 4) {
    const std::int64_t n = c.l.cols;
    x[n / 2] = std::nan("");                         // row 0: NaN
    x[n + n - 1] = kInf;                             // row 1: +inf
    for (std::int64_t j = 0; j < n; ++j) x[2 * n + j] = -kInf;  // row 2: all -inf
    x[3 * n] = -kInf;                                // row 3: one -inf
    // Row 4: finite logits far below 0 among -inf, so that exp(0 - lse) overflows float for the
    // threads holding only -inf.
    if (c.l.rows >= 5) {
      for (std::int64_t j = 0; j < n; ++j) x[4 * n + j] = j % 97 == 0 ? -200.0 : -kInf;
    }
  }
  const HostTensor targets = HostTensor::from_values(c.target_dt, {c.l.rows}, random_targets(c));
  const Outputs got = run_device_forward(c, x, targets);
  const Outputs ref = run_reference_forward(c, x, targets);
  EXPECT_TRUE(test::matches_reference(got.loss, ref.loss, kStatTolerance)) << "loss";
  EXPECT_TRUE(test::matches_reference(got.lse, ref.lse, kStatTolerance)) << "lse";
  if (c.grad) {
    EXPECT_TRUE(test::matches_reference(got.grad, ref.grad, test::tolerance(c.dt))) << "grad";
  }
}

void check_backward(const Case& c) {
  SCOPED_TRACE(describe(c) + " backward");
  const Values x = test::random_inputs(c.dt, c.l.rows * c.l.cols, 0, c.lo, c.hi, false);
  const HostTensor targets = HostTensor::from_values(c.target_dt, {c.l.rows}, random_targets(c));
  // lse from the reference forward, as float32 the way a device forward saves it.
  auto x64 = test::as_f64(x, c.l.rows, c.l.cols);
  HostTensor loss64 = loss_like(c, DType::kFloat64), lse64(DType::kFloat64, {c.l.rows});
  cross_entropy_forward(x64.view(), targets.view(), loss64.view(), lse64.view(), {}, c.o);
  const HostTensor lse32 = HostTensor::from_values(DType::kFloat32, {c.l.rows}, lse64.values());
  const HostTensor lse_back = HostTensor::from_values(DType::kFloat64, {c.l.rows}, lse32.values());
  HostTensor grad_loss = loss_like(c, DType::kFloat32);
  const Values gl = test::random_values(grad_loss.numel(), 0.5, 2);
  for (std::int64_t i = 0; i < grad_loss.numel(); ++i) grad_loss.set(i, gl[i]);
  const HostTensor grad_loss64 = HostTensor::from_values(DType::kFloat64, grad_loss.shape(), grad_loss.values());

  StridedDeviceBuffer d_x(c.dt, c.l, &x), d_g(c.dt, c.l);
  DeviceTensor d_t(targets), d_lse(lse32), d_gl(grad_loss);
  const StridedDeviceBuffer& out = c.in_place ? d_x : d_g;
  cross_entropy_backward(d_gl.view(), d_x.view(), d_t.view(), d_lse.view(), out.view(), c.o);
  HostTensor g64(DType::kFloat64, {c.l.rows, c.l.cols});
  cross_entropy_backward(grad_loss64.view(), x64.view(), targets.view(), lse_back.view(), g64.view(), c.o);
  EXPECT_TRUE(test::matches_reference(out.values(), test::rounded(c.dt, g64), test::tolerance(c.dt)));
  EXPECT_TRUE(out.padding_untouched());
}

std::vector<Layout> layouts() {
  std::vector<Layout> out;
  for (std::int64_t n : {1, 3, 17, 1000, 4096, 8193, 32768, 131072, 262144}) {
    const std::int64_t rows = n <= 1000 ? 300 : n <= 8193 ? 9 : n <= 32768 ? 5 : 2;
    out.push_back({rows, n, 0, false});
  }
  out.push_back({7, 4096, 8, false});
  out.push_back({5, 1000, 3, false});
  out.push_back({6, 520, 8, true});
  out.push_back({3, 40000, 5, true});
  return out;
}

TEST(CrossEntropyCuda, ForwardMatchesReference) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (const Layout& l : layouts())
      for (Reduction r : kReductions) {
        Case c{dt, l};
        c.o.reduction = r;
        c.grad = r != Reduction::kSum;  // loss and lse alone once per layout
        check_forward(c);
      }
}

// More long rows with the gradient than the held kernel's persistent grid has clusters, so each
// cluster reduces several rows in turn (its reduction scratch alternating between two buffers
// by row): bf16 / fp16 N 40000 in clusters of 2, float32 in clusters of 4; plain, misaligned and
// strided in place, and softcapped.
TEST(CrossEntropyCuda, ManyLongRowsPerCluster) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (const Layout& l : {Layout{300, 40000, 0, false}, Layout{257, 39997, 5, true}}) {
      Case c{dt, l};
      c.o.reduction = Reduction::kMean;
      c.in_place = l.shift;
      check_forward(c);
      c.o.softcap = 5;
      c.lo = -60;
      c.hi = 60;
      check_forward(c);
    }
}

TEST(CrossEntropyCuda, EveryOption) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (const Layout& l : {Layout{40, 1000, 0, false}, Layout{3, 70000, 0, false}, Layout{9, 333, 3, true}})
      for (DType target_dt : {DType::kInt32, DType::kInt64})
        for (Reduction r : kReductions) {
          Case c{dt, l, target_dt};
          c.o.reduction = r;
          c.o.ignore_index = 7;
          c.o.label_smoothing = 0.1;
          c.o.z_loss = 1e-3;
          check_forward(c);
          c.o.softcap = 5;
          c.lo = -60;  // large logits: tanh saturates
          c.hi = 60;
          check_forward(c);
          check_backward(c);
          c.o.label_smoothing = 1.0;  // smoothing alone: the target's term drops out
          c.o.softcap = 0;
          check_forward(c);
        }
}

// The loss alone on enough long rows streams them (cross_entropy_streams_loss): every dtype,
// misaligned and padded rows, a row length past one batch of the block with a tail, every option
// and reduction, NaN / Inf logits.
TEST(CrossEntropyCuda, LossAloneStreamed) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (const Layout& l : {Layout{260, 8200, 0, false}, Layout{257, 8193, 3, true}, Layout{256, 40000, 8, false}})
      for (Reduction r : kReductions) {
        Case c{dt, l, r == Reduction::kSum ? DType::kInt32 : DType::kInt64};
        c.o.reduction = r;
        c.grad = false;
        check_forward(c);
        check_forward(c, /*specials=*/true);
        c.o.ignore_index = 7;
        c.o.label_smoothing = 0.1;
        c.o.z_loss = 1e-3;
        c.o.softcap = 5;
        c.lo = -60;
        c.hi = 60;
        check_forward(c);
      }
}

// Each kernel forced on shapes kAuto gives the other (few rows, short rows, one row of 1 logit);
// the streamed kernel with a gradient asked for is refused.
TEST(CrossEntropyCuda, ForcedKernels) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes) {
    for (const Layout& l : {Layout{300, 8192, 0, false}, Layout{5, 40000, 3, true}, Layout{40, 1000, 0, false},
                            Layout{1, 1, 0, false}}) {
      for (CrossEntropyKernel kernel : {CrossEntropyKernel::kHeld, CrossEntropyKernel::kStreamed}) {
        Case c{dt, l};
        c.o.kernel = kernel;
        c.o.reduction = Reduction::kNone;
        c.grad = false;
        check_forward(c);
        c.o.label_smoothing = 0.2;
        c.o.softcap = 3;
        c.o.reduction = Reduction::kMean;
        check_forward(c);
      }
    }
  }
  Case c{DType::kBFloat16, {4, 64, 0, false}};
  c.o.kernel = CrossEntropyKernel::kStreamed;
  const Values x = test::random_inputs(c.dt, 4 * 64, 0, -3, 3, false);
  const HostTensor targets = HostTensor::from_values(c.target_dt, {4}, random_targets(c));
  EXPECT_THROW(run_device_forward(c, x, targets), UnsupportedVariantError);
}

// kHeldDirect forced (aligned rows of 129-32768 slots straight into registers, a block of 64
// (four rows to a block) to 1024 threads, clusters of 2, 4 or 8 beyond 4096 slots): every split,
// strided by whole slots, with the gradient (in place too), the options, NaN/Inf; the softcap,
// misaligned rows and rows outside the range throw.
TEST(CrossEntropyCuda, HeldDirectFeedRows) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes) {
    const auto v = static_cast<std::int64_t>(16 / dtype_size(dt));
    for (const Layout& l : {Layout{9, 129 * v, 0, false}, Layout{7, 512 * v, v, false},
                            Layout{6, 1025 * v, 0, false}, Layout{5, 4096 * v, v, false},
                            Layout{5, 4097 * v, 0, false}, Layout{3, 16032 * v, 0, false},
                            Layout{2, 32768 * v, 0, false}}) {
      Case c{dt, l};
      c.o.kernel = CrossEntropyKernel::kHeldDirect;
      check_forward(c);
      check_forward(c, /*specials=*/true);
      c.in_place = true;
      c.o.label_smoothing = 0.1;
      c.o.z_loss = 1e-3;
      c.o.reduction = Reduction::kSum;
      check_forward(c);
      c.grad = false;
      check_forward(c);
    }
    const auto refused = [&](Layout l, double softcap) {
      Case c{dt, l};
      c.o.kernel = CrossEntropyKernel::kHeldDirect;
      c.o.softcap = softcap;
      SCOPED_TRACE(describe(c));
      const Values x = test::random_inputs(c.dt, l.rows * l.cols, 0, -3, 3, false);
      const HostTensor targets = HostTensor::from_values(c.target_dt, {l.rows}, random_targets(c));
      EXPECT_THROW(run_device_forward(c, x, targets), UnsupportedVariantError);
    };
    refused({2, 2048 * v, 0, false}, 5.0);
    refused({2, 128 * v, 0, false}, 0.0);
    refused({2, 32769 * v, 0, false}, 0.0);
    refused({2, 2048 * v - 1, 0, false}, 0.0);
    refused({2, 2048 * v, 0, true}, 0.0);
  }
}

TEST(CrossEntropyCuda, GradientInPlace) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (const Layout& l : {Layout{20, 4096, 0, false}, Layout{2, 131072, 0, false}, Layout{5, 777, 5, true}})
      for (Reduction r : kReductions) {
        Case c{dt, l};
        c.o.reduction = r;
        c.in_place = true;
        check_forward(c);
        check_backward(c);
      }
}

TEST(CrossEntropyCuda, BackwardMatchesReference) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (const Layout& l : layouts())
      for (Reduction r : kReductions) {
        Case c{dt, l, dt == DType::kFloat16 ? DType::kInt32 : DType::kInt64};
        c.o.reduction = r;
        c.grad = false;
        check_backward(c);
      }
}

TEST(CrossEntropyCuda, NanInfLogits) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (std::int64_t n : {5, 1000, 40000})
      for (Reduction r : kReductions) {
        Case c{dt, {6, n, 0, false}};
        c.o.reduction = r;
        c.ignored_fraction = 0;
        check_forward(c, /*specials=*/true);
      }
}

TEST(CrossEntropyCuda, AllRowsIgnoredAndEmpty) {
  TS_REQUIRE_GPU();
  for (Reduction r : kReductions) {
    Case c{DType::kBFloat16, {16, 1000, 0, false}};
    c.o.reduction = r;
    c.ignored_fraction = 1;
    check_forward(c);  // kMean: 0 / 0 = NaN, zero gradients
    check_backward(c);
    Case empty{DType::kBFloat16, {0, 1000, 0, false}};
    empty.o.reduction = r;
    check_forward(empty);
  }
}

// Out-of-range targets are not checked on the device: that row's loss and gradient are NaN,
// the others as usual (the CPU path throws instead).
TEST(CrossEntropyCuda, OutOfRangeTargetGivesNan) {
  TS_REQUIRE_GPU();
  Case c{DType::kFloat32, {4, 100, 0, false}};
  c.o.reduction = Reduction::kNone;
  const Values x = test::random_inputs(c.dt, 400, 0, -3, 3, false);
  const HostTensor targets = HostTensor::from_values(DType::kInt64, {4}, {1, 100, -1, 99});
  const Outputs got = run_device_forward(c, x, targets);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(std::isnan(got.loss[r]), r == 1 || r == 2) << r;
    EXPECT_EQ(std::isnan(got.grad[r * 100 + 50]), r == 1 || r == 2) << r;
    EXPECT_FALSE(std::isnan(got.lse[r])) << r;
  }
}

// Two forwards of the same inputs: the reduced loss and the gradient, bit for bit.
void expect_same_bits_run_to_run(const Case& c) {
  const Values x = test::random_inputs(c.dt, c.l.rows * c.l.cols, 0, -6, 6, false);
  const HostTensor targets = HostTensor::from_values(c.target_dt, {c.l.rows}, random_targets(c));
  const Outputs a = run_device_forward(c, x, targets), b = run_device_forward(c, x, targets);
  const float fa = static_cast<float>(a.loss[0]), fb = static_cast<float>(b.loss[0]);
  EXPECT_EQ(0, std::memcmp(&fa, &fb, sizeof(float))) << fa << " vs " << fb;
  EXPECT_EQ(a.grad, b.grad);
}

TEST(CrossEntropyCuda, ReducedLossIsBitIdentical) {
  TS_REQUIRE_GPU();
  for (Reduction r : {Reduction::kMean, Reduction::kSum}) {
    Case c{DType::kBFloat16, {3000, 4096, 0, false}};
    c.o.reduction = r;
    c.o.label_smoothing = 0.1;
    expect_same_bits_run_to_run(c);
  }
}

// Rows enough for the row reductions to span several blocks (launch_row_reduction: 8192 rows a
// block, at most 32): kMean's count and the loss's sum against the reference, with ignored
// rows, with and without the gradient, the backward's count, and the same bits run to run.
TEST(CrossEntropyCuda, RowReductionsOverSeveralBlocks) {
  TS_REQUIRE_GPU();
  for (const std::int64_t rows : {8193, 70001, 300000})
    for (Reduction r : {Reduction::kMean, Reduction::kSum})
      for (const bool grad : {false, true}) {
        Case c{DType::kBFloat16, {rows, 24, 0, false}};
        c.o.reduction = r;
        c.grad = grad;
        c.ignored_fraction = 0.3;
        check_forward(c);
        if (rows == 70001 && grad) {
          check_backward(c);
          expect_same_bits_run_to_run(c);
        }
      }
}

// The reduced loss's scratch is per stream: calls on two streams at once give the bits of a
// serial call, and a captured graph (after a first call sized the scratch) replays to them.
TEST(CrossEntropyCuda, ConcurrentStreamsAndGraphAreBitIdentical) {
  TS_REQUIRE_GPU();
  Case c{DType::kBFloat16, {2000, 4096, 0, false}};
  const Values x = test::random_inputs(c.dt, c.l.rows * c.l.cols, 0, -6, 6, false);
  const Values x2 = test::random_inputs(c.dt, c.l.rows * c.l.cols, 1, -6, 6, false);
  const HostTensor targets = HostTensor::from_values(c.target_dt, {c.l.rows}, random_targets(c));
  StridedDeviceBuffer d_x(c.dt, c.l, &x), d_x2(c.dt, c.l, &x2);
  DeviceTensor d_t(targets);
  const auto scalar = [] { return std::make_unique<DeviceTensor>(HostTensor(DType::kFloat32, {1}), false); };
  auto serial = scalar(), serial2 = scalar(), s1 = scalar(), s2 = scalar(), graphed = scalar();
  const auto bits = [](const DeviceTensor& t) {
    const HostTensor h = t.to_host();
    std::uint32_t u;
    std::memcpy(&u, h.data(), sizeof(u));
    return u;
  };
  cross_entropy_forward(d_x.view(), d_t.view(), serial->view(), {}, {});
  cross_entropy_forward(d_x2.view(), d_t.view(), serial2->view(), {}, {});
  cudaStream_t st1 = nullptr, st2 = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&st1, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&st2, cudaStreamNonBlocking), cudaSuccess);
  for (int rep = 0; rep < 4; ++rep) {
    cross_entropy_forward(d_x.view(), d_t.view(), s1->view(), {}, {}, {}, st1);
    cross_entropy_forward(d_x2.view(), d_t.view(), s2->view(), {}, {}, {}, st2);
  }
  ASSERT_EQ(cudaStreamSynchronize(st1), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(st2), cudaSuccess);
  EXPECT_EQ(bits(*s1), bits(*serial));
  EXPECT_EQ(bits(*s2), bits(*serial2));

  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(st1, cudaStreamCaptureModeGlobal), cudaSuccess);
  cross_entropy_forward(d_x.view(), d_t.view(), graphed->view(), {}, {}, {}, st1);
  ASSERT_EQ(cudaStreamEndCapture(st1, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, st1), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(st1), cudaSuccess);
  EXPECT_EQ(bits(*graphed), bits(*serial));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st1);
  cudaStreamDestroy(st2);
}

// float64 is the CPU reference's alone (the kernels write float32 loss and lse).
TEST(CrossEntropyCuda, StatsMustBeFloat32) {
  TS_REQUIRE_GPU();
  StridedDeviceBuffer d_x(DType::kBFloat16, {4, 10, 0, false});
  DeviceTensor d_t(HostTensor::from_values(DType::kInt64, {4}, {1, 2, 3, 4}));
  DeviceTensor d_loss(HostTensor(DType::kFloat64, {1}));
  TS_EXPECT_ERROR(cross_entropy_forward(d_x.view(), d_t.view(), d_loss.view(), {}, {}),
                  "cross_entropy_forward", "loss", "CPU only");
}

}  // namespace
}  // namespace trainscale
