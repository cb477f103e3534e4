#include "trainscale/newton_schulz.h"

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include "ops/newton_schulz/newton_schulz_internal.h"
#include "util/gpu_util.h"

namespace trainscale {
namespace {

using test::HostTensor;

constexpr DType kFloatTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16,
                                 DType::kFloat64};
constexpr std::array<double, 3> kDefaultCoefficients{3.4445, -4.7750, 2.0315};

HostTensor run_newton_schulz(const HostTensor& g, const NewtonSchulzOptions& options = {}) {
  HostTensor out(g.dtype(), g.shape());
  newton_schulz(g.view(), out.view(), options);
  return out;
}

HostTensor transposed(const HostTensor& t) {
  const std::int64_t R = t.shape()[0], C = t.shape()[1];
  HostTensor r(t.dtype(), {C, R});
  for (std::int64_t i = 0; i < R; ++i) {
    for (std::int64_t j = 0; j < C; ++j) r.set(j * R + i, t.at(i * C + j));
  }
  return r;
}

// Diagonal ones plus small noise: singular values near 1, far from 0.
HostTensor well_conditioned(DType dtype, std::int64_t rows, std::int64_t cols) {
  auto g = HostTensor::random(dtype, {rows, cols}, -0.15, 0.15);
  for (std::int64_t i = 0; i < std::min(rows, cols); ++i)
    g.set(i * cols + i, 1.0 + g.at(i * cols + i));
  return g;
}

// Eigenvalues (ascending) of a symmetric n x n row-major matrix by cyclic Jacobi rotations.
std::vector<double> symmetric_eigenvalues(std::vector<double> a, std::int64_t n) {
  auto at = [&](std::int64_t i, std::int64_t j) -> double& { return a[i * n + j]; };
  for (int sweep = 0; sweep < 64; ++sweep) {
    double off_diagonal = 0, diagonal = 0;
    for (std::int64_t p = 0; p < n; ++p) {
      diagonal += at(p, p) * at(p, p);
      for (std::int64_t q = p + 1; q < n; ++q) off_diagonal += at(p, q) * at(p, q);
    }
    if (off_diagonal <= 1e-32 * diagonal) break;
    for (std::int64_t p = 0; p < n; ++p) {
      for (std::int64_t q = p + 1; q < n; ++q) {
        if (at(p, q) == 0) continue;
        const double theta = (at(q, q) - at(p, p)) / (2 * at(p, q));
        const double t =
            (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (std::int64_t k = 0; k < n; ++k) {  // columns p, q
          const double kp = at(k, p), kq = at(k, q);
          at(k, p) = c * kp - s * kq;
          at(k, q) = s * kp + c * kq;
        }
        for (std::int64_t k = 0; k < n; ++k) {  // rows p, q
          const double pk = at(p, k), qk = at(q, k);
          at(p, k) = c * pk - s * qk;
          at(q, k) = s * pk + c * qk;
        }
      }
    }
  }
  std::vector<double> eigenvalues(n);
  for (std::int64_t i = 0; i < n; ++i) eigenvalues[i] = at(i, i);
  std::sort(eigenvalues.begin(), eigenvalues.end());
  return eigenvalues;
}

// The min(R, C) singular values (ascending) of a [R, C] tensor, from its smaller Gram matrix.
std::vector<double> singular_values(const HostTensor& m) {
  const std::int64_t R = m.shape()[0], C = m.shape()[1], n = std::min(R, C);
  const auto v = m.values();
  auto element = [&](std::int64_t i, std::int64_t j) {
    return R <= C ? v[i * C + j] : v[j * C + i];
  };
  std::vector<double> gram(n * n, 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      for (std::int64_t p = 0; p < std::max(R, C); ++p)
        gram[i * n + j] += element(i, p) * element(j, p);
    }
  }
  auto s = symmetric_eigenvalues(gram, n);
  for (double& x : s) x = std::sqrt(std::max(x, 0.0));
  return s;
}

double frobenius_norm(const HostTensor& m) {
  double s = 0;
  for (double v : m.values()) s += v * v;
  return std::sqrt(s);
}

// Newton-Schulz maps every normalized singular value x through the step's odd polynomial.
std::vector<double> predicted_singular_values(const HostTensor& g,
                                              const NewtonSchulzOptions& options) {
  auto s = singular_values(g);
  const double norm = frobenius_norm(g) + options.eps;
  for (double& x : s) {
    x /= norm;
    for (int step = 0; step < options.steps; ++step) {
      const auto [a, b, c] = options.per_step.empty() ? std::array{options.a, options.b, options.c}
                                                      : options.per_step[step];
      x = std::fabs(a * x + b * x * x * x + c * x * x * x * x * x);
    }
  }
  std::sort(s.begin(), s.end());
  return s;
}

TEST(NewtonSchulz, SingularValuesFollowTheQuinticIntoItsBand) {
  for (auto [rows, cols] : {std::pair{6, 17}, std::pair{12, 5}, std::pair{8, 8}, std::pair{1, 9}}) {
    auto g = well_conditioned(DType::kFloat64, rows, cols);
    const auto input = singular_values(g);
    ASSERT_GE(input.front() / frobenius_norm(g), 0.05) << "precondition: well conditioned";
    const auto got = singular_values(run_newton_schulz(g));
    const auto want = predicted_singular_values(g, {});
    EXPECT_TRUE(test::matches_reference(got, want, 1e-10)) << rows << "x" << cols;
    for (double s : got) {
      EXPECT_GE(s, 0.68) << rows << "x" << cols;
      EXPECT_LE(s, 1.14) << rows << "x" << cols;
    }
  }
}

TEST(NewtonSchulz, PerStepCoefficientsApplyInOrder) {
  NewtonSchulzOptions options{.steps = 3};
  options.per_step = {kDefaultCoefficients, {1.5, -0.5, 0.0}, {2.0, -1.5, 0.5}};
  auto g = well_conditioned(DType::kFloat64, 7, 10);
  EXPECT_TRUE(test::matches_reference(singular_values(run_newton_schulz(g, options)),
                                      predicted_singular_values(g, options), 1e-10));
  // The check can tell the order apart: reversed steps predict other singular values.
  NewtonSchulzOptions reversed = options;
  std::reverse(reversed.per_step.begin(), reversed.per_step.end());
  EXPECT_FALSE(test::matches_reference(predicted_singular_values(g, reversed),
                                       predicted_singular_values(g, options), 1e-6));
}

TEST(NewtonSchulz, PerStepDefaultsEqualTheDefaults) {
  auto g = HostTensor::random(DType::kFloat32, {5, 9});
  NewtonSchulzOptions per_step;
  per_step.per_step.assign(5, kDefaultCoefficients);
  EXPECT_EQ(run_newton_schulz(g, per_step).values(), run_newton_schulz(g).values());
}

// The method picks how the CUDA path runs the steps; the CPU path computes the standard iteration.
TEST(NewtonSchulz, GramMethodOnTheCpuIsTheStandardIteration) {
  auto g = HostTensor::random(DType::kFloat32, {5, 19});
  EXPECT_EQ(run_newton_schulz(g, {.method = NewtonSchulzMethod::kGram}).values(), run_newton_schulz(g).values());
}

// A Householder reflection: orthogonal, symmetric, and far from the identity.
HostTensor householder(std::int64_t n) {
  const auto v = test::random_values(n);
  const double vv = test::dot(v, v);
  HostTensor h(DType::kFloat64, {n, n});
  for (std::int64_t i = 0; i < n * n; ++i)
    h.set(i, (i / n == i % n ? 1.0 : 0.0) - 2 * v[i / n] * v[i % n] / vv);
  return h;
}

TEST(NewtonSchulz, OrthogonalInputStaysOrthogonal) {
  const std::int64_t n = 9;
  const auto q = householder(n);
  // Rows 0..m-1: a semi-orthogonal [m, n] matrix; its transpose exercises R > C.
  for (std::int64_t m : {9, 4}) {
    HostTensor rows(DType::kFloat64, {m, n});
    for (std::int64_t i = 0; i < m * n; ++i) rows.set(i, q.at(i));
    for (const HostTensor& g : {rows, transposed(rows)}) {
      // Every singular value is 1/sqrt(m) after normalization; the quintic maps it to `gain`.
      const double gain = predicted_singular_values(g, {}).front();
      EXPECT_GE(gain, 0.68);
      EXPECT_LE(gain, 1.14);
      std::vector<double> want = g.values();
      for (double& x : want) x *= gain;
      EXPECT_TRUE(test::matches_reference(run_newton_schulz(g).values(), want, 1e-12)) << "m " << m;
    }
  }
}

TEST(NewtonSchulz, TallInputIsTheTransposeOfTheWideOne) {
  for (DType dt : kFloatTypes) {
    auto g = HostTensor::random(dt, {11, 4});
    EXPECT_EQ(transposed(run_newton_schulz(g)).values(), run_newton_schulz(transposed(g)).values())
        << dtype_name(dt);
  }
}

TEST(NewtonSchulz, ZeroStepsReturnsTheNormalizedInput) {
  for (DType dt : kFloatTypes) {
    for (double eps : {1e-7, 0.5}) {
      auto g = HostTensor::random(dt, {6, 3}, -2, 2);
      const double norm = frobenius_norm(g);
      std::vector<double> want = g.values();
      for (double& x : want) x /= norm + eps;
      EXPECT_TRUE(test::matches_reference(run_newton_schulz(g, {.steps = 0, .eps = eps}).values(),
                                          want, test::tolerance(dt)))
          << dtype_name(dt) << " eps " << eps;
    }
  }
}

// Each dtype's output is the fp64 output on the same (rounded) inputs, rounded once; rows
// may be padded.
TEST(NewtonSchulz, EveryDtypeMatchesFloat64OnItsInputs) {
  for (DType dt : kFloatTypes) {
    for (auto [rows, cols] : {std::pair{7, 13}, std::pair{13, 7}}) {
      auto g = HostTensor::random(dt, {rows, cols}, -1, 1, /*row_pad=*/2);
      HostTensor out(dt, {rows, cols}, /*row_pad=*/3);
      newton_schulz(g.view(), out.view());
      const auto want =
          run_newton_schulz(HostTensor::from_values(DType::kFloat64, g.shape(), g.values()));
      EXPECT_TRUE(test::matches_reference(out.values(), want.values(), test::tolerance(dt)))
          << dtype_name(dt);
    }
  }
}

// A batch [N, R, C] gives each matrix the bits a call on it alone gives.
TEST(NewtonSchulz, BatchEqualsOneCallPerMatrix) {
  for (auto [rows, cols] : {std::pair{5, 7}, std::pair{7, 5}}) {
    auto g = HostTensor::random(DType::kBFloat16, {3, rows, cols}, -1, 1, /*row_pad=*/2);
    HostTensor out(DType::kBFloat16, {3, rows, cols}, /*row_pad=*/1);
    newton_schulz(g.view(), out.view());
    const auto got = out.values(), all = g.values();
    for (std::int64_t n = 0; n < 3; ++n) {
      const auto first = all.begin() + n * rows * cols;
      const auto one = HostTensor::from_values(DType::kBFloat16, {rows, cols}, {first, first + rows * cols});
      const auto want = run_newton_schulz(one).values();
      EXPECT_TRUE(std::equal(want.begin(), want.end(), got.begin() + n * rows * cols)) << n;
    }
  }
}

TEST(NewtonSchulz, EmptyZeroAndNaN) {
  for (auto shape : {std::vector<std::int64_t>{0, 4}, std::vector<std::int64_t>{3, 0}}) {
    HostTensor g(DType::kFloat32, shape), out(DType::kFloat32, shape);
    newton_schulz(g.view(), out.view());
    muon_step(out.view(), g.view(), HostTensor(DType::kFloat32, shape).view());
  }
  HostTensor zero = HostTensor::from_values(DType::kFloat32, {2, 3}, std::vector<double>(6, 0.0));
  for (double x : run_newton_schulz(zero).values()) EXPECT_EQ(x, 0.0);  // eps keeps 0/0 away
  auto g = HostTensor::random(DType::kBFloat16, {4, 5});
  g.set(7, NAN);
  for (double x : run_newton_schulz(g).values()) EXPECT_TRUE(std::isnan(x));
}

TEST(NewtonSchulz, ArgumentErrors) {
  auto g = HostTensor::random(DType::kFloat32, {4, 6});
  HostTensor out(DType::kFloat32, {4, 6});
  const char* op = "newton_schulz";
  auto ns = [&](TensorView g_, TensorView out_, const NewtonSchulzOptions& options = {},
                TensorView workspace = {}) { newton_schulz(g_, out_, options, workspace); };
  TS_EXPECT_ERROR(ns({}, out.view()), op, "'g'", "a tensor", "none");
  HostTensor ints(DType::kInt64, {4, 6}), g4(DType::kFloat32, {2, 1, 2, 6}), g1(DType::kFloat32, {6});
  TS_EXPECT_ERROR(ns(ints.view(), out.view()), op, "'g'", "int64");
  TS_EXPECT_ERROR(ns(g4.view(), out.view()), op, "'g'", "a matrix [R, C] or a batch of matrices [N, R, C]",
                  "[2, 1, 2, 6]");
  TS_EXPECT_ERROR(ns(g1.view(), out.view()), op, "'g'", "[N, R, C]", "[6]");
  HostTensor g3(DType::kFloat32, {2, 4, 6});
  TS_EXPECT_ERROR(ns(g3.view(), out.view()), op, "'out'", "[2, 4, 6]", "[4, 6]");
  TensorView g_columns = g.view();
  g_columns.strides = {1, 4};
  TS_EXPECT_ERROR(ns(g_columns, out.view()), op, "'g'", "stride 1 in the last");
  TensorView g_null = g.view();
  g_null.data = nullptr;
  TS_EXPECT_ERROR(ns(g_null, out.view()), op, "'g'", "non-null");
  HostTensor out16(DType::kFloat16, {4, 6}), out_t(DType::kFloat32, {6, 4});
  TS_EXPECT_ERROR(ns(g.view(), {}), op, "'out'", "none");
  TS_EXPECT_ERROR(ns(g.view(), out16.view()), op, "'out'", "float16");
  TS_EXPECT_ERROR(ns(g.view(), out_t.view()), op, "'out'", "[4, 6]", "[6, 4]");
  TensorView out_rows_alias = out.view();
  out_rows_alias.strides[0] = 3;
  TS_EXPECT_ERROR(ns(g.view(), out_rows_alias), op, "'out'", "row stride >= the row length");
  TS_EXPECT_ERROR(ns(g.view(), g.view()), op, "'out'", "disjoint from 'g'");
  TensorView cuda_out = out.view();
  cuda_out.device = Device::cuda(0);
  TS_EXPECT_ERROR(ns(g.view(), cuda_out), op, "'out'", "cuda:0");
  HostTensor workspace(DType::kFloat32, {64});
  ns(g.view(), out.view(), {}, workspace.view());  // ignored on the CPU
  TS_EXPECT_ERROR(ns(g.view(), out.view(), {}, g.view()), op, "'workspace'", "disjoint from 'g'");
  TS_EXPECT_ERROR(ns(g.view(), out.view(), {}, out.view()), op, "'workspace'",
                  "disjoint from 'out'");
  TensorView cuda_workspace = workspace.view();
  cuda_workspace.device = Device::cuda(0);
  TS_EXPECT_ERROR(ns(g.view(), out.view(), {}, cuda_workspace), op, "'workspace'", "cuda:0");
  TS_EXPECT_ERROR(ns(g.view(), out.view(), {.steps = -1}), op, "'options.steps'", "steps >= 0",
                  "-1");
  TS_EXPECT_ERROR(ns(g.view(), out.view(), {.a = NAN}), op, "'options.a'", "finite", "nan");
  TS_EXPECT_ERROR(ns(g.view(), out.view(), {.b = INFINITY}), op, "'options.b'", "finite", "inf");
  TS_EXPECT_ERROR(ns(g.view(), out.view(), {.c = -INFINITY}), op, "'options.c'", "finite");
  TS_EXPECT_ERROR(ns(g.view(), out.view(), {.steps = 2, .per_step = {kDefaultCoefficients}}), op,
                  "'options.per_step'", "2 entries", "got 1 entries");
  TS_EXPECT_ERROR(
      ns(g.view(), out.view(), {.steps = 2, .per_step = {kDefaultCoefficients, {1, NAN, 0}}}), op,
      "'options.per_step[1]'", "finite");
  TS_EXPECT_ERROR(ns(g.view(), out.view(), {.eps = -1e-7}), op, "'options.eps'", ">= 0");
  TS_EXPECT_ERROR(ns(g.view(), out.view(), {.eps = NAN}), op, "'options.eps'", "finite");
  TS_EXPECT_ERROR(ns(g.view(), out.view(), {.method = static_cast<NewtonSchulzMethod>(7)}), op,
                  "'options.method'", "kStandard or kGram", "7");
  TensorView cuda_g = g.view();
  cuda_g.device = Device::cuda(0);
  // CUDA views take the CUDA path (tests/newton_schulz_cuda_test.cc), which here throws: no
  // workspace was given, or (a machine without a GPU) no device.
  TS_EXPECT_ERROR(ns(cuda_g, cuda_out), op);
}

// Muon by hand in fp64: the formula of the header, orthogonalized by the NS reference.
struct MuonResult {
  std::vector<double> param, buffer;
};

MuonResult muon_by_hand(const HostTensor& param, const HostTensor& grad, const HostTensor& buffer,
                        const MuonOptions& options) {
  const std::int64_t R = param.shape()[0], C = param.shape()[1];
  MuonResult r{param.values(), buffer.values()};
  const auto g = grad.values();
  HostTensor u(DType::kFloat64, {R, C});
  for (std::int64_t i = 0; i < R * C; ++i) {
    r.buffer[i] = options.momentum * r.buffer[i] + g[i];
    u.set(i, options.nesterov ? g[i] + options.momentum * r.buffer[i] : r.buffer[i]);
  }
  const auto o = run_newton_schulz(u, options.newton_schulz).values();
  const auto r_over_c = static_cast<double>(R) / static_cast<double>(C);
  const double scale = options.lr_adjust == MuonLrAdjust::kOriginal        ? std::sqrt(std::max(1.0, r_over_c))
                       : options.lr_adjust == MuonLrAdjust::kMatchRmsAdamW ? 0.2 * std::sqrt(std::max(R, C))
                                                                           : std::sqrt(r_over_c);
  for (std::int64_t i = 0; i < R * C; ++i) {
    r.param[i] = r.param[i] * (1 - options.lr * options.weight_decay) - options.lr * scale * o[i];
  }
  return r;
}

TEST(Muon, StepMatchesTheFormula) {
  for (auto [rows, cols] : {std::pair{5, 9}, std::pair{9, 5}, std::pair{6, 6}}) {
    for (bool nesterov : {true, false}) {
      for (double weight_decay : {0.0, 0.1}) {
        const MuonOptions options{.lr = 0.05,
                                  .momentum = 0.9,
                                  .weight_decay = weight_decay,
                                  .nesterov = nesterov,
                                  .newton_schulz = {.steps = 4}};
        auto param = HostTensor::random(DType::kFloat64, {rows, cols});
        auto grad = HostTensor::random(DType::kFloat64, {rows, cols});
        auto buffer = HostTensor::random(DType::kFloat64, {rows, cols});
        const auto want = muon_by_hand(param, grad, buffer, options);
        muon_step(param.view(), grad.view(), buffer.view(), options);
        SCOPED_TRACE(testing::Message()
                     << rows << "x" << cols << " nesterov " << nesterov << " wd " << weight_decay);
        EXPECT_TRUE(test::matches_reference(buffer.values(), want.buffer, 1e-15));
        EXPECT_TRUE(test::matches_reference(param.values(), want.param, 1e-14));
      }
    }
  }
}

TEST(Muon, LrAdjustRules) {
  for (MuonLrAdjust adjust :
       {MuonLrAdjust::kOriginal, MuonLrAdjust::kMatchRmsAdamW, MuonLrAdjust::kSpectralUnclamped}) {
    for (auto [rows, cols] : {std::pair{4, 9}, std::pair{9, 4}}) {
      const MuonOptions options{.lr = 0.05, .weight_decay = 0.1, .lr_adjust = adjust};
      auto param = HostTensor::random(DType::kFloat64, {rows, cols});
      auto grad = HostTensor::random(DType::kFloat64, {rows, cols});
      auto buffer = HostTensor::random(DType::kFloat64, {rows, cols});
      const auto want = muon_by_hand(param, grad, buffer, options);
      muon_step(param.view(), grad.view(), buffer.view(), options);
      SCOPED_TRACE(testing::Message() << rows << "x" << cols << " rule " << static_cast<int>(adjust));
      EXPECT_TRUE(test::matches_reference(param.values(), want.param, 1e-14));
    }
  }
}

// A list of parameters gives each the bits a call on it alone gives.
TEST(Muon, ListEqualsOneCallPerParameter) {
  const MuonOptions options{.lr = 0.03, .weight_decay = 0.05, .newton_schulz = {.steps = 3}};
  std::vector<HostTensor> params, grads, buffers, want_params, want_buffers;
  for (int i = 0; i < 3; ++i) {
    params.push_back(HostTensor::random(DType::kBFloat16, {5, 8}, -1, 1, /*row_pad=*/i));
    grads.push_back(HostTensor::random(DType::kBFloat16, {5, 8}));
    buffers.push_back(HostTensor::random(DType::kFloat32, {5, 8}, -1, 1, /*row_pad=*/2 - i));
    want_params.push_back(params.back());
    want_buffers.push_back(buffers.back());
    muon_step(want_params.back().view(), grads.back().view(), want_buffers.back().view(), options);
  }
  std::vector<TensorView> p, g, b;
  for (int i = 0; i < 3; ++i) {
    p.push_back(params[i].view());
    g.push_back(grads[i].view());
    b.push_back(buffers[i].view());
  }
  muon_step(p, g, b, options);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(params[i].values(), want_params[i].values());
    EXPECT_EQ(buffers[i].values(), want_buffers[i].values());
  }
  muon_step(std::span<const TensorView>{}, {}, {}, options);  // nothing to do
  const char* op = "muon_step";
  TS_EXPECT_ERROR(muon_step(p, std::span(g).first(2), b), op, "'grads'", "one per parameter: 3", "2");
  TS_EXPECT_ERROR(muon_step(p, g, std::span(b).first(1)), op, "'momentum_buffers'", "3", "1");
  HostTensor wide(DType::kBFloat16, {5, 9}), buffer16(DType::kBFloat16, {5, 8});
  std::vector<TensorView> p_shapes = {p[0], wide.view(), p[2]}, b_types = {b[0], b[1], buffer16.view()};
  TS_EXPECT_ERROR(muon_step(p_shapes, g, b), op, "'params[1]'", "[5, 8]", "[5, 9]");
  TS_EXPECT_ERROR(muon_step(p, g, b_types), op, "'momentum_buffers[2]'", "float32", "bfloat16");
  std::vector<TensorView> p_twice = {p[0], p[1], p[0]};
  TS_EXPECT_ERROR(muon_step(p_twice, g, b), op, "'params[2]'", "disjoint from 'params[0]'");
  std::vector<TensorView> g_over_p = {g[0], p[0], g[2]};
  TS_EXPECT_ERROR(muon_step(p, g_over_p, b), op, "'params[0]'", "disjoint from 'grads[1]'", "updated while the other is read");
}

