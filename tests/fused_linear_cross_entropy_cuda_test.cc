// Fused linear cross-entropy on the GPU against the fp64 CPU reference on float64 copies of the
// same rounded inputs: every dtype and reduction, with and without bias, odd T / H / V (unaligned
// rows), one chunk and many, every option, a per-token and a reduced upstream gradient, float32
// against in-place grad_weight accumulation, all targets ignored, no tokens, NaN inputs, padded
// rows, bit-identical results run to run, and the workspace's errors.
#include <cuda_runtime.h>

#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "trainscale/loss.h"
#include "util/strided_device_buffer.h"

namespace trainscale {
namespace {

using test::DeviceTensor;
using test::HostTensor;
using Values = std::vector<double>;

struct Case {
  DType dt = DType::kBFloat16;
  std::int64_t tokens = 37, dim = 40, classes = 101;
  bool bias = true;
  CrossEntropyOptions o{};
  std::int64_t chunk_tokens = 0;
  DType accumulation = DType::kFloat32;
  bool upstream = false;  // grad_loss given
  double ignored_fraction = 0.2;
  std::int64_t row_pad = 0;  // extra elements after each row of hidden and weight
};

std::string describe(const Case& c) {
  return std::string(dtype_name(c.dt)) + " T " + std::to_string(c.tokens) + " H " + std::to_string(c.dim) +
         " V " + std::to_string(c.classes) + (c.bias ? " bias" : "") + " reduction " +
         reduction_name(c.o.reduction) + " smoothing " + std::to_string(c.o.label_smoothing) + " z " +
         std::to_string(c.o.z_loss) + " softcap " + std::to_string(c.o.softcap) + " chunk " +
         std::to_string(c.chunk_tokens) + " acc " + dtype_name(c.accumulation) +
         (c.upstream ? " grad_loss" : "") + " pad " + std::to_string(c.row_pad);
}

struct Inputs {
  HostTensor hidden, weight, bias, targets, grad_loss;
};

Inputs make_inputs(const Case& c) {
  Inputs in{HostTensor::random(c.dt, {c.tokens, c.dim}, -1, 1, c.row_pad),
            HostTensor::random(c.dt, {c.classes, c.dim}, -1, 1, c.row_pad),
            HostTensor::random(c.dt, {c.classes}, -1, 1), HostTensor(DType::kInt64, {c.tokens}),
            c.o.reduction == Reduction::kNone ? HostTensor(DType::kFloat32, {c.tokens})
                                              : HostTensor(DType::kFloat32, {})};
  std::uniform_int_distribution<std::int64_t> cls(0, c.classes - 1);
  std::uniform_real_distribution<double> u(0, 1);
  for (std::int64_t t = 0; t < c.tokens; ++t) {
    const bool ignored = u(test::rng()) < c.ignored_fraction;
    in.targets.set(t, ignored ? static_cast<double>(c.o.ignore_index) : static_cast<double>(cls(test::rng())));
  }
  const Values gl = test::random_values(in.grad_loss.numel(), 0.5, 2);
  for (std::int64_t i = 0; i < in.grad_loss.numel(); ++i) in.grad_loss.set(i, gl[i]);
  return in;
}

HostTensor as_f64(const HostTensor& t) { return HostTensor::from_values(DType::kFloat64, t.shape(), t.values()); }

struct Outputs {
  Values loss, lse, grad_hidden, grad_weight, grad_bias;
};

HostTensor loss_tensor(const Case& c, DType dt) {
  return c.o.reduction == Reduction::kNone ? HostTensor(dt, {c.tokens}) : HostTensor(dt, {});
}

Outputs run_device(const Case& c, const Inputs& in) {
  DeviceTensor h(in.hidden), w(in.weight), b(in.bias), t(in.targets), gl(in.grad_loss);
  DeviceTensor loss(loss_tensor(c, DType::kFloat32), false), lse(HostTensor(DType::kFloat32, {c.tokens}), false);
  DeviceTensor gh(HostTensor(c.dt, {c.tokens, c.dim}), false), gw(HostTensor(c.dt, {c.classes, c.dim}), false);
  DeviceTensor gb(HostTensor(c.dt, {c.classes}), false);
  for (DeviceTensor* d : {&loss, &lse, &gh, &gw, &gb}) d->poison();
  FusedLinearCrossEntropyArgs a{.hidden = h.view(), .weight = w.view(), .bias = c.bias ? b.view() : TensorView{},
                                .targets = t.view(), .loss = loss.view(), .lse = lse.view(),
                                .grad_loss = c.upstream ? gl.view() : TensorView{}, .grad_hidden = gh.view(),
                                .grad_weight = gw.view(), .grad_bias = c.bias ? gb.view() : TensorView{},
                                .chunk_tokens = c.chunk_tokens, .grad_weight_accumulation = c.accumulation};
  const std::size_t bytes = fused_linear_cross_entropy_workspace_bytes(a, c.o);
  DeviceTensor ws(HostTensor(DType::kInt64, {static_cast<std::int64_t>(bytes / 8 + 1)}), false);
  ws.poison();
  a.workspace = ws.view();
  fused_linear_cross_entropy_forward(a, c.o);
  Outputs out{loss.to_host().values(), lse.to_host().values(), gh.to_host().values(), gw.to_host().values(), {}};
  if (c.bias) out.grad_bias = gb.to_host().values();
  return out;
}

Outputs run_reference(const Case& c, const Inputs& in) {
  const HostTensor h = as_f64(in.hidden), w = as_f64(in.weight), b = as_f64(in.bias), gl = as_f64(in.grad_loss);
  HostTensor loss = loss_tensor(c, DType::kFloat64), lse(DType::kFloat64, {c.tokens});
  HostTensor gh(DType::kFloat64, {c.tokens, c.dim}), gw(DType::kFloat64, {c.classes, c.dim}), gb(DType::kFloat64, {c.classes});
  fused_linear_cross_entropy_forward({.hidden = h.view(), .weight = w.view(), .bias = c.bias ? b.view() : TensorView{},
                                      .targets = in.targets.view(), .loss = loss.view(), .lse = lse.view(),
                                      .grad_loss = c.upstream ? gl.view() : TensorView{}, .grad_hidden = gh.view(),
                                      .grad_weight = gw.view(), .grad_bias = c.bias ? gb.view() : TensorView{}},
                                     c.o);
  Outputs out{test::rounded(DType::kFloat32, loss), test::rounded(DType::kFloat32, lse), test::rounded(c.dt, gh),
              test::rounded(c.dt, gw), {}};
  if (c.bias) out.grad_bias = test::rounded(c.dt, gb);
  return out;
}

// The logits are rounded to the inputs' dtype between the GEMM and the loss, as an unfused
// bf16 model rounds them: loss and lse carry that dtype's error, not float32's.
void check(const Case& c) {
  SCOPED_TRACE(describe(c));
  const Inputs in = make_inputs(c);
  const Outputs got = run_device(c, in), ref = run_reference(c, in);
  const double tol = test::tolerance(c.dt);
  EXPECT_TRUE(test::matches_reference(got.loss, ref.loss, tol)) << "loss";
  EXPECT_TRUE(test::matches_reference(got.lse, ref.lse, tol)) << "lse";
  EXPECT_TRUE(test::matches_reference(got.grad_hidden, ref.grad_hidden, tol)) << "grad_hidden";
  EXPECT_TRUE(test::matches_reference(got.grad_weight, ref.grad_weight, tol)) << "grad_weight";
  if (c.bias) {
    EXPECT_TRUE(test::matches_reference(got.grad_bias, ref.grad_bias, tol)) << "grad_bias";
  }
}

TEST(FusedLinearCrossEntropyCuda, MatchesReference) {
  TS_REQUIRE_GPU();
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
      for (bool bias : {false, true}) {
        for (std::int64_t chunk : {0, 16}) {  // one chunk; three (the last short)
          Case c{.dt = dt, .bias = bias, .chunk_tokens = chunk};
          c.o.reduction = r;
          check(c);
        }
      }
    }
  }
}

