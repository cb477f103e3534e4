// muon_step on the GPU against the fp64 CPU reference on float64 copies of the same rounded
// inputs: bfloat16 and float32 parameters with float32 or parameter-dtype buffers, wide and
// tall (transposed) parameters, odd and tiny shapes, padded and unaligned rows (the momentum
// pass's scalar path), Nesterov on and off, weight decay and the lr rules, NaN gradients, a
// list (more than kMuonMaxBatch parameters: several batches) bit-identical to one call per
// parameter and run to run, the Gram method, and the workspace's errors. The update (new minus old parameter)
// is compared, so that the parameter's own rounding does not hide Newton-Schulz's error.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "trainscale/newton_schulz.h"
#include "util/strided_device_buffer.h"

namespace trainscale {
namespace {

using test::DeviceTensor;
using test::HostTensor;
using test::Layout;
using test::StridedDeviceBuffer;
using Values = std::vector<double>;

// Relative L2 error of the update: u rounded to the parameter's dtype, then Newton-Schulz with
// X, A and B rounded to it every step (newton_schulz_cuda_test's tolerance).
double tolerance(DType dt) { return dt == DType::kBFloat16 ? 5e-2 : 1e-4; }

// One parameter's tensors on the host (as values) and the dtypes and layouts they live in.
struct Problem {
  DType dt, buffer_dt;
  Layout l, buffer_l;
  Values param, grad, buffer;
};

Problem make_problem(DType dt, DType buffer_dt, const Layout& l, const Layout& buffer_l) {
  const std::int64_t n = l.rows * l.cols;
  return {dt, buffer_dt, l, buffer_l, test::random_inputs(dt, n, 0, -0.1, 0.1, false),
          test::random_inputs(dt, n, 0, -1, 1, false), test::random_inputs(buffer_dt, n, 0, -1, 1, false)};
}

struct Result {
  Values param, buffer;
};

// Equal element by element, NaN equal to NaN (a NaN gradient must come back untouched too).
bool same_values(const Values& a, const Values& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                    [](double x, double y) { return x == y || (std::isnan(x) && std::isnan(y)); });
}

// muon_step over the problems in one call on the device.
std::vector<Result> run_device(const std::vector<Problem>& problems, const MuonOptions& o) {
  std::vector<std::unique_ptr<StridedDeviceBuffer>> owned;
  std::vector<TensorView> p, g, b;
  for (const Problem& k : problems) {
    p.push_back(owned.emplace_back(std::make_unique<StridedDeviceBuffer>(k.dt, k.l, &k.param))->view());
    g.push_back(owned.emplace_back(std::make_unique<StridedDeviceBuffer>(k.dt, k.l, &k.grad))->view());
    b.push_back(owned.emplace_back(std::make_unique<StridedDeviceBuffer>(k.buffer_dt, k.buffer_l, &k.buffer))->view());
  }
  const std::size_t bytes = muon_step_workspace_bytes(p[0], static_cast<std::int64_t>(p.size()));
  DeviceTensor ws(HostTensor(DType::kInt64, {static_cast<std::int64_t>(bytes / 8 + 1)}), false);
  ws.poison();
  if (p.size() == 1) {
    muon_step(p[0], g[0], b[0], o, ws.view());
  } else {
    muon_step(p, g, b, o, ws.view());
  }
  std::vector<Result> out;
  for (std::size_t i = 0; i < problems.size(); ++i) {
    EXPECT_TRUE(owned[3 * i]->padding_untouched());
    EXPECT_TRUE(owned[3 * i + 2]->padding_untouched());
    EXPECT_TRUE(same_values(owned[3 * i + 1]->values(), problems[i].grad));  // read only
    out.push_back({owned[3 * i]->values(), owned[3 * i + 2]->values()});
  }
  return out;
}

Result run_reference(const Problem& k, const MuonOptions& o) {
  HostTensor p = test::as_f64(k.param, k.l.rows, k.l.cols), g = test::as_f64(k.grad, k.l.rows, k.l.cols),
             b = test::as_f64(k.buffer, k.l.rows, k.l.cols);
  muon_step(p.view(), g.view(), b.view(), o);
  return {test::rounded(k.dt, p), test::rounded(k.buffer_dt, b)};
}

Values minus(const Values& a, const Values& b) {
  Values d(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

void check(const Problem& k, const MuonOptions& o) {
  const std::string what = test::describe(k.dt, k.l) + " buffer " + dtype_name(k.buffer_dt) + " nesterov " +
                           std::to_string(o.nesterov) + " wd " + std::to_string(o.weight_decay);
  SCOPED_TRACE(what);
  const Result got = run_device({k}, o)[0], ref = run_reference(k, o);
  const double err = test::rel_l2(minus(got.param, k.param), minus(ref.param, k.param));
  std::cout << "[muon_step] " << what << ": update relative L2 error " << err << '\n';
  EXPECT_TRUE(test::matches_reference(minus(got.param, k.param), minus(ref.param, k.param), tolerance(k.dt)));
  EXPECT_TRUE(test::matches_reference(got.buffer, ref.buffer, test::tolerance(k.buffer_dt)));
}

TEST(MuonCuda, MatchesReference) {
  TS_REQUIRE_GPU();
  for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
    for (DType buffer_dt : {DType::kFloat32, dt}) {
      for (const Layout& l : {Layout{64, 128, 0, false}, Layout{128, 64, 0, false}, Layout{256, 512, 0, false}}) {
        for (bool nesterov : {true, false}) {
          check(make_problem(dt, buffer_dt, l, l), {.lr = 0.5, .weight_decay = 0.1, .nesterov = nesterov});
        }
      }
    }
  }
}

TEST(MuonCuda, OddTinyPaddedAndUnalignedShapes) {
  TS_REQUIRE_GPU();
  for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
    for (const Layout& l : {Layout{1, 1, 0, false}, Layout{1, 9, 0, false}, Layout{9, 1, 0, false},
                            Layout{3, 7, 0, false}, Layout{33, 65, 3, false}, Layout{65, 33, 0, true},
                            Layout{96, 160, 8, false}}) {
      check(make_problem(dt, DType::kFloat32, l, {l.rows, l.cols, l.pad + 1, false}), {.lr = 0.5});
    }
  }
}

TEST(MuonCuda, LrRules) {
  TS_REQUIRE_GPU();
  for (MuonLrAdjust adjust : {MuonLrAdjust::kOriginal, MuonLrAdjust::kMatchRmsAdamW, MuonLrAdjust::kSpectralUnclamped}) {
    for (const Layout& l : {Layout{48, 96, 0, false}, Layout{96, 48, 0, false}}) {
      check(make_problem(DType::kFloat32, DType::kFloat32, l, l), {.lr = 0.3, .lr_adjust = adjust});
    }
  }
}

TEST(MuonCuda, NanGradientPoisonsTheParameter) {
  TS_REQUIRE_GPU();
  const Layout l{48, 80, 0, false};
  Problem k = make_problem(DType::kBFloat16, DType::kFloat32, l, l);
  k.grad[5] = std::nan("");
  const Result r = run_device({k}, {})[0];
  for (double v : r.param) EXPECT_TRUE(std::isnan(v));
  for (std::size_t i = 0; i < r.buffer.size(); ++i) EXPECT_EQ(std::isnan(r.buffer[i]), i == 5) << i;
}

// 37 parameters: batches of kMuonMaxBatch and 5, each parameter the bits of a call on it alone.
TEST(MuonCuda, ListEqualsOneCallPerParameterAndRepeats) {
  TS_REQUIRE_GPU();
  for (const Layout& l : {Layout{40, 72, 0, false}, Layout{72, 40, 2, false}}) {
    std::vector<Problem> problems;
    for (int i = 0; i < 37; ++i) problems.push_back(make_problem(DType::kBFloat16, DType::kFloat32, l, l));
    const MuonOptions o{.lr = 0.1, .weight_decay = 0.01};
    const std::vector<Result> all = run_device(problems, o), again = run_device(problems, o);
    for (std::size_t i = 0; i < problems.size(); ++i) {
      const Result one = run_device({problems[i]}, o)[0];
      EXPECT_EQ(all[i].param, one.param) << i;
      EXPECT_EQ(all[i].buffer, one.buffer) << i;
      EXPECT_EQ(again[i].param, all[i].param) << i;
    }
  }
}

// The Gram steps (NewtonSchulzMethod::kGram, shapes where max(R, C) >= 3 min(R, C)) against the
// reference of the standard ones, and a list of 5 parameters bit-identical to one call each.
TEST(MuonCuda, GramMethodMatchesReferenceAndListBits) {
  TS_REQUIRE_GPU();
  const MuonOptions o{.lr = 0.5, .weight_decay = 0.1, .newton_schulz = {.method = NewtonSchulzMethod::kGram}};
  for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
    for (const Layout& l : {Layout{64, 256, 0, false}, Layout{256, 64, 3, false}}) {
      check(make_problem(dt, DType::kFloat32, l, l), o);
    }
  }
  const Layout l{48, 160, 0, false};
  std::vector<Problem> problems;
  for (int i = 0; i < 5; ++i) problems.push_back(make_problem(DType::kBFloat16, DType::kFloat32, l, l));
  const std::vector<Result> all = run_device(problems, o);
  for (std::size_t i = 0; i < problems.size(); ++i) EXPECT_EQ(all[i].param, run_device({problems[i]}, o)[0].param) << i;
}