TEST(Muon, TallParameterStepIsScaledBySqrtRowsOverCols) {
  // No momentum, no Nesterov: the buffer becomes grad and a [8, 4] parameter moves by
  // lr * sqrt(2) * NS(grad).
  auto param = HostTensor::random(DType::kFloat64, {8, 4});
  const auto before = param.values();
  auto grad = HostTensor::random(DType::kFloat64, {8, 4});
  HostTensor buffer =
      HostTensor::from_values(DType::kFloat64, {8, 4}, std::vector<double>(32, 0.0));
  const MuonOptions options{.lr = 0.1, .momentum = 0.0, .nesterov = false};
  muon_step(param.view(), grad.view(), buffer.view(), options);
  const auto o = run_newton_schulz(grad).values();
  for (std::int64_t i = 0; i < 32; ++i)
    EXPECT_NEAR(before[i] - param.at(i), 0.1 * std::sqrt(2.0) * o[i], 1e-14);
  EXPECT_EQ(buffer.values(), grad.values());
}

TEST(Muon, EveryDtypeMatchesFloat64OnItsInputs) {
  for (DType dt : kFloatTypes) {
    for (DType buffer_dt : {DType::kFloat32, dt}) {
      const MuonOptions options{.weight_decay = 0.01};
      auto param = HostTensor::random(dt, {6, 10}, -1, 1, /*row_pad=*/1);
      auto grad = HostTensor::random(dt, {6, 10});
      auto buffer = HostTensor::random(buffer_dt, {6, 10}, -1, 1, /*row_pad=*/2);
      const auto want = muon_by_hand(param, grad, buffer, options);
      muon_step(param.view(), grad.view(), buffer.view(), options);
      SCOPED_TRACE(testing::Message() << dtype_name(dt) << " buffer " << dtype_name(buffer_dt));
      EXPECT_TRUE(test::matches_reference(param.values(), want.param, test::tolerance(dt)));
      EXPECT_TRUE(
          test::matches_reference(buffer.values(), want.buffer, test::tolerance(buffer_dt)));
    }
  }
}

