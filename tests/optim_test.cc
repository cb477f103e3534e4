// adamw_step, grad_norm and scale_by_device_factor on the CPU: values worked out by hand, the
// update rounded once per dtype, several steps against torch.optim.AdamW's recurrence written
// out here, NaN and Inf, and every argument error.
#include "trainscale/optim.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/host_dtype.h"
#include "util/gpu_util.h"

namespace trainscale {
namespace {

using test::HostTensor;

struct Param {
  HostTensor p, g, m, v;
};

Param make_param(DType dt, DType state_dt, std::int64_t n) {
  Param k{HostTensor::random(dt, {n}), HostTensor::random(dt, {n}), HostTensor::random(state_dt, {n}, -0.1, 0.1),
          HostTensor::random(state_dt, {n}, 0.0, 0.1)};
  return k;
}

void step(std::vector<Param>& ps, const AdamWOptions& o, const TensorView& scale = {}) {
  std::vector<TensorView> p, g, m, v;
  for (Param& k : ps) {
    p.push_back(k.p.view());
    g.push_back(k.g.view());
    m.push_back(k.m.view());
    v.push_back(k.v.view());
  }
  adamw_step(p, g, m, v, o, scale);
}

// param 1, grad 0.5, fresh moments, lr 0.1, step 1: m = 0.05, v = 2.5e-4, the bias corrections
// 0.1 and 1e-3, so param = 1 (1 - 0.1 * 0.01) - (0.1 / 0.1) * 0.05 / (0.5 + 1e-8).
TEST(AdamW, FirstStepByHand) {
  std::vector<Param> ps(1);
  ps[0] = {HostTensor::from_values(DType::kFloat64, {1}, {1.0}), HostTensor::from_values(DType::kFloat64, {1}, {0.5}),
           HostTensor::from_values(DType::kFloat64, {1}, {0.0}), HostTensor::from_values(DType::kFloat64, {1}, {0.0})};
  step(ps, {.lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .step = 1});
  EXPECT_NEAR(ps[0].m.at(0), 0.05, 1e-15);
  EXPECT_NEAR(ps[0].v.at(0), 2.5e-4, 1e-15);
  EXPECT_NEAR(ps[0].p.at(0), 0.999 - 0.05 / (0.5 + 1e-8), 1e-14);
}

// Five steps on float64 tensors against the recurrence as torch.optim.AdamW writes it
// (weight decay first, then the moments and the bias-corrected update), grad_scale 0.5.
TEST(AdamW, StepsFollowTheRecurrence) {
  const std::int64_t n = 37;
  std::vector<Param> ps{make_param(DType::kFloat64, DType::kFloat64, n)};
  std::vector<double> p = ps[0].p.values(), m = ps[0].m.values(), v = ps[0].v.values();
  const HostTensor scale = HostTensor::from_values(DType::kFloat32, {1}, {0.5});
  const double lr = 0.01, b1 = 0.8, b2 = 0.95, eps = 1e-6, wd = 0.1;
  for (int s = 1; s <= 5; ++s) {
    ps[0].g.fill_random(-1, 1);
    const std::vector<double> g = ps[0].g.values();
    step(ps, {.lr = lr, .beta1 = b1, .beta2 = b2, .eps = eps, .weight_decay = wd, .step = s}, scale.view());
    for (std::int64_t i = 0; i < n; ++i) {
      const double gi = 0.5 * g[i];
      p[i] *= 1 - lr * wd;
      m[i] = b1 * m[i] + (1 - b1) * gi;
      v[i] = b2 * v[i] + (1 - b2) * gi * gi;
      const double denom = std::sqrt(v[i]) / std::sqrt(1 - std::pow(b2, s)) + eps;
      p[i] -= lr / (1 - std::pow(b1, s)) * m[i] / denom;
    }
  }
  EXPECT_TRUE(test::matches_reference(ps[0].p.values(), p, 1e-12));
  EXPECT_TRUE(test::matches_reference(ps[0].m.values(), m, 1e-12));
  EXPECT_TRUE(test::matches_reference(ps[0].v.values(), v, 1e-12));
}

// 16-bit parameters with float32 or 16-bit moments: each output is the float64 result rounded
// once to its dtype.
TEST(AdamW, RoundsOnceToEachDtype) {
  for (auto [dt, state_dt] : {std::pair{DType::kBFloat16, DType::kFloat32}, {DType::kBFloat16, DType::kBFloat16},
                              {DType::kFloat16, DType::kFloat16}, {DType::kFloat32, DType::kFloat32}}) {
    std::vector<Param> ps{make_param(dt, state_dt, 19), make_param(dt, state_dt, 0), make_param(dt, state_dt, 4)};
    std::vector<Param> wide;
    for (const Param& k : ps) {
      wide.push_back({HostTensor::from_values(DType::kFloat64, k.p.shape(), k.p.values()),
                      HostTensor::from_values(DType::kFloat64, k.g.shape(), k.g.values()),
                      HostTensor::from_values(DType::kFloat64, k.m.shape(), k.m.values()),
                      HostTensor::from_values(DType::kFloat64, k.v.shape(), k.v.values())});
    }
    const AdamWOptions o{.lr = 0.05, .step = 3};
    step(ps, o);
    step(wide, o);
    for (std::size_t t = 0; t < ps.size(); ++t) {
      for (std::int64_t i = 0; i < ps[t].p.numel(); ++i) {
        HostTensor r(dt, {1}), rs(state_dt, {1});
        r.set(0, wide[t].p.at(i));
        EXPECT_EQ(ps[t].p.at(i), r.at(0)) << dtype_name(dt) << " tensor " << t << " element " << i;
        rs.set(0, wide[t].m.at(i));
        EXPECT_EQ(ps[t].m.at(i), rs.at(0));
        rs.set(0, wide[t].v.at(i));
        EXPECT_EQ(ps[t].v.at(i), rs.at(0));
      }
    }
  }
}

// A NaN or Inf gradient reaches its own element's parameter and moments, nothing else.
TEST(AdamW, NonFiniteGradientsStayInTheirElement) {
  std::vector<Param> ps{make_param(DType::kFloat32, DType::kFloat32, 6)};
  ps[0].g.set(1, std::numeric_limits<double>::quiet_NaN());
  ps[0].g.set(4, std::numeric_limits<double>::infinity());
  step(ps, {});
  for (std::int64_t i = 0; i < 6; ++i) {
    const bool hit = i == 1 || i == 4;
    EXPECT_EQ(std::isnan(ps[0].p.at(i)), hit) << i;
    EXPECT_EQ(std::isfinite(ps[0].m.at(i)), !hit) << i;
  }
}

TEST(AdamW, ArgumentErrors) {
  std::vector<Param> ps{make_param(DType::kFloat32, DType::kFloat32, 8)};
  Param& k = ps[0];
  const TensorView p[] = {k.p.view()}, g[] = {k.g.view()}, m[] = {k.m.view()}, v[] = {k.v.view()};
  TS_EXPECT_ERROR(adamw_step(p, {}, m, v, {}), "adamw_step", "'grads'", "one per parameter: 1", "0");
  TS_EXPECT_ERROR(adamw_step(p, g, m, v, {.beta1 = 1.0}), "adamw_step", "'options.beta1'", "[0, 1)");
  TS_EXPECT_ERROR(adamw_step(p, g, m, v, {.lr = std::nan("")}), "adamw_step", "'options.lr'", "nan");
  TS_EXPECT_ERROR(adamw_step(p, g, m, v, {.step = 0}), "adamw_step", "'options.step'", ">= 1");
  HostTensor g16 = HostTensor::random(DType::kBFloat16, {8});
  const TensorView g16v[] = {g16.view()};
  TS_EXPECT_ERROR(adamw_step(p, g16v, m, v, {}), "adamw_step", "'grads[0]'", "float32", "bfloat16");
  HostTensor m16 = HostTensor::random(DType::kBFloat16, {8});
  const TensorView m16v[] = {m16.view()};
  TS_EXPECT_ERROR(adamw_step(p, g, m16v, v, {}), "adamw_step", "'exp_avgs[0]'", "bfloat16");
  HostTensor short_v = HostTensor::random(DType::kFloat32, {7});
  const TensorView short_vv[] = {short_v.view()};
  TS_EXPECT_ERROR(adamw_step(p, g, m, short_vv, {}), "adamw_step", "'exp_avg_sqs[0]'");
  HostTensor strided = HostTensor::random(DType::kFloat32, {2, 4}, -1, 1, 1);
  const TensorView sp[] = {strided.view()};
  HostTensor g2 = HostTensor::random(DType::kFloat32, {2, 4}), m2 = g2, v2 = g2;
  const TensorView g2v[] = {g2.view()}, m2v[] = {m2.view()}, v2v[] = {v2.view()};
  TS_EXPECT_ERROR(adamw_step(sp, g2v, m2v, v2v, {}), "adamw_step", "'params[0]'", "contiguous");
  // The gradient passed as its own first moment: an update over a read.
  TS_EXPECT_ERROR(adamw_step(p, g, g, v, {}), "adamw_step", "disjoint from", "updated while the other is read", "overlapping");
  HostTensor scale = HostTensor::from_values(DType::kFloat32, {2}, {1, 1});
  TS_EXPECT_ERROR(adamw_step(p, g, m, v, {}, scale.view()), "adamw_step", "'grad_scale'", "one element", "[2]");
}

TEST(GradNorm, NormAndClipFactor) {
  HostTensor a = HostTensor::from_values(DType::kFloat32, {1}, {3.0});
  HostTensor b = HostTensor::from_values(DType::kBFloat16, {2, 1}, {0.0, 4.0});
  HostTensor norm(DType::kFloat32, {1}), factor(DType::kFloat32, {1});
  const TensorView gs[] = {a.view(), b.view()};
  grad_norm(gs, 1.0, norm.view(), factor.view());
  EXPECT_EQ(norm.at(0), 5.0);
  EXPECT_EQ(factor.at(0), static_cast<double>(static_cast<float>(1.0 / (5.0 + 1e-6))));
  grad_norm(gs, 10.0, norm.view(), factor.view());
  EXPECT_EQ(factor.at(0), 1.0);
  grad_norm(gs, std::numeric_limits<double>::infinity(), norm.view(), factor.view());
  EXPECT_EQ(factor.at(0), 1.0);
  grad_norm({}, 1.0, norm.view(), factor.view());
  EXPECT_EQ(norm.at(0), 0.0);
  EXPECT_EQ(factor.at(0), 1.0);
  b.set(0, std::numeric_limits<double>::infinity());
  grad_norm(gs, 1.0, norm.view(), factor.view());
  EXPECT_TRUE(std::isinf(norm.at(0)));
  EXPECT_EQ(factor.at(0), 0.0);
  b.set(0, std::numeric_limits<double>::quiet_NaN());
  grad_norm(gs, 1.0, norm.view(), factor.view());
  EXPECT_TRUE(std::isnan(norm.at(0)));
  EXPECT_TRUE(std::isnan(factor.at(0)));
}

TEST(ScaleByDeviceFactor, ScalesEachTensorOrLeavesItAtOne) {
  std::vector<HostTensor> ts;
  for (DType dt : {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16})
    ts.push_back(HostTensor::random(dt, {5, 3}));
  ts[1].set(4, std::numeric_limits<double>::quiet_NaN());
  ts[2].set(7, -std::numeric_limits<double>::infinity());
  const std::vector<HostTensor> before = ts;
  std::vector<TensorView> views;
  for (HostTensor& t : ts) views.push_back(t.view());
  HostTensor factor = HostTensor::from_values(DType::kFloat32, {1}, {1.0});
  scale_by_device_factor(views, factor.view());
  for (std::size_t t = 0; t < ts.size(); ++t)
    EXPECT_EQ(std::memcmp(ts[t].data(), before[t].data(), static_cast<std::size_t>(ts[t].storage_bytes())), 0);
  factor.set(0, -0.375);
  scale_by_device_factor(views, factor.view());
  for (std::size_t t = 0; t < ts.size(); ++t) {
    for (std::int64_t i = 0; i < ts[t].numel(); ++i) {
      const double want = detail::round_to(ts[t].dtype(), before[t].at(i) * -0.375);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(ts[t].at(i)));
      } else {
        EXPECT_EQ(ts[t].at(i), want) << t << " " << i;
      }
    }
  }
  factor.set(0, std::numeric_limits<double>::quiet_NaN());
  scale_by_device_factor(views, factor.view());
  for (const HostTensor& t : ts) EXPECT_TRUE(std::isnan(t.at(0)));
  scale_by_device_factor({}, factor.view());
}

