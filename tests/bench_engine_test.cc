// The correctness gate and the engine on test-only cases (CPU).
#include <gtest/gtest.h>

#include <cmath>

#include "bench/engine.h"
#include "bench/gate.h"
#include "bench/interrupt.h"
#include "bench/registry.h"
#include "bench/reporters.h"
#include "core/check.h"
#include "core/host_dtype.h"
#include "trainscale/error.h"

namespace trainscale::bench {
namespace {

TEST(BenchGate, CheckValues) {
  EXPECT_TRUE(check_values({1, 2, 3}, {1, 2, 3}, 0).ok);
  EXPECT_TRUE(check_values({1.0001, 2, 3}, {1, 2, 3}, 1e-3).ok);
  const ValueCheck off = check_values({1.1, 2, 3}, {1, 2, 3}, 1e-3);
  EXPECT_FALSE(off.ok);
  EXPECT_NE(off.problem.find("relative L2 error"), std::string::npos);
  EXPECT_NEAR(off.max_abs, 0.1, 1e-12);
  const ValueCheck nan = check_values({1, NAN, 3}, {1, 2, 3}, 1e-2);
  EXPECT_FALSE(nan.ok);
  EXPECT_NE(nan.problem.find("NaN at 1"), std::string::npos);
  EXPECT_TRUE(check_values({1, NAN, INFINITY}, {1, NAN, INFINITY}, 1e-5).ok);
  EXPECT_FALSE(check_values({1, 2, 3}, {1, NAN, 3}, 1e-5).ok);  // NaN expected, finite given
  EXPECT_FALSE(check_values({1, 2, 3.0000001}, {1, 2, 3}, 0).ok);  // bit-exact
  EXPECT_FALSE(check_values({1, 2}, {1, 2, 3}, 1).ok);
  EXPECT_EQ(default_tolerance(DType::kFloat32), 1e-5);
  EXPECT_EQ(default_tolerance(DType::kFloat16), 2e-3);
  EXPECT_EQ(default_tolerance(DType::kBFloat16), 1e-2);
  EXPECT_EQ(default_tolerance(DType::kFloat8E4M3), 0.0);
}

// y = 2 x, row-wise; `scale` lets a test make the implementation wrong.
Case doubling_case(std::span<const std::int64_t> shape, DType dtype, double scale, bool throw_unsupported) {
  Case c;
  c.op = "double";
  c.family = "test";
  c.shape.assign(shape.begin(), shape.end());
  c.dtype = dtype;
  TensorSpec x{.name = "x", .dtype = dtype, .shape = c.shape, .role = Role::kInput, .row_wise = true};
  TensorSpec y = x;
  y.name = "y";
  y.role = Role::kOutput;
  c.tensors = {x, y};
  c.bytes = 2.0 * static_cast<double>(shape[0] * shape[1]) * static_cast<double>(dtype_size(dtype));
  c.flops = static_cast<double>(shape[0] * shape[1]);
  c.rows_independent = true;
  auto apply = [](Views t, double factor) {
    for (std::int64_t i = 0; i < t[0].numel(); ++i) {
      detail::store_from_double(t[1].dtype, t[1].data, i, factor * detail::load_as_double(t[0].dtype, t[0].data, i));
    }
  };
  c.entry = [=](Views t, cudaStream_t) {
    if (throw_unsupported) throw Unsupported("no kernel for this dtype yet");
    apply(t, 2.0 * scale);
  };
  c.reference = [=](Views t) {
    EXPECT_EQ(t[0].dtype, DType::kFloat64);  // float64 copies of the inputs
    apply(t, 2.0);
  };
  return c;
}

struct EngineFixture : ::testing::Test {
  Registry registry;
  RunOptions options;
  RunResult result;

