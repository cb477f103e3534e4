// adamw_step, grad_norm and scale_by_device_factor on the GPU against the fp64 CPU reference on
// the same rounded inputs: every parameter / moment dtype pair, sizes with and without a tail
// (0, 1, 7, 8, 9, 4099, 300001), views 2 bytes off alignment (the element path), grad_scale and
// the scaling factor read on the device, NaN and Inf, the norm's bits run to run, and the
// workspace error.
#include <cuda_runtime.h>

#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "core/host_dtype.h"
#include "trainscale/optim.h"
#include "util/gpu_util.h"

namespace trainscale {
namespace {

using test::DeviceTensor;
using test::HostTensor;

constexpr std::int64_t kSizes[] = {0, 1, 7, 8, 9, 4099, 300001};

// A host tensor and its device copy, the device view optionally one element past an aligned
// start (the copy holds one more element in front).
struct Both {
  HostTensor host;
  std::unique_ptr<DeviceTensor> dev;
  TensorView view;

  Both(const HostTensor& h, bool offset) : host(h) {
    if (!offset) {
      dev = std::make_unique<DeviceTensor>(h);
      view = dev->view();
      return;
    }
    HostTensor padded(h.dtype(), {h.numel() + 1});
    for (std::int64_t i = 0; i < h.numel(); ++i) padded.set(i + 1, h.at(i));
    dev = std::make_unique<DeviceTensor>(padded);
    view = TensorView(static_cast<char*>(dev->view().data) + dtype_size(h.dtype()), h.dtype(), {h.numel()},
                      Device::cuda(0));
  }
  std::vector<double> values() const {
    HostTensor all = dev->to_host();
    std::vector<double> v = all.values();
    return std::vector<double>(v.end() - host.numel(), v.end());
  }
};

TEST(AdamWCuda, MatchesReference) {
  TS_REQUIRE_GPU();
  const AdamWOptions o{.lr = 0.05, .beta1 = 0.8, .beta2 = 0.9, .eps = 1e-6, .weight_decay = 0.1, .step = 4};
  for (auto [dt, state_dt] : {std::pair{DType::kFloat32, DType::kFloat32}, {DType::kBFloat16, DType::kFloat32},
                              {DType::kBFloat16, DType::kBFloat16}, {DType::kFloat16, DType::kFloat16},
                              {DType::kFloat16, DType::kFloat32}}) {
    for (bool offset : {false, true}) {
      std::vector<HostTensor> p, g, m, v;  // the CPU's, updated by the reference
      std::vector<std::unique_ptr<Both>> dev;
      std::vector<TensorView> dp, dg, dm, dv, hp, hg, hm, hv;
      for (std::int64_t n : kSizes) {
        p.push_back(HostTensor::random(dt, {n}));
        g.push_back(HostTensor::random(dt, {n}));
        m.push_back(HostTensor::random(state_dt, {n}, -0.1, 0.1));
        v.push_back(HostTensor::random(state_dt, {n}, 0.0, 0.1));
        if (n > 3) g.back().set(3, std::numeric_limits<double>::quiet_NaN());
      }
      for (std::size_t t = 0; t < p.size(); ++t) {
        for (auto [list, host] : {std::pair{&dp, &p[t]}, {&dg, &g[t]}, {&dm, &m[t]}, {&dv, &v[t]}}) {
          list->push_back(dev.emplace_back(std::make_unique<Both>(*host, offset))->view);
        }
        hp.push_back(p[t].view());
        hg.push_back(g[t].view());
        hm.push_back(m[t].view());
        hv.push_back(v[t].view());
      }
      const HostTensor scale = HostTensor::from_values(DType::kFloat32, {1}, {0.75});
      const DeviceTensor scale_dev(scale);
      adamw_step(dp, dg, dm, dv, o, scale_dev.view());
      adamw_step(hp, hg, hm, hv, o, scale.view());
      test::device_synchronize();
      for (std::size_t t = 0; t < p.size(); ++t) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " / " + dtype_name(state_dt) + " n " +
                     std::to_string(p[t].numel()) + (offset ? " unaligned" : ""));
        EXPECT_TRUE(test::matches_reference(dev[4 * t]->values(), p[t].values(), test::tolerance(dt)));
        EXPECT_TRUE(test::matches_reference(dev[4 * t + 1]->values(), g[t].values(), 0.0));  // read only
        EXPECT_TRUE(test::matches_reference(dev[4 * t + 2]->values(), m[t].values(), test::tolerance(state_dt)));
        EXPECT_TRUE(test::matches_reference(dev[4 * t + 3]->values(), v[t].values(), test::tolerance(state_dt)));
      }
    }
  }
}