TEST(Muon, NaNGradientPoisonsTheStep) {
  auto param = HostTensor::random(DType::kFloat32, {3, 4});
  auto grad = HostTensor::random(DType::kFloat32, {3, 4});
  auto buffer = HostTensor::random(DType::kFloat32, {3, 4});
  grad.set(5, NAN);
  muon_step(param.view(), grad.view(), buffer.view());
  for (std::int64_t i = 0; i < 12; ++i) EXPECT_EQ(std::isnan(buffer.at(i)), i == 5);
  for (double x : param.values()) EXPECT_TRUE(std::isnan(x));
}

TEST(Muon, ArgumentErrors) {
  auto param = HostTensor::random(DType::kBFloat16, {4, 6});
  auto grad = HostTensor::random(DType::kBFloat16, {4, 6});
  auto buffer = HostTensor::random(DType::kFloat32, {4, 6});
  const char* op = "muon_step";
  auto step = [&](TensorView p, TensorView g, TensorView b, const MuonOptions& options = {},
                  TensorView workspace = {}) { muon_step(p, g, b, options, workspace); };
  const TensorView P = param.view(), G = grad.view(), B = buffer.view();
  step(P, G, B);
  TS_EXPECT_ERROR(step({}, G, B), op, "'param'", "none");
  HostTensor ints(DType::kInt32, {4, 6}), p1(DType::kBFloat16, {24});
  TS_EXPECT_ERROR(step(ints.view(), G, B), op, "'param'", "int32");
  TS_EXPECT_ERROR(step(p1.view(), G, B), op, "'param'", "2 dimensions");
  TensorView p_columns = P;
  p_columns.strides = {1, 4};
  TS_EXPECT_ERROR(step(p_columns, G, B), op, "'param'", "stride 1");
  auto grad32 = HostTensor::random(DType::kFloat32, {4, 6});
  auto grad_t = HostTensor::random(DType::kBFloat16, {6, 4});
  TS_EXPECT_ERROR(step(P, {}, B), op, "'grad'", "none");
  TS_EXPECT_ERROR(step(P, grad32.view(), B), op, "'grad'", "bfloat16", "float32");
  TS_EXPECT_ERROR(step(P, grad_t.view(), B), op, "'grad'", "[4, 6]", "[6, 4]");
  auto buffer16 = HostTensor::random(DType::kFloat16, {4, 6});
  auto buffer_t = HostTensor::random(DType::kFloat32, {6, 4});
  TS_EXPECT_ERROR(step(P, G, {}), op, "'momentum_buffer'", "none");
  TS_EXPECT_ERROR(step(P, G, buffer16.view()), op, "'momentum_buffer'", "float32 or bfloat16",
                  "float16");
  TS_EXPECT_ERROR(step(P, G, buffer_t.view()), op, "'momentum_buffer'", "[4, 6]");
  TensorView b_rows_alias = B;
  b_rows_alias.strides[0] = 0;
  TS_EXPECT_ERROR(step(P, G, b_rows_alias), op, "'momentum_buffer'", "row stride");
  TS_EXPECT_ERROR(step(P, P, B), op, "'param'", "disjoint from 'grad'");
  TensorView buffer_over_grad = G;  // a bfloat16 buffer on grad's memory
  TS_EXPECT_ERROR(step(P, G, buffer_over_grad), op, "'momentum_buffer'", "disjoint from 'grad'");
  TS_EXPECT_ERROR(step(P, G, P), op, "'momentum_buffer'", "disjoint from 'param'");
  HostTensor workspace(DType::kFloat32, {64});
  step(P, G, B, {}, workspace.view());
  TS_EXPECT_ERROR(step(P, G, B, {}, P), op, "'workspace'", "disjoint from 'param'");
  TS_EXPECT_ERROR(step(P, G, B, {}, G), op, "'workspace'", "disjoint from 'grad'");
  TS_EXPECT_ERROR(step(P, G, B, {}, B), op, "'workspace'", "disjoint from 'momentum_buffer'");
  TensorView cuda_workspace = workspace.view();
  cuda_workspace.device = Device::cuda(0);
  TS_EXPECT_ERROR(step(P, G, B, {}, cuda_workspace), op, "'workspace'", "cuda:0");
  TS_EXPECT_ERROR(step(P, G, B, {.lr = NAN}), op, "'options.lr'", "finite");
  TS_EXPECT_ERROR(step(P, G, B, {.lr = -0.1}), op, "'options.lr'", ">= 0");
  TS_EXPECT_ERROR(step(P, G, B, {.momentum = -0.5}), op, "'options.momentum'", ">= 0");
  TS_EXPECT_ERROR(step(P, G, B, {.weight_decay = INFINITY}), op, "'options.weight_decay'",
                  "finite");
  TS_EXPECT_ERROR(step(P, G, B, {.newton_schulz = {.steps = -2}}), op,
                  "'options.newton_schulz.steps'", "-2");
  TS_EXPECT_ERROR(step(P, G, B, {.newton_schulz = {.steps = 1, .per_step = {}, .eps = -1}}), op,
                  "'options.newton_schulz.eps'");
  TS_EXPECT_ERROR(
      step(P, G, B, {.newton_schulz = {.steps = 3, .per_step = {kDefaultCoefficients}}}), op,
      "'options.newton_schulz.per_step'", "3 entries");
  auto on_cuda = [](TensorView t) {
    t.device = Device::cuda(0);
    return t;
  };
  TS_EXPECT_ERROR(step(P, G, on_cuda(B)), op, "'momentum_buffer'", "cuda:0");
  // CUDA views take the CUDA path (tests/muon_cuda_test.cc), which here throws: no workspace
  // was given, or (a machine without a GPU) no device.
  TS_EXPECT_ERROR(step(on_cuda(P), on_cuda(G), on_cuda(B)), op);
}