  void SetUp() override {
    options.selection.suites = {"smoke"};
    options.timing.warmup_ms = 0;
    options.timing.stop.min_time_ms = 0;
    options.timing.stop.timeout_ms = 20;
  }
  void add(const std::string& op, double scale, bool unsupported = false) {
    registry.add_op({op, "test", "M x N", [=](std::span<const std::int64_t> s, DType d) {
                       Case c = doubling_case(s, d, scale, unsupported);
                       c.op = op;
                       return c;
                     }});
    registry.add_configs("smoke", op, {{8, 16}}, {DType::kFloat32});
  }
  const Row& row(const std::string& op) {
    for (const Row& r : result.rows) {
      if (r.op == op) return r;
    }
    throw std::runtime_error("no row for " + op);
  }
};

TEST_F(EngineFixture, CorrectImplementationIsGatedAndTimed) {
  add("good", 1.0);
  run_cases(registry, options, result);
  ASSERT_EQ(result.rows.size(), 1u);
  const Row& r = row("good");
  EXPECT_EQ(r.status, Status::kOk) << r.message;
  EXPECT_EQ(r.impl, "cpu-ref");
  EXPECT_EQ(r.device, "cpu");
  EXPECT_EQ(r.timer, "host");
  EXPECT_GE(r.ms.count, 1);
  EXPECT_GT(r.gbps, 0);
  EXPECT_EQ(r.rel_l2, 0);
  EXPECT_EQ(r.rows_checked, 8);
  EXPECT_EQ(r.peak_memory_bytes, 8 * 16 * 4);
  EXPECT_FALSE(r.pct_roofline.has_value());  // no roofline on the CPU
  EXPECT_FALSE(result.any_failed());
}

TEST_F(EngineFixture, ImplementationOffByAFewPercentFailsAndIsNotTimed) {
  add("good", 1.0);
  add("wrong", 1.03);
  run_cases(registry, options, result);
  const Row& r = row("wrong");
  EXPECT_EQ(r.status, Status::kFailed);
  EXPECT_NE(r.message.find("output 'y': relative L2 error"), std::string::npos) << r.message;
  EXPECT_NEAR(r.rel_l2, 0.03, 1e-6);
  EXPECT_EQ(r.ms.count, 0);
  EXPECT_EQ(row("good").status, Status::kOk);
  EXPECT_TRUE(result.any_failed());
}

TEST_F(EngineFixture, UnsupportedIsReportedNotFailed) {
  add("later", 1.0, /*unsupported=*/true);
  run_cases(registry, options, result);
  EXPECT_EQ(row("later").status, Status::kUnsupported);
  EXPECT_EQ(row("later").message, "no kernel for this dtype yet");
  EXPECT_FALSE(result.any_failed());
}

// An op that has only its CPU reference, on a device it has no kernel for (a GPU run): our row
// is UNSUPPORTED with the entry point's reason, and the baseline is still gated and timed and
// shown against it, without a speedup. The engine treats every device alike, so this runs on
// the CPU with an entry point that throws what a CPU-only op throws for CUDA tensors.
TEST_F(EngineFixture, BaselineIsTimedWhenOursHasNoKernelForTheDevice) {
  registry.add_op({"reference_only", "test", "M x N", [](std::span<const std::int64_t> s, DType d) {
                     Case c = doubling_case(s, d, 1.0, false);
                     c.op = "reference_only";
                     c.entry = [](Views, cudaStream_t) { detail::throw_no_cuda_kernel("reference_only"); };
                     return c;
                   }});
  registry.add_configs("smoke", "reference_only", {{8, 16}}, {DType::kFloat32});
  registry.add_baseline(
      "reference_only", "vendor",
      [](const Case& c) -> std::optional<Implementation> {
        Implementation impl;
        impl.run = doubling_case(c.shape, c.dtype, 1.0, false).entry;
        return impl;
      },
      /*on_gpu=*/false);
  run_cases(registry, options, result);
  ASSERT_EQ(result.rows.size(), 2u);
  const Row& ours = result.rows[0];
  const Row& vendor = result.rows[1];
  EXPECT_FALSE(ours.baseline);
  EXPECT_EQ(ours.status, Status::kUnsupported);
  EXPECT_NE(ours.message.find("has only its CPU reference so far"), std::string::npos) << ours.message;
  EXPECT_EQ(ours.ms.count, 0);
  EXPECT_TRUE(vendor.baseline);
  EXPECT_EQ(vendor.impl, "vendor");
  EXPECT_EQ(vendor.status, Status::kOk) << vendor.message;
  EXPECT_GE(vendor.ms.count, 1);
  EXPECT_FALSE(result.any_failed());
  const std::vector<Pairing> pairs = pair_rows(result.rows);
  ASSERT_EQ(pairs.size(), 1u);
  EXPECT_EQ(format_ms(pairs[0].ours), "UNSUPPORTED");
  EXPECT_EQ(pairs[0].base, &vendor);
  EXPECT_EQ(pairs[0].speedup(), 0.0);
}

TEST_F(EngineFixture, FiltersSelectConfigs) {
  add("a", 1.0);
  add("b", 1.0);
  registry.add_configs("smoke", "a", {{4, 4}}, {DType::kBFloat16});
  options.selection.ops = {"a"};
  EXPECT_EQ(select_configs(registry, options.selection).size(), 2u);
  options.selection.dtypes = {DType::kBFloat16};
  ASSERT_EQ(select_configs(registry, options.selection).size(), 1u);
  options.selection.dtypes = {};
  options.selection.configs = {{8, 16}};
  ASSERT_EQ(select_configs(registry, options.selection).size(), 1u);
  options.selection.impls = {"trainscale"};  // not the CPU implementation: nothing runs
  run_cases(registry, options, result);
  EXPECT_TRUE(result.rows.empty());
}

TEST_F(EngineFixture, UnbuildableConfigsAreSkippedAndListed) {
  add("a", 1.0);
  registry.add_configs("smoke", "a", {{4, 4, 4}}, {DType::kFloat32});
  registry.add_op({"broken", "test", "-", [](std::span<const std::int64_t>, DType) -> Case {
                     throw Unsupported("expects a 2-dim config");
                   }});
  registry.add_configs("smoke", "broken", {{4, 4}}, {DType::kFloat32});
  run_cases(registry, options, result);
  ASSERT_EQ(result.skipped.size(), 1u);
  EXPECT_EQ(result.skipped[0].case_name, "broken 4x4 float32");
  EXPECT_EQ(result.skipped[0].reason, "expects a 2-dim config");
}

TEST_F(EngineFixture, InterruptKeepsWhatWasMeasured) {
  add("a", 1.0);
  request_interrupt();
  run_cases(registry, options, result);
  clear_interrupt();
  EXPECT_TRUE(result.interrupted);
  EXPECT_TRUE(result.rows.empty());
  ASSERT_EQ(result.skipped.size(), 1u);
  EXPECT_EQ(result.skipped[0].reason, "not run: interrupted");
}

TEST(BenchGate, LargeRowWiseCasesAreSampled) {
  const std::int64_t shape[] = {GateData::kFullCheckElements / 64 * 2, 64};
  const Case c = doubling_case(shape, DType::kBFloat16, 1.0, false);
  const GateData gate(c, 5);
  EXPECT_TRUE(gate.sampled());
  std::vector<OwnedTensor> tensors;
  for (const TensorSpec& spec : c.tensors) tensors.emplace_back(spec.dtype, spec.shape, Device::cpu());
  gate.load_inputs(tensors);
  const std::vector<TensorView> views = {tensors[0].view(), tensors[1].view()};
  c.entry(views, nullptr);
  const GateResult ok = gate.check(tensors);
  EXPECT_TRUE(ok.passed) << ok.message;
  EXPECT_EQ(ok.rows_checked, GateData::kSampledRows);
  EXPECT_EQ(ok.rows_total, shape[0]);
}

TEST(BenchRegistry, ParseNames) {
  EXPECT_EQ(parse_dtype("bf16"), DType::kBFloat16);
  EXPECT_EQ(parse_dtype("float32"), DType::kFloat32);
  EXPECT_FALSE(parse_dtype("fp7"));
  EXPECT_EQ(parse_shape("32768x4096"), (std::vector<std::int64_t>{32768, 4096}));
  EXPECT_EQ(parse_shape("4x8x16"), (std::vector<std::int64_t>{4, 8, 16}));
  for (const char* bad : {"", "x", "12x", "x12", "12xx4", "1a", "-3x4"}) EXPECT_FALSE(parse_shape(bad)) << bad;
  EXPECT_EQ(shape_str(std::vector<std::int64_t>{2, 3}), "2x3");
  EXPECT_EQ(case_seed(1, "a"), case_seed(1, "a"));
  EXPECT_NE(case_seed(1, "a"), case_seed(1, "b"));
}

TEST(BenchRegistry, GlobalRegistryHasEveryDesignSuiteAndSmokeCoversEveryOp) {
  const Registry& r = Registry::global();
  for (const char* suite : kSuiteNames) EXPECT_TRUE(r.has_suite(suite)) << suite;
  for (const std::string& op : r.op_names()) {
    bool in_smoke = false;
    for (const Config& c : r.suite("smoke")) in_smoke = in_smoke || c.op == op;
    EXPECT_TRUE(in_smoke) << op << " has no smoke config";
  }
  EXPECT_THROW(Registry().add_configs("no-such-suite", "x", {{1}}, {DType::kFloat32}), Error);
}

}  // namespace
}  // namespace trainscale::bench

namespace trainscale::bench {
namespace {

TEST(SelectConfigs, SeveralSuitesKeepOrderAndListEachConfigOnce) {
  const Registry& registry = Registry::global();
  Selection one;
  one.suites = {"quack"};
  Selection twice;
  twice.suites = {"quack", "smoke", "quack"};
  Selection smoke;
  smoke.suites = {"smoke"};
  const auto a = select_configs(registry, one);
  const auto b = select_configs(registry, twice);
  ASSERT_FALSE(a.empty());
  ASSERT_EQ(b.size(), a.size() + select_configs(registry, smoke).size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_EQ(b[i].op, a[i].op);
}

}  // namespace
}  // namespace trainscale::bench