TEST(FusedLinearCrossEntropyCuda, OddShapesAndPaddedRows) {
  TS_REQUIRE_GPU();
  for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
    check({.dt = dt, .tokens = 1, .dim = 1, .classes = 1});
    check({.dt = dt, .tokens = 29, .dim = 41, .classes = 13, .chunk_tokens = 8});
    check({.dt = dt, .tokens = 64, .dim = 33, .classes = 250, .row_pad = 3});
    check({.dt = dt, .tokens = 300, .dim = 256, .classes = 5000, .chunk_tokens = 128});
  }
}

TEST(FusedLinearCrossEntropyCuda, EveryOption) {
  TS_REQUIRE_GPU();
  for (Reduction r : {Reduction::kMean, Reduction::kNone}) {
    for (int k = 0; k < 4; ++k) {
      Case c{.chunk_tokens = 16};
      c.o.reduction = r;
      if (k == 0) c.o.label_smoothing = 0.1;
      if (k == 1) c.o.z_loss = 1e-3;
      if (k == 2) c.o.softcap = 3.0;  // logits of |x| up to ~6 reach well into the tanh
      if (k == 3) c.o.ignore_index = 5;
      check(c);
    }
  }
}

TEST(FusedLinearCrossEntropyCuda, UpstreamGradient) {
  TS_REQUIRE_GPU();
  for (Reduction r : {Reduction::kNone, Reduction::kMean, Reduction::kSum}) {
    for (std::int64_t chunk : {0, 16}) {
      Case c{.chunk_tokens = chunk, .upstream = true};
      c.o.reduction = r;
      c.o.z_loss = 1e-3;
      check(c);
    }
  }
}