TEST(ScaleByDeviceFactor, ArgumentErrors) {
  HostTensor a = HostTensor::random(DType::kFloat32, {4, 2}), b = HostTensor::random(DType::kFloat32, {4});
  HostTensor factor = HostTensor::from_values(DType::kFloat32, {1}, {2.0});
  HostTensor factor64(DType::kFloat64, {1}), factor2(DType::kFloat32, {2}), ints(DType::kInt32, {4});
  const char* op = "scale_by_device_factor";
  const TensorView ab[] = {a.view(), b.view()}, aa[] = {a.view(), a.view()}, just_factor[] = {factor.view()};
  TS_EXPECT_ERROR(scale_by_device_factor(ab, factor64.view()), op, "'factor'", "float32", "float64");
  TS_EXPECT_ERROR(scale_by_device_factor(ab, factor2.view()), op, "'factor'", "one element", "[2]");
  TS_EXPECT_ERROR(scale_by_device_factor(ab, {}), op, "'factor'");
  TS_EXPECT_ERROR(scale_by_device_factor(aa, factor.view()), op, "'tensors[1]'", "disjoint from 'tensors[0]'");
  TS_EXPECT_ERROR(scale_by_device_factor(just_factor, factor.view()), op, "'tensors[0]'", "disjoint from 'factor'");
  HostTensor strided = HostTensor::random(DType::kFloat32, {2, 4}, -1, 1, 1);
  const TensorView padded_rows[] = {strided.view()}, integer[] = {ints.view()};
  TS_EXPECT_ERROR(scale_by_device_factor(padded_rows, factor.view()), op, "'tensors[0]'", "contiguous");
  TS_EXPECT_ERROR(scale_by_device_factor(integer, factor.view()), op, "'tensors[0]'", "int32");
}

TEST(GradNorm, ArgumentErrors) {
  HostTensor a = HostTensor::random(DType::kFloat32, {4});
  HostTensor norm(DType::kFloat32, {1}), factor(DType::kFloat32, {1}), norm64(DType::kFloat64, {1});
  const TensorView gs[] = {a.view()};
  TS_EXPECT_ERROR(grad_norm(gs, 0.0, norm.view(), factor.view()), "grad_norm", "'max_norm'", "> 0");
  TS_EXPECT_ERROR(grad_norm(gs, 1.0, norm64.view(), factor.view()), "grad_norm", "'norm'", "float32", "float64");
  TS_EXPECT_ERROR(grad_norm(gs, 1.0, norm.view(), a.view()), "grad_norm", "'clip_factor'", "one element");
  TS_EXPECT_ERROR(grad_norm(gs, 1.0, norm.view(), norm.view()), "grad_norm", "disjoint from");
}

}  // namespace
}  // namespace trainscale
