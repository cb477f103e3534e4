// The bench engine on a GPU: device-filled inputs are bit-identical to the host fill (which the
// reference uses), and the sampled and prefix gates pass our kernels and cuDNN's and fail wrong
// ones.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "bench/engine.h"
#include "bench/tensors.h"
#include "trainscale/loss.h"
#include "trainscale/norm.h"
#include "util/gpu_util.h"

namespace trainscale::bench {
namespace {

constexpr DType kAllDtypes[] = {DType::kFloat64, DType::kFloat32,    DType::kFloat16, DType::kBFloat16,
                                DType::kFloat8E4M3, DType::kFloat8E5M2, DType::kInt32,   DType::kInt64};

TEST(BenchFillCuda, DeviceFillIsBitIdenticalToTheHostFill) {
  TS_REQUIRE_GPU();
  // Odd sizes (tails) and one larger than the fill's grid (grid-stride loop); ranges that round
  // and, for fp8, saturate.
  for (DType dtype : kAllDtypes) {
    for (std::int64_t count : {std::int64_t{1}, std::int64_t{7}, std::int64_t{1023}, std::int64_t{3'000'017}}) {
      for (const auto& [lo, hi] : {std::pair{-1.0, 1.0}, std::pair{-1000.0, 1000.0}, std::pair{0.5, 2.0}}) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " count " + std::to_string(count) + " range " +
                     std::to_string(lo) + ".." + std::to_string(hi));
        const RandomFill fill(count * 31 + 7, lo, hi, dtype);
        const std::int64_t shape[] = {count};
        OwnedTensor host(dtype, shape, Device::cpu()), device(dtype, shape, Device::cuda()),
            back(dtype, shape, Device::cpu());
        fill_random(host.view(), fill);
        fill_random(device.view(), fill);
        copy_tensor(back.view(), device.view());
        const auto* a = static_cast<const unsigned char*>(host.view().data);
        const auto* b = static_cast<const unsigned char*>(back.view().data);
        const std::size_t size = dtype_size(dtype);
        std::int64_t first_mismatch = -1;
        for (std::int64_t i = 0; i < count && first_mismatch < 0; ++i) {
          if (std::memcmp(a + i * size, b + i * size, size) != 0) first_mismatch = i;
        }
        EXPECT_EQ(first_mismatch, -1) << "value " << random_value(fill, first_mismatch);
      }
    }
  }
}