TEST(FusedLinearCrossEntropyCuda, AllIgnoredNoTokensAndNaN) {
  TS_REQUIRE_GPU();
  for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
    Case all{.chunk_tokens = 16, .ignored_fraction = 1.0};
    all.o.reduction = r;
    check(all);  // kMean: NaN loss, zero gradients
    Case none{.tokens = 0};
    none.o.reduction = r;
    check(none);  // zero grad_weight and grad_bias
  }
  Case c{.dt = DType::kFloat32, .tokens = 20, .chunk_tokens = 8, .ignored_fraction = 0};
  c.o.reduction = Reduction::kNone;
  Inputs in = make_inputs(c);
  in.hidden.set(3 * c.dim + 7, std::nan(""));
  const Outputs got = run_device(c, in);
  for (std::int64_t t = 0; t < c.tokens; ++t) EXPECT_EQ(std::isnan(got.loss[t]), t == 3) << t;
  EXPECT_TRUE(std::isnan(got.grad_hidden[3 * c.dim]));
  EXPECT_FALSE(std::isnan(got.grad_hidden[4 * c.dim]));
}

// grad_weight summed over many chunks: within bf16 tolerance either way, and the float32
// buffer's error does not grow with the chunk count the way in-place bf16 accumulation does.
TEST(FusedLinearCrossEntropyCuda, FloatAccumulationStaysAccurate) {
  TS_REQUIRE_GPU();
  Case c{.tokens = 2048, .dim = 64, .classes = 512, .bias = false, .chunk_tokens = 32, .ignored_fraction = 0};
  c.o.reduction = Reduction::kSum;
  const Inputs in = make_inputs(c);
  const Outputs ref = run_reference(c, in);
  const Outputs in_float = run_device(c, in);
  c.accumulation = DType::kBFloat16;
  const Outputs in_place = run_device(c, in);
  const double float_err = test::rel_l2(in_float.grad_weight, ref.grad_weight);
  const double place_err = test::rel_l2(in_place.grad_weight, ref.grad_weight);
  EXPECT_LT(float_err, test::tolerance(c.dt));
  EXPECT_LT(float_err * 2, place_err) << "float32 " << float_err << " in place " << place_err;
}

TEST(FusedLinearCrossEntropyCuda, BitIdenticalRunToRun) {
  TS_REQUIRE_GPU();
  Case c{.tokens = 300, .dim = 128, .classes = 3000, .chunk_tokens = 128};
  c.o.label_smoothing = 0.05;
  const Inputs in = make_inputs(c);
  const Outputs a = run_device(c, in), b = run_device(c, in);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.lse, b.lse);
  EXPECT_EQ(a.grad_hidden, b.grad_hidden);
  EXPECT_EQ(a.grad_weight, b.grad_weight);
  EXPECT_EQ(a.grad_bias, b.grad_bias);
}

TEST(FusedLinearCrossEntropyCuda, WorkspaceErrors) {
  TS_REQUIRE_GPU();
  const Case c;
  const Inputs in = make_inputs(c);
  DeviceTensor h(in.hidden), w(in.weight), t(in.targets), loss(HostTensor(DType::kFloat32, {}), false);
  FusedLinearCrossEntropyArgs a{.hidden = h.view(), .weight = w.view(), .targets = t.view(), .loss = loss.view()};
  const char* op = "fused_linear_cross_entropy_forward";
  TS_EXPECT_ERROR(fused_linear_cross_entropy_forward(a), op, "workspace", "fused_linear_cross_entropy_workspace_bytes");
  const std::size_t bytes = fused_linear_cross_entropy_workspace_bytes(a);
  DeviceTensor ws(HostTensor(DType::kInt64, {static_cast<std::int64_t>(bytes / 8)}), false);
  a.workspace = ws.view();
  a.workspace.shape[0] = static_cast<std::int64_t>(bytes / 8) - 1;
  const std::string need = std::to_string(bytes);
  TS_EXPECT_ERROR(fused_linear_cross_entropy_forward(a), op, "workspace", need.c_str());
  a.workspace = ws.view();
  fused_linear_cross_entropy_forward(a);
  a.grad_weight_accumulation = DType::kFloat16;
  TS_EXPECT_ERROR(fused_linear_cross_entropy_forward(a), op, "grad_weight_accumulation", "float32");
}

}  // namespace
}  // namespace trainscale