// The norm of tensors of every dtype and size, aligned and not, against the reference; the same
// bits twice; NaN and Inf reach the norm and the factor.
TEST(GradNormCuda, MatchesReferenceAndRepeats) {
  TS_REQUIRE_GPU();
  std::vector<std::unique_ptr<Both>> dev;
  std::vector<HostTensor> host;
  std::vector<TensorView> dg, hg;
  int k = 0;
  for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (std::int64_t n : kSizes) {
      host.push_back(HostTensor::random(dt, {n}));
      dev.push_back(std::make_unique<Both>(host.back(), ++k % 2 == 0));
    }
  }
  for (std::size_t t = 0; t < host.size(); ++t) {
    dg.push_back(dev[t]->view);
    hg.push_back(host[t].view());
  }
  HostTensor ws_host(DType::kInt64, {static_cast<std::int64_t>(grad_norm_workspace_bytes(dg) / 8 + 1)});
  DeviceTensor ws(ws_host, false);
  ws.poison();
  HostTensor norm(DType::kFloat32, {1}), factor(DType::kFloat32, {1});
  DeviceTensor norm_dev(norm, false), factor_dev(factor, false);
  auto run = [&](double max_norm) {
    grad_norm(dg, max_norm, norm_dev.view(), factor_dev.view(), ws.view());
    test::device_synchronize();
    return std::pair{norm_dev.to_host().at(0), factor_dev.to_host().at(0)};
  };
  grad_norm(hg, 2.0, norm.view(), factor.view());
  const auto [n1, f1] = run(2.0);
  EXPECT_NEAR(n1, norm.at(0), 1e-6 * norm.at(0));
  EXPECT_NEAR(f1, factor.at(0), 1e-6 * factor.at(0));
  const auto [n2, f2] = run(2.0);
  EXPECT_EQ(n1, n2);
  EXPECT_EQ(f1, f2);
  EXPECT_EQ(run(1e9).second, 1.0);

  HostTensor bad = HostTensor::random(DType::kBFloat16, {100});
  bad.set(17, std::numeric_limits<double>::infinity());
  Both bad_dev(bad, false);
  dg.push_back(bad_dev.view);
  HostTensor ws2_host(DType::kInt64, {static_cast<std::int64_t>(grad_norm_workspace_bytes(dg) / 8 + 1)});
  DeviceTensor ws2(ws2_host, false);
  grad_norm(dg, 1.0, norm_dev.view(), factor_dev.view(), ws2.view());
  test::device_synchronize();
  EXPECT_TRUE(std::isinf(norm_dev.to_host().at(0)));
  EXPECT_EQ(factor_dev.to_host().at(0), 0.0);
  bad.set(17, std::numeric_limits<double>::quiet_NaN());
  Both nan_dev(bad, false);
  dg.back() = nan_dev.view;
  grad_norm(dg, 1.0, norm_dev.view(), factor_dev.view(), ws2.view());
  test::device_synchronize();
  EXPECT_TRUE(std::isnan(norm_dev.to_host().at(0)));
  EXPECT_TRUE(std::isnan(factor_dev.to_host().at(0)));
}

// Sizes past the capped grid (4 waves of 16-byte units: 8.6M bf16 elements on 132 SMs) too, so
// the grid-stride loop runs.
TEST(ScaleByDeviceFactorCuda, MatchesReference) {
  TS_REQUIRE_GPU();
  std::vector<HostTensor> host;
  std::vector<std::unique_ptr<Both>> dev;
  int k = 0;
  for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    std::vector<std::int64_t> sizes(std::begin(kSizes), std::end(kSizes));
    sizes.push_back(dt == DType::kFloat32 ? 4'500'001 : 9'000'001);
    for (std::int64_t n : sizes) {
      host.push_back(HostTensor::random(dt, {n}));
      if (n > 8) host.back().set(n / 2, std::numeric_limits<double>::quiet_NaN());
      dev.push_back(std::make_unique<Both>(host.back(), ++k % 2 == 0));
    }
  }
  std::vector<TensorView> views;
  for (const auto& d : dev) views.push_back(d->view);
  for (double f : {1.0, 1.7, std::numeric_limits<double>::infinity()}) {
    const DeviceTensor factor(HostTensor::from_values(DType::kFloat32, {1}, {f}));
    scale_by_device_factor(views, factor.view());
    test::device_synchronize();
    for (std::size_t t = 0; t < host.size(); ++t) {
      std::vector<double> want = host[t].values();
      for (double& x : want) x = detail::round_to(host[t].dtype(), x * f);
      const std::vector<double> got = dev[t]->values();
      if (f == 1.0) {
        for (std::size_t i = 0; i < got.size(); ++i) {
          ASSERT_TRUE(got[i] == want[i] || (std::isnan(got[i]) && std::isnan(want[i]))) << t << " " << i;
        }
      } else {
        EXPECT_TRUE(test::matches_reference(got, want, test::tolerance(host[t].dtype()))) << t;
      }
      for (std::size_t i = 0; i < want.size(); ++i) host[t].set(static_cast<std::int64_t>(i), got[i]);
    }
  }
}

TEST(GradNormCuda, WorkspaceChecked) {
  TS_REQUIRE_GPU();
  const DeviceTensor g(HostTensor::random(DType::kBFloat16, {5000}));
  HostTensor norm(DType::kFloat32, {1});
  DeviceTensor norm_dev(norm, false), factor_dev(norm, false), small(HostTensor(DType::kInt64, {0}), false);
  const TensorView gs[] = {g.view()};
  TS_EXPECT_ERROR(grad_norm(gs, 1.0, norm_dev.view(), factor_dev.view()), "grad_norm", "'workspace'",
                  "grad_norm_workspace_bytes", "none");
  TS_EXPECT_ERROR(grad_norm(gs, 1.0, norm_dev.view(), factor_dev.view(), small.view()), "grad_norm",
                  "'workspace'", "at least");
}

}  // namespace
}  // namespace trainscale