// The CUDA path's blocks per side of the symmetric Gram products: the largest of 1, 2, 4 that
// keeps blocks of at least 2048 rows, a multiple of 32.
TEST(NewtonSchulz, GramBlocksKeepBlocksOfAtLeast2048Rows) {
  using ops::newton_schulz::gram_blocks;
  EXPECT_EQ(gram_blocks(1), 1);
  EXPECT_EQ(gram_blocks(1024), 1);
  EXPECT_EQ(gram_blocks(2048), 1);
  EXPECT_EQ(gram_blocks(4096), 2);
  EXPECT_EQ(gram_blocks(4100), 1);  // not a multiple of 64
  EXPECT_EQ(gram_blocks(6144), 2);
  EXPECT_EQ(gram_blocks(8192), 4);
  EXPECT_EQ(gram_blocks(12288), 4);
  EXPECT_EQ(gram_blocks(16384), 4);
}

// The tile triangle's folded schedule visits every tile (m, n) with n <= m of a t x t grid once.
TEST(NewtonSchulz, FoldedTriangleVisitsEveryLowerTileOnce) {
  for (std::int64_t t = 2; t <= 96; t += 2) {
    std::vector<int> seen(static_cast<std::size_t>(t * t), 0);
    for (std::int64_t r = 0; r < t / 2; ++r) {
      for (std::int64_t c = 0; c <= t; ++c) {
        const auto [m, n] = ops::newton_schulz::folded_triangle_tile(r, c, t);
        ASSERT_TRUE(0 <= n && n <= m && m < t) << "t " << t << " cell " << r << ", " << c;
        ++seen[static_cast<std::size_t>(m * t + n)];
      }
    }
    for (std::int64_t m = 0; m < t; ++m) {
      for (std::int64_t n = 0; n <= m; ++n) EXPECT_EQ(seen[static_cast<std::size_t>(m * t + n)], 1) << t;
    }
  }
}

// Without a Hopper GPU, CUTLASS or a bf16 input the tile triangle does not apply (newton_schulz_cuda
// then runs the blocks).
#if TRAINSCALE_HAVE_CUDA
TEST(NewtonSchulz, TileTriangleAppliesToBf16OnHopperOnly) {
  EXPECT_FALSE(ops::newton_schulz::gram_triangle_applies(DType::kFloat32, 4096, 4096));
  EXPECT_FALSE(ops::newton_schulz::gram_triangle_applies(DType::kBFloat16, 4096 + 128, 4096));  // odd tiles
  EXPECT_FALSE(ops::newton_schulz::gram_triangle_applies(DType::kBFloat16, 4096, 4100));        // K not of 8
#if !TRAINSCALE_HAVE_CUTLASS
  EXPECT_FALSE(ops::newton_schulz::gram_triangle_applies(DType::kBFloat16, 4096, 4096));
#endif
}
#endif

}  // namespace
}  // namespace trainscale