// Integer fills with a share of special values (the targets' ignore_index) match too.
TEST(BenchFillCuda, SpecialIntegersAreTheSameOnTheDevice) {
  TS_REQUIRE_GPU();
  for (DType dtype : {DType::kInt32, DType::kInt64}) {
    RandomFill fill(11, 0, 127999, dtype);
    fill.special_share = 1.0 / 32;
    fill.special = -100;
    const std::int64_t shape[] = {100'003};
    OwnedTensor host(dtype, shape, Device::cpu()), device(dtype, shape, Device::cuda()), back(dtype, shape, Device::cpu());
    fill_random(host.view(), fill);
    fill_random(device.view(), fill);
    copy_tensor(back.view(), device.view());
    EXPECT_EQ(std::memcmp(host.view().data, back.view().data, static_cast<std::size_t>(host.bytes())), 0)
        << dtype_name(dtype);
  }
}

RunOptions quick_gpu_run(const std::vector<std::string>& ops) {
  RunOptions options;
  options.use_gpu = true;
  options.selection.suites = {"smoke"};
  options.selection.ops = ops;
  options.timing.warmup_ms = 0;
  options.timing.stop.min_time_ms = 0;
  options.timing.stop.timeout_ms = 5;
  // Smoke shapes are 64 x 512 (norms): backward passes gate on the first 16 rows, forward
  // passes on 8 sampled rows.
  options.gate = {.full_check_elements = 16 * 512, .sampled_rows = 8, .prefix_elements = 16 * 512};
  return options;
}

TEST(BenchGateCuda, NormKernelsAndBaselinesPassThePrefixAndSampledGates) {
  TS_REQUIRE_GPU();
  const RunOptions options = quick_gpu_run({"rmsnorm_forward", "rmsnorm_backward", "fused_add_rmsnorm_forward",
                                            "fused_add_rmsnorm_backward", "layernorm_forward", "layernorm_backward"});
  RunResult result;
  run_cases(Registry::global(), options, result);
  ASSERT_FALSE(result.rows.empty());
  int ours = 0;
  for (const Row& r : result.rows) {
    SCOPED_TRACE(r.key());
    if (r.status == Status::kUnsupported) continue;  // e.g. cuDNN not loadable here
    EXPECT_EQ(r.status, Status::kOk) << r.message;
    EXPECT_EQ(r.rows_total, 64);
    const bool backward = r.op.ends_with("_backward");
    EXPECT_EQ(r.rows_coverage, backward ? RowCoverage::kPrefix : RowCoverage::kSample);
    EXPECT_EQ(r.rows_checked, backward ? 16 : 8);
    EXPECT_GT(r.ms.count, 0);
    ours += r.impl == kOursGpu;
  }
  EXPECT_EQ(ours, 12);  // 6 ops x (fp32, bf16)
}

// The forced norm kernel variants (opt-in implementations) pass the same gates when named:
// the smoke shape (64 x 512) is aligned and short, so every variant runs it.
TEST(BenchGateCuda, NormVariantsPassTheGatesWhenNamed) {
  TS_REQUIRE_GPU();
  RunOptions options = quick_gpu_run({"rmsnorm_forward", "rmsnorm_backward", "fused_add_rmsnorm_forward",
                                      "fused_add_rmsnorm_backward", "layernorm_forward", "layernorm_backward"});
  options.selection.impls = {"trainscale-registers", "trainscale-two-pass", "trainscale-rows",
                             "trainscale-pipelined"};
  RunResult result;
  run_cases(Registry::global(), options, result);
  // 6 ops x (fp32, bf16) x 2 variants, and the rows and pipelined variants of the 3 forward ops.
  EXPECT_EQ(result.rows.size(), 12u * 2 + 6 * 2);
  for (const Row& r : result.rows) {
    SCOPED_TRACE(r.key());
    EXPECT_EQ(r.status, Status::kOk) << r.message;
    EXPECT_TRUE(r.baseline);
    EXPECT_GT(r.ms.count, 0);
  }
}

// A case of `op` whose entry runs our kernel with a weight offset the reference does not have.
void add_wrong(Registry& registry, const std::string& op) {
  const CaseFactory make = registry.find_op(op)->make;
  const std::string wrong = op + "_wrong";
  registry.add_op({wrong, "norm", "M x N", [=](std::span<const std::int64_t> shape, DType dtype) {
                     Case c = make(shape, dtype);
                     c.op = wrong;
                     RMSNormOptions off;
                     off.weight_offset = 0.05;
                     if (op == "rmsnorm_forward") {
                       const auto [x, w, y, rstd] = c.ids("x", "weight", "y", "rstd");
                       c.entry = [=](CaseTensors t, cudaStream_t s) {
                         rmsnorm_forward(t[x], t[w], t[y], t[rstd], off, s);
                       };
                     } else {
                       const auto [dy, x, w, rstd, dx, dw, ws] =
                           c.ids("dy", "x", "weight", "rstd", "dx", "dw", "workspace");
                       c.entry = [=](CaseTensors t, cudaStream_t s) {
                         rmsnorm_backward(t[dy], t[x], t[w], t[rstd], t[dx], t[dw], t[ws], off, s);
                       };
                     }
                     return c;
                   }});
  registry.add_configs("smoke", wrong, {{64, 512}}, {DType::kBFloat16});
}

TEST(BenchGateCuda, WrongKernelsFailThePrefixAndSampledGates) {
  TS_REQUIRE_GPU();
  Registry registry = Registry::global();
  add_wrong(registry, "rmsnorm_forward");
  add_wrong(registry, "rmsnorm_backward");
  const RunOptions options = quick_gpu_run({"rmsnorm_forward_wrong", "rmsnorm_backward_wrong"});
  RunResult result;
  run_cases(registry, options, result);
  ASSERT_EQ(result.rows.size(), 2u);
  for (const Row& r : result.rows) {
    SCOPED_TRACE(r.key());
    EXPECT_EQ(r.status, Status::kFailed);
    EXPECT_EQ(r.ms.count, 0);
  }
  EXPECT_EQ(result.rows[0].rows_coverage, RowCoverage::kSample);
  EXPECT_EQ(result.rows[1].rows_coverage, RowCoverage::kPrefix);
  EXPECT_NE(result.rows[1].message.find("prefix problem: the first 16 of 64 rows"), std::string::npos)
      << result.rows[1].message;
}

// The fused linear cross-entropy's own sampled gate passes our CUDA path and the unfused
// baseline at a shape of several token chunks (bf16: two, with grad_weight summed in float32;
// fp32: three), and fails our path run with label smoothing, which the reference does not have.
TEST(BenchGateCuda, FusedLinearCrossEntropyPassesItsSampledGate) {
  TS_REQUIRE_GPU();
  const std::string op = "fused_linear_cross_entropy_forward", wrong = op + "_wrong";
  const std::vector<std::int64_t> shape = {8192, 256, 40000};
  Registry registry = Registry::global();
  const CaseFactory make = registry.find_op(op)->make;
  registry.add_op({wrong, "loss", "T x H x V", [=](std::span<const std::int64_t> config, DType dtype) {
                     Case c = make(config, dtype);
                     c.op = wrong;
                     const auto [h, w, t, loss, lse, gh, gw, ws] = c.ids("hidden", "weight", "targets", "loss", "lse",
                                                                      "grad_hidden", "grad_weight", "workspace");
                     CrossEntropyOptions smoothed;
                     smoothed.label_smoothing = 0.1;
                     c.entry = [=](CaseTensors v, cudaStream_t s) {
                       fused_linear_cross_entropy_forward({.hidden = v[h], .weight = v[w], .targets = v[t],
                                                           .loss = v[loss], .lse = v[lse], .grad_hidden = v[gh],
                                                           .grad_weight = v[gw], .workspace = v[ws]},
                                                          smoothed, s);
                     };
                     return c;
                   }});
  for (const std::string& name : {op, wrong}) {
    registry.add_configs("smoke", name, {shape}, {DType::kBFloat16, DType::kFloat32});
  }
  RunOptions options = quick_gpu_run({op, wrong});
  options.selection.configs = {shape};
  options.gate.reference_flops = 2e9;
  RunResult result;
  run_cases(registry, options, result);
  ASSERT_EQ(result.rows.size(), 6u);  // (trainscale, unfused) x (bf16, fp32), then the wrong one's
  for (const Row& r : result.rows) {
    SCOPED_TRACE(r.key());
    EXPECT_EQ(r.rows_coverage, RowCoverage::kCaseSample);
    EXPECT_NE(r.gate_scope.find("of 8192 tokens"), std::string::npos) << r.gate_scope;
    if (r.op == wrong) {
      EXPECT_EQ(r.status, Status::kFailed);
      EXPECT_NE(r.message.find("[fp64 on the host"), std::string::npos) << r.message;
      continue;
    }
    EXPECT_EQ(r.status, Status::kOk) << r.message;
    EXPECT_GT(r.extra_memory_bytes, 0);
  }
}

}  // namespace
}  // namespace trainscale::bench