TEST(MuonCuda, WorkspaceErrors) {
  TS_REQUIRE_GPU();
  const Layout l{32, 64, 0, false};
  StridedDeviceBuffer p(DType::kBFloat16, l), g(DType::kBFloat16, l), b(DType::kFloat32, l);
  TS_EXPECT_ERROR(muon_step(p.view(), g.view(), b.view()), "muon_step", "workspace", "muon_step_workspace_bytes");
  const std::size_t bytes = muon_step_workspace_bytes(p.view(), 2);
  EXPECT_GT(bytes, muon_step_workspace_bytes(p.view(), 1));
  EXPECT_EQ(muon_step_workspace_bytes(p.view(), 100), muon_step_workspace_bytes(p.view(), kMuonMaxBatch));
  DeviceTensor ws(HostTensor(DType::kInt64, {static_cast<std::int64_t>(bytes / 8)}), false);
  const std::vector<TensorView> ps = {p.view(), p.view()}, gs = {g.view(), g.view()}, bs = {b.view(), b.view()};
  TS_EXPECT_ERROR(muon_step(ps, gs, bs, {}, ws.view()), "muon_step", "'params[1]'", "disjoint from 'params[0]'");
  TensorView short_ws = ws.view();
  short_ws.shape[0] = static_cast<std::int64_t>(muon_step_workspace_bytes(p.view(), 1) / 8) - 1;
  TS_EXPECT_ERROR(muon_step(p.view(), g.view(), b.view(), {}, short_ws), "muon_step", "workspace",
                  std::to_string(muon_step_workspace_bytes(p.view(), 1)).c_str());
}

}  // namespace
}  // namespace trainscale
