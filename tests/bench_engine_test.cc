// The correctness gate and the engine on test-only cases (CPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <thread>

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
  const auto [in, out] = c.ids("x", "y");
  auto apply = [=](CaseTensors t, double factor) {
    for (std::int64_t i = 0; i < t[in].numel(); ++i) {
      detail::store_from_double(t[out].dtype, t[out].data, i, factor * detail::load_as_double(t[in].dtype, t[in].data, i));
    }
  };
  c.entry = [=](CaseTensors t, cudaStream_t) {
    if (throw_unsupported) throw Unsupported("no kernel for this dtype yet");
    apply(t, 2.0 * scale);
  };
  c.reference = [=](CaseTensors t) {
    // float64 copies of the inputs. The reference runs on the gate's worker thread, which may
    // outlive the test (an abandoned reference): a throw fails the gate, where a gtest assertion
    // there would report into whichever test runs then.
    if (t[in].dtype != DType::kFloat64) throw std::logic_error("the reference was given non-float64 inputs");
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
  EXPECT_EQ(r.bytes_read, 8 * 16 * 4);  // x read, y written
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

// An op that has only its CPU reference, on a device it has no kernel for (a GPU run): the case
// is listed as "CPU reference only", its baselines are not run and its reference is never
// computed (a host reference can take minutes at a real shape). Named alone, the baseline is still
// gated and timed. The engine treats every device alike, so this runs on the CPU with an entry
// point that throws what a CPU-only op throws for CUDA tensors.
struct ReferenceOnlyFixture : EngineFixture {
  std::shared_ptr<std::atomic<int>> reference_calls = std::make_shared<std::atomic<int>>(0);
  void SetUp() override {
    EngineFixture::SetUp();
    auto calls = reference_calls;
    registry.add_op({"reference_only", "test", "M x N", [calls](std::span<const std::int64_t> s, DType d) {
                       Case c = doubling_case(s, d, 1.0, false);
                       c.op = "reference_only";
                       c.entry = [](CaseTensors, cudaStream_t) { detail::throw_no_cuda_kernel("reference_only"); };
                       auto reference = c.reference;
                       c.reference = [calls, reference](CaseTensors t) {
                         ++*calls;
                         reference(t);
                       };
                       return c;
                     }});
    registry.add_configs("smoke", "reference_only", {{8, 16}}, {DType::kFloat32});
    registry.add_baseline(
        "reference_only", "vendor",
        [](const Case& c) -> std::optional<Implementation> {
          Implementation impl;
          impl.baseline = true;
          impl.run = doubling_case(c.shape, c.dtype, 1.0, false).entry;
          return impl;
        },
        /*on_gpu=*/false);
  }
};

TEST_F(ReferenceOnlyFixture, CaseIsListedAndNeitherBaselineNorReferenceRuns) {
  run_cases(registry, options, result);
  EXPECT_TRUE(result.rows.empty());
  ASSERT_EQ(result.skipped.size(), 1u);
  EXPECT_EQ(result.skipped[0].case_name, "reference_only 8x16 float32");
  EXPECT_EQ(result.skipped[0].reason, kCpuReferenceOnly);
  EXPECT_EQ(reference_calls->load(), 0);
  EXPECT_FALSE(result.any_failed());
  const std::vector<std::string> summary = summary_lines(result);
  EXPECT_NE(std::find(summary.begin(), summary.end(), "CPU reference only (not run on the GPU): reference_only"),
            summary.end());
}

TEST_F(ReferenceOnlyFixture, BaselineNamedAloneIsGatedAndTimed) {
  options.selection.impls = {"vendor"};
  run_cases(registry, options, result);
  ASSERT_EQ(result.rows.size(), 1u);
  const Row& vendor = result.rows[0];
  EXPECT_TRUE(vendor.baseline);
  EXPECT_EQ(vendor.status, Status::kOk) << vendor.message;
  EXPECT_GE(vendor.ms.count, 1);
  EXPECT_EQ(reference_calls->load(), 1);
}

// A baseline that fails its gate is reported FAILED, but only our failures fail the run.
TEST_F(EngineFixture, FailingBaselineDoesNotFailTheRun) {
  add("op", 1.0);
  registry.add_baseline(
      "op", "wrong-vendor",
      [](const Case& c) -> std::optional<Implementation> {
        Implementation impl;
        impl.baseline = true;
        impl.run = doubling_case(c.shape, c.dtype, 1.1, false).entry;
        return impl;
      },
      /*on_gpu=*/false);
  run_cases(registry, options, result);
  ASSERT_EQ(result.rows.size(), 2u);
  EXPECT_EQ(result.rows[0].status, Status::kOk);
  EXPECT_EQ(result.rows[1].status, Status::kFailed);
  EXPECT_FALSE(result.any_failed());
  result.rows[0].status = Status::kFailed;
  EXPECT_TRUE(result.any_failed());
}

// Ctrl-C while a slow host reference runs: the engine stops waiting within a poll interval,
// keeps what it has, and leaves the reference to finish on its own thread.
TEST_F(EngineFixture, InterruptStopsTheWaitForASlowReference) {
  auto finish = std::make_shared<std::atomic<bool>>(false);
  registry.add_op({"slow", "test", "M x N", [finish](std::span<const std::int64_t> s, DType d) {
                     Case c = doubling_case(s, d, 1.0, false);
                     c.op = "slow";
                     auto reference = c.reference;
                     c.reference = [finish, reference](CaseTensors t) {
                       const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
                       while (!finish->load() && std::chrono::steady_clock::now() < until) {
                         std::this_thread::sleep_for(std::chrono::milliseconds(5));
                       }
                       reference(t);
                     };
                     return c;
                   }});
  registry.add_configs("smoke", "slow", {{8, 16}}, {DType::kFloat32});
  add("after", 1.0);
  std::thread ctrl_c([] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    request_interrupt();
  });
  const auto start = std::chrono::steady_clock::now();
  run_cases(registry, options, result);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ctrl_c.join();
  clear_interrupt();
  EXPECT_LT(seconds, 2.0);
  EXPECT_TRUE(result.interrupted);
  ASSERT_EQ(result.rows.size(), 1u);
  EXPECT_EQ(result.rows[0].status, Status::kInterrupted);
  EXPECT_TRUE(abandoned_references_running());
  finish->store(true);
  for (int i = 0; i < 200 && abandoned_references_running(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_FALSE(abandoned_references_running());
  ASSERT_EQ(result.skipped.size(), 1u);
  EXPECT_EQ(result.skipped[0].reason, "not run: interrupted");
}

// A batch of launches stays cold when each launch's set was last used 2x the L2's bytes ago.
TEST(BenchEngine, ColdInputSets) {
  constexpr std::int64_t kL2 = 50 << 20;
  EXPECT_EQ(cold_input_sets(32 << 20, kL2, 32), 5);    // 4 others move 128 MiB >= 100 MiB
  EXPECT_EQ(cold_input_sets(1 << 20, kL2, 40), 40);    // never more sets than launches
  EXPECT_EQ(cold_input_sets(200 << 20, kL2, 8), 2);    // one other set already flushes it
  EXPECT_EQ(cold_input_sets(1, kL2, 200), 200);
}

// DRAM's ceiling follows the row's read share: the copy's up to 1:1, then the measured mixes.
TEST(BenchEngine, MemoryCeilingFollowsTheReadShare) {
  Roofline r;
  r.copy_gbps = 3000;
  r.read2_write1_gbps = 3090;
  r.read_gbps = 3120;
  r.gemm_bf16_tflops = 800;
  EXPECT_DOUBLE_EQ(memory_ceiling_gbps(r, 0.2), 3000);  // write-heavy: the copy's
  EXPECT_DOUBLE_EQ(memory_ceiling_gbps(r, 0.5), 3000);
  EXPECT_NEAR(memory_ceiling_gbps(r, 0.6), 3054, 1e-9);  // 3 reads per 2 writes
  EXPECT_NEAR(memory_ceiling_gbps(r, 2.0 / 3.0), 3090, 1e-9);
  EXPECT_NEAR(memory_ceiling_gbps(r, 1.0), 3120, 1e-9);
  // 3060 GB/s at two reads per write is 99 % of its ceiling, not 102 % of the copy's.
  EXPECT_NEAR(*percent_of_roofline(r, Bound::kMemory, 3059.1, 0, 2.0 / 3.0), 99.0, 1e-9);
  EXPECT_NEAR(*percent_of_roofline(r, Bound::kCompute, 0, 400, 2.0 / 3.0), 50.0, 1e-9);
  r.read2_write1_gbps = 0;  // a cache from before that ceiling was measured
  EXPECT_DOUBLE_EQ(memory_ceiling_gbps(r, 0.9), 3000);
  EXPECT_FALSE(percent_of_roofline(std::nullopt, Bound::kMemory, 1000, 0, 0.5).has_value());
}

// A cold DRAM-sized row at a measured mix that beats its ceiling raises it; small, warm or
// in-between rows do not, and every memory-bound % follows the raised ceiling.
TEST(BenchEngine, RowsFasterThanACeilingRaiseIt) {
  RunResult result;
  result.env.l2_bytes = 50 << 20;
  Roofline r;
  r.copy_gbps = 3000;
  r.read2_write1_gbps = 3060;
  r.read_gbps = 3100;
  r.gemm_bf16_tflops = 800;
  result.roofline = r;
  const auto row = [&](const char* impl, double gbps, double bytes, double read_share, bool cold) {
    Row x;
    x.case_name = "softmax_backward 32768x32768 bfloat16";
    x.impl = impl;
    x.cold = cold;
    x.bytes = bytes;
    x.bytes_read = bytes * read_share;
    x.gbps = gbps;
    x.pct_roofline = percent_of_roofline(result.roofline, Bound::kMemory, gbps, 0, read_share);
    result.rows.push_back(x);
  };
  row("trainscale", 2900, 6e9, 2.0 / 3.0, true);
  row("torch-compile", 3090, 6e9, 2.0 / 3.0, true);   // raises 2 reads per write to 3090
  row("liger", 3080, 6e9, 2.0 / 3.0, true);
  row("small", 3300, 1e8, 2.0 / 3.0, true);           // under 4x the L2: partly cached
  row("warm", 3300, 6e9, 2.0 / 3.0, false);
  row("between", 3070, 6e9, 0.6, true);                // no anchor at 3 reads per 2 writes
  EXPECT_NEAR(*result.rows[0].pct_roofline, 100.0 * 2900 / 3060, 1e-9);
  raise_ceilings_to_rows(result);
  EXPECT_DOUBLE_EQ(result.roofline->read2_write1_gbps, 3090);
  EXPECT_DOUBLE_EQ(result.roofline->copy_gbps, 3000);
  EXPECT_DOUBLE_EQ(result.roofline->read_gbps, 3100);
  ASSERT_EQ(result.roofline->raised_by.size(), 1u);
  EXPECT_NE(result.roofline->raised_by[0].find("torch-compile"), std::string::npos);
  EXPECT_NE(result.roofline->raised_by[0].find("3060"), std::string::npos);
  EXPECT_NEAR(*result.rows[0].pct_roofline, 100.0 * 2900 / 3090, 1e-9);
  EXPECT_NEAR(*result.rows[1].pct_roofline, 100.0, 1e-9);
  EXPECT_LE(*result.rows[1].pct_roofline, 100.0);  // the row that set it: no rounding above
  // 6 GiB of which 4 read at 3064.51821683972 GB/s: 100 * g / g would give 100.00000000000001.
  Roofline exact = r;
  exact.read2_write1_gbps = 3064.51821683972;
  EXPECT_EQ(*percent_of_roofline(exact, Bound::kMemory, 3064.51821683972, 0, 4294967296.0 / 6442450944.0), 100.0);
  EXPECT_NEAR(*result.rows[5].pct_roofline, 100.0 * 3070 / (3000 + 90 * 0.6), 1e-9);
  raise_ceilings_to_rows(result);  // idempotent: nothing beats the raised ceiling
  EXPECT_EQ(result.roofline->raised_by.size(), 1u);
}

// Opt-in implementations (forced kernel variants) run only when the selection names them, are
// gated and timed like baselines, and one that cannot run a shape is UNSUPPORTED.
TEST_F(EngineFixture, OptInImplementationsRunOnlyWhenNamed) {
  add("op", 1.0);
  const auto opt_in = [](bool supported) {
    return [supported](const Case& c) -> std::optional<Implementation> {
      Implementation impl;
      impl.run = supported ? doubling_case(c.shape, c.dtype, 1.0, false).entry
                           : [](CaseTensors, cudaStream_t) { throw UnsupportedVariantError("not for this shape"); };
      return impl;
    };
  };
  registry.add_opt_in("op", "ours-forced", opt_in(true), /*on_gpu=*/false);
  registry.add_opt_in("op", "ours-unfit", opt_in(false), /*on_gpu=*/false);
  EXPECT_EQ(registry.opt_in_names(), (std::vector<std::string>{"ours-forced", "ours-unfit"}));
  EXPECT_TRUE(registry.baseline_names().empty());

  run_cases(registry, options, result);
  ASSERT_EQ(result.rows.size(), 1u);  // not named: only ours
  EXPECT_EQ(result.rows[0].impl, "cpu-ref");

  result = {};
  options.selection.impls = {"cpu-ref", "ours-forced", "ours-unfit"};
  run_cases(registry, options, result);
  ASSERT_EQ(result.rows.size(), 3u);
  const Row& forced = result.rows[1];
  EXPECT_EQ(forced.impl, "ours-forced");
  EXPECT_TRUE(forced.baseline);
  EXPECT_EQ(forced.status, Status::kOk) << forced.message;
  EXPECT_GE(forced.ms.count, 1);
  const Row& unfit = result.rows[2];
  EXPECT_EQ(unfit.impl, "ours-unfit");
  EXPECT_EQ(unfit.status, Status::kUnsupported);
  EXPECT_EQ(unfit.message, "not for this shape");
  EXPECT_FALSE(result.any_failed());
  // Reported like baselines: each paired with ours.
  const std::vector<Pairing> pairs = pair_rows(result.rows);
  ASSERT_EQ(pairs.size(), 2u);
  EXPECT_EQ(pairs[0].ours, &result.rows[0]);
  EXPECT_EQ(pairs[0].base, &forced);
  EXPECT_GT(pairs[0].speedup(), 0.0);
  EXPECT_EQ(pairs[1].base, &unfit);

  result = {};
  options.selection.impls = {"ours-forced"};  // alone
  run_cases(registry, options, result);
  ASSERT_EQ(result.rows.size(), 1u);
  EXPECT_EQ(result.rows[0].impl, "ours-forced");
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

// A full host set of a case's tensors with the gate's inputs, after `entry` ran on the gated
// views; returns the gate's verdict.
GateResult gate_on_cpu(const Case& c, const GateData& gate, const std::function<void(CaseTensors, cudaStream_t)>& entry) {
  std::vector<OwnedTensor> tensors;
  for (const TensorSpec& spec : c.tensors) tensors.emplace_back(spec.dtype, spec.shape, Device::cpu());
  gate.load_inputs(tensors);
  entry(gate.gated_views(tensors), nullptr);
  return gate.check(tensors);
}

// The case's entry with its float32 output `name` then scaled by 1.01: wrong, but only just.
std::function<void(CaseTensors, cudaStream_t)> off_by_one_percent(const Case& c, std::string_view name) {
  const TensorId out_id = c.id(name);
  return [&c, out_id](CaseTensors t, cudaStream_t s) {
    c.entry(t, s);
    auto* out = static_cast<float*>(t[out_id].data);
    for (std::int64_t i = 0; i < t[out_id].numel(); ++i) out[i] *= 1.01f;
  };
}

TEST(BenchGate, LargeRowWiseCasesAreSampled) {
  const GateLimits limits;
  const std::int64_t shape[] = {limits.full_check_elements / 64 * 2, 64};
  const Case c = doubling_case(shape, DType::kBFloat16, 1.0, false);
  const GateData gate(c, 5);
  EXPECT_EQ(gate.coverage(), RowCoverage::kSample);
  const GateResult ok = gate_on_cpu(c, gate, c.entry);
  EXPECT_TRUE(ok.passed) << ok.message;
  EXPECT_EQ(ok.rows_checked, limits.sampled_rows);
  EXPECT_EQ(ok.rows_total, shape[0]);
  EXPECT_EQ(ok.coverage, RowCoverage::kSample);
}

TEST(BenchGate, SampledGateCatchesAWrongImplementation) {
  const GateLimits limits{.full_check_elements = 64, .sampled_rows = 5};
  const std::int64_t shape[] = {40, 16};
  const Case c = doubling_case(shape, DType::kFloat32, 1.0, false);
  const GateData gate(c, 3, limits);
  ASSERT_EQ(gate.coverage(), RowCoverage::kSample);
  const Case wrong = doubling_case(shape, DType::kFloat32, 1.03, false);
  const GateResult r = gate_on_cpu(wrong, gate, wrong.entry);
  EXPECT_FALSE(r.passed);
  EXPECT_NEAR(r.rel_l2, 0.03, 1e-6);
  EXPECT_EQ(r.rows_checked, 5);
  // Wrong in one row only: caught when the sample holds it, as every sampled row is compared.
  const Case one_row = doubling_case(shape, DType::kFloat32, 1.0, false);
  auto corrupt_row = [&](std::int64_t row) {
    return [&, row, y = one_row.id("y")](CaseTensors t, cudaStream_t s) {
      one_row.entry(t, s);
      static_cast<float*>(t[y].data)[row * shape[1]] += 1.0f;
    };
  };
  int caught = 0;
  for (std::int64_t row = 0; row < shape[0]; ++row) caught += !gate_on_cpu(one_row, gate, corrupt_row(row)).passed;
  EXPECT_EQ(caught, 5);
}

// y = 2 x row-wise and colsum = the sum of x over rows: the rows are coupled through colsum
// (like a weight gradient). `rows_from_case` makes an implementation that ignores the rows of
// the views it is given and uses the case's instead (it would sum rows it was not given).
Case column_sum_case(std::span<const std::int64_t> shape, double scale, bool rows_from_case = false) {
  Case c = doubling_case(shape, DType::kFloat32, scale, false);
  c.op = "colsum";
  TensorSpec colsum{.name = "colsum", .dtype = DType::kFloat32, .shape = {shape[1]}, .role = Role::kOutput};
  c.tensors.push_back(colsum);
  c.rows_independent = false;
  const std::int64_t case_rows = shape[0];
  const auto [in, out, sums] = c.ids("x", "y", "colsum");
  auto apply = [=](CaseTensors t, double factor, std::int64_t rows) {
    const std::int64_t n = t[in].size(1);
    for (std::int64_t j = 0; j < n; ++j) detail::store_from_double(t[sums].dtype, t[sums].data, j, 0.0);
    for (std::int64_t i = 0; i < rows * n; ++i) {
      const double x = detail::load_as_double(t[in].dtype, t[in].data, i);
      detail::store_from_double(t[out].dtype, t[out].data, i, factor * 2.0 * x);
      const double sum = detail::load_as_double(t[sums].dtype, t[sums].data, i % n) + factor * x;
      detail::store_from_double(t[sums].dtype, t[sums].data, i % n, sum);
    }
  };
  c.entry = [=](CaseTensors t, cudaStream_t) { apply(t, scale, rows_from_case ? case_rows : t[in].size(0)); };
  c.reference = [=](CaseTensors t) { apply(t, 1.0, t[in].size(0)); };
  return c;
}

// Cases read their tensors by the names they declare; a name they do not declare is a clear
// error when the case is built, not a wrong buffer at run time.
TEST(BenchRegistry, CasesNameTheirTensors) {
  const std::int64_t shape[] = {4, 8};
  Case c = doubling_case(shape, DType::kFloat32, 1.0, false);
  EXPECT_EQ(c.id("x").index, 0u);
  EXPECT_EQ(c.id("y").index, 1u);
  c.spec("y").tolerance = 0.5;
  EXPECT_EQ(c.tensors[1].tolerance, 0.5);
  try {
    c.id("z");
    FAIL() << "no error for an undeclared tensor";
  } catch (const std::logic_error& e) {
    EXPECT_STREQ(e.what(), "bench case 'double': no tensor named 'z' (it declares x, y)");
  }
  // Every registered case declares the tensors its entry point reads.
  for (const std::string& op : Registry::global().op_names()) {
    const OpInfo* info = Registry::global().find_op(op);
    const auto configs = Registry::global().suite("smoke");
    const auto config = std::find_if(configs.begin(), configs.end(), [&](const Config& k) { return k.op == op; });
    if (config == configs.end()) continue;
    EXPECT_NO_THROW(info->make(config->shape, config->dtype)) << op;
  }
}

TEST(BenchGate, CoupledRowsOfALargeCaseAreGatedOnAPrefixProblem) {
  const GateLimits limits{.prefix_elements = 7 * 16};
  const std::int64_t shape[] = {64, 16};
  const Case c = column_sum_case(shape, 1.0);
  const GateData gate(c, 9, limits);
  ASSERT_EQ(gate.coverage(), RowCoverage::kPrefix);
  const Case& prefix = gate.gated_case();
  EXPECT_EQ(prefix.shape, (std::vector<std::int64_t>{7, 16}));
  EXPECT_EQ(prefix.tensors[0].shape, (std::vector<std::int64_t>{7, 16}));
  EXPECT_EQ(prefix.tensors[2].shape, (std::vector<std::int64_t>{16}));  // not row-wise: whole
  const GateResult ok = gate_on_cpu(c, gate, c.entry);
  EXPECT_TRUE(ok.passed) << ok.message;
  EXPECT_EQ(ok.rel_l2, 0);
  EXPECT_EQ(ok.rows_checked, 7);
  EXPECT_EQ(ok.rows_total, 64);
  EXPECT_EQ(ok.coverage, RowCoverage::kPrefix);

  const Case wrong = column_sum_case(shape, 1.03);
  const GateResult off = gate_on_cpu(wrong, gate, wrong.entry);
  EXPECT_FALSE(off.passed);
  EXPECT_NE(off.message.find("[prefix problem: the first 7 of 64 rows]"), std::string::npos) << off.message;

  const Case all_rows = column_sum_case(shape, 1.0, /*rows_from_case=*/true);
  const GateResult summed_all = gate_on_cpu(all_rows, gate, all_rows.entry);
  EXPECT_FALSE(summed_all.passed);
  EXPECT_NE(summed_all.message.find("output 'colsum'"), std::string::npos) << summed_all.message;

  // Under the cap, or rows independent: no prefix.
  EXPECT_EQ(GateData(c, 9, {.prefix_elements = 64 * 16}).coverage(), RowCoverage::kAll);
  const Case independent = doubling_case(shape, DType::kFloat32, 1.0, false);
  EXPECT_EQ(GateData(independent, 9, limits).coverage(), RowCoverage::kAll);
}

// A case whose cost grows faster than its rows (Newton-Schulz) names it: above the FLOP limit
// the prefix problem is the most rows that stay within it, rounded down to a multiple of 16 from
// 16 rows on (aligned sides, as the whole problem has).
TEST(BenchGate, CoupledRowsWithACostPerRowCountAreGatedWithinTheFlopLimit) {
  const std::int64_t shape[] = {64, 16};
  Case c = column_sum_case(shape, 1.0);
  c.flops_of_rows = [](std::int64_t rows) { return static_cast<double>(rows * rows); };
  c.flops = c.flops_of_rows(64);
  const GateData gate(c, 9, {.reference_flops = 100});
  ASSERT_EQ(gate.coverage(), RowCoverage::kPrefix);
  EXPECT_EQ(gate.gated_case().tensors[0].shape, (std::vector<std::int64_t>{10, 16}));
  const GateResult ok = gate_on_cpu(c, gate, c.entry);
  EXPECT_TRUE(ok.passed) << ok.message;
  EXPECT_EQ(ok.rows_checked, 10);
  const GateData aligned(c, 9, {.reference_flops = 1000});  // 31 rows fit: 16 are checked
  EXPECT_EQ(aligned.gated_case().tensors[0].shape, (std::vector<std::int64_t>{16, 16}));
  EXPECT_EQ(GateData(c, 9, {.reference_flops = 4096}).coverage(), RowCoverage::kAll);
}

// A batch of Newton-Schulz problems where one matrix alone exceeds the FLOP limit: the gate
// checks the prefix problem of the first matrix, and still catches a wrong implementation.
TEST(BenchGate, GroupsCostlierThanTheLimitAreGatedOnThePrefixOfTheFirstGroup) {
  const OpInfo* op = Registry::global().find_op("newton_schulz_batched");
  ASSERT_NE(op, nullptr);
  const std::vector<std::int64_t> shape = {3, 40, 24};
  const Case c = op->make(shape, DType::kFloat32);
  ASSERT_EQ(c.groups, 3);
  // 5 (3 r^2 n + r^3) with r = rows <= 24, n = 24: 184000 at 20 rows, 205065 at 21; 20 rounds
  // down to 16.
  const GateData gate(c, 13, {.reference_flops = 200000});
  ASSERT_EQ(gate.coverage(), RowCoverage::kPrefix);
  EXPECT_EQ(gate.gated_case().tensors[0].shape, (std::vector<std::int64_t>{1, 16, 24}));
  EXPECT_EQ(gate.gated_case().shape, (std::vector<std::int64_t>{1, 16, 24}));
  const GateResult right = gate_on_cpu(c, gate, c.entry);
  EXPECT_TRUE(right.passed) << right.message;
  EXPECT_EQ(right.rows_checked, 16);
  EXPECT_EQ(right.rows_total, 40);
  const GateResult wrong = gate_on_cpu(c, gate, off_by_one_percent(c, "out"));
  EXPECT_FALSE(wrong.passed);
  // One matrix (414720) within the limit, the batch above it: the run-of-groups gate as before.
  EXPECT_EQ(GateData(c, 13, {.reference_flops = 1e6}).coverage(), RowCoverage::kGroups);
}

// Attention splits into kv-head groups: above the FLOP limit the gate checks a run of them, and
// still catches an implementation that is wrong there.
TEST(BenchGate, ComputeBoundCasesAreGatedOnARunOfIndependentGroups) {
  const OpInfo* op = Registry::global().find_op("attention_forward");
  ASSERT_NE(op, nullptr);
  const std::vector<std::int64_t> shape = {2, 8, 4, 48, 16, 1};  // B Hq Hkv S D causal
  const Case c = op->make(shape, DType::kFloat32);
  EXPECT_EQ(c.groups, 4);
  GateLimits limits;
  limits.reference_flops = c.flops / 2;  // two of the four groups
  const GateData gate(c, 11, limits);
  EXPECT_EQ(gate.coverage(), RowCoverage::kGroups);
  const GateResult right = gate_on_cpu(c, gate, c.entry);
  EXPECT_TRUE(right.passed) << right.message;
  EXPECT_EQ(right.rows_checked, 2);
  EXPECT_EQ(right.rows_total, 4);
  const GateResult wrong = gate_on_cpu(c, gate, off_by_one_percent(c, "out"));
  EXPECT_FALSE(wrong.passed);
  EXPECT_NE(wrong.message.find("groups"), std::string::npos) << wrong.message;
}

TEST(BenchGate, RowWiseTensorsWithOtherRowCountsAreCheckedWhole) {
  const std::int64_t shape[] = {64, 16};
  Case c = column_sum_case(shape, 1.0);
  c.tensors[2].row_wise = true;  // dim 0 = 16, not the 64 rows: no prefix can be cut
  EXPECT_EQ(GateData(c, 9, {.prefix_elements = 16}).coverage(), RowCoverage::kAll);
}

TEST(BenchFill, ValuesAreRepresentableInRangeAndIndependentOfWhoMakesThem) {
  for (DType dtype : {DType::kFloat64, DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3,
                      DType::kFloat8E5M2, DType::kInt32, DType::kInt64}) {
    SCOPED_TRACE(dtype_name(dtype));
    const bool integral = !is_floating(dtype);
    const RandomFill fill(77, integral ? -3.0 : -2.5, integral ? 9.0 : 6.0, dtype);
    const std::int64_t shape[] = {37, 13};
    OwnedTensor t(dtype, shape, Device::cpu());
    fill_random(t.view(), fill);
    std::vector<double> seen;
    for (std::int64_t i = 0; i < t.view().numel(); ++i) {
      const double v = detail::load_as_double(dtype, t.view().data, i);
      ASSERT_EQ(v, random_value(fill, i)) << i;  // stored exactly: representable in the dtype
      ASSERT_GE(v, fill.lo);
      ASSERT_LE(v, fill.hi);
      if (integral) {
        ASSERT_EQ(v, std::floor(v));
      }
      seen.push_back(v);
    }
    std::sort(seen.begin(), seen.end());
    EXPECT_GT(std::unique(seen.begin(), seen.end()) - seen.begin(), integral ? 12 : 14);

    // Rows by index: the same values as the whole tensor's rows, in a wider dtype too.
    const std::vector<std::int64_t> rows = {0, 5, 36};
    const std::int64_t picked_shape[] = {3, 13};
    OwnedTensor picked(DType::kFloat64, picked_shape, Device::cpu());
    fill_random(picked.view(), fill, rows);
    for (std::size_t r = 0; r < rows.size(); ++r) {
      for (std::int64_t j = 0; j < 13; ++j) {
        ASSERT_EQ(detail::load_as_double(DType::kFloat64, picked.view().data, static_cast<std::int64_t>(r) * 13 + j),
                  detail::load_as_double(dtype, t.view().data, rows[r] * 13 + j));
      }
    }
  }
  // Another seed, other values.
  EXPECT_NE(random_value(RandomFill(1, -1, 1, DType::kFloat32), 0), random_value(RandomFill(2, -1, 1, DType::kFloat32), 0));
}

TEST(BenchFill, Fp8ValuesSaturateLikeTheCast) {
  const RandomFill fill(3, -1000.0, 1000.0, DType::kFloat8E4M3);
  bool saw_max = false;
  for (std::int64_t i = 0; i < 2000; ++i) {
    const double v = random_value(fill, i);
    ASSERT_LE(std::fabs(v), 448.0);
    ASSERT_EQ(v, detail::e4m3_to_double(detail::double_to_e4m3(v)));
    saw_max = saw_max || std::fabs(v) == 448.0;
  }
  EXPECT_TRUE(saw_max);
}

TEST_F(EngineFixture, PrefixGateRunsEveryImplementationOnThePrefixProblemAndTimesTheFullOne) {
  options.gate.prefix_elements = 5 * 16;
  for (const auto& [op, scale] : {std::pair<const char*, double>{"colsum", 1.0}, {"colsum_wrong", 1.03}}) {
    registry.add_op({op, "test", "M x N", [op = std::string(op), scale = scale](std::span<const std::int64_t> s, DType) {
                       Case c = column_sum_case(s, scale);
                       c.op = op;
                       return c;
                     }});
    registry.add_configs("smoke", op, {{40, 16}}, {DType::kFloat32});
  }
  // A baseline that plans for its case's rows, as cuDNN's graphs do: it must be made again for
  // the prefix problem, and the timed one must see every row.
  std::vector<std::int64_t> planned_rows, called_rows;
  registry.add_baseline("colsum", "planned", [&](const Case& c) -> std::optional<Implementation> {
    planned_rows.push_back(c.shape[0]);
    Implementation impl;
    impl.name = "planned";
    impl.on_gpu = false;
    impl.baseline = true;
    impl.run = [&, rows = c.shape[0], entry = c.entry, x = c.id("x")](CaseTensors t, cudaStream_t s) {
      if (t[x].size(0) != rows) throw std::runtime_error("views of another shape than planned");
      called_rows.push_back(rows);
      entry(t, s);
    };
    return impl;
  }, /*on_gpu=*/false);
  run_cases(registry, options, result);
  ASSERT_EQ(result.rows.size(), 3u);
  for (const Row& r : result.rows) {
    SCOPED_TRACE(r.key());
    EXPECT_EQ(r.rows_coverage, RowCoverage::kPrefix);
    EXPECT_EQ(r.rows_checked, 5);
    EXPECT_EQ(r.rows_total, 40);
  }
  EXPECT_EQ(row("colsum").status, Status::kOk) << row("colsum").message;
  EXPECT_EQ(result.rows[1].impl, "planned");
  EXPECT_EQ(result.rows[1].status, Status::kOk) << result.rows[1].message;
  EXPECT_EQ(planned_rows, (std::vector<std::int64_t>{40, 5}));
  ASSERT_GE(called_rows.size(), 3u);  // the gated call, one untimed full call, then the samples
  EXPECT_EQ(called_rows[0], 5);
  for (std::size_t i = 1; i < called_rows.size(); ++i) EXPECT_EQ(called_rows[i], 40);
  EXPECT_GT(row("colsum").ms.count, 0);
  EXPECT_EQ(row("colsum_wrong").status, Status::kFailed);
  EXPECT_EQ(row("colsum_wrong").ms.count, 0);
}

TEST_F(EngineFixture, SampledGateFailsAWrongImplementation) {
  options.gate.full_check_elements = 16;
  options.gate.sampled_rows = 3;
  add("good", 1.0);
  add("wrong", 1.03);
  run_cases(registry, options, result);
  EXPECT_EQ(row("good").status, Status::kOk) << row("good").message;
  EXPECT_EQ(row("good").rows_coverage, RowCoverage::kSample);
  EXPECT_EQ(row("good").rows_checked, 3);
  EXPECT_EQ(row("wrong").status, Status::kFailed);
  EXPECT_EQ(row("wrong").ms.count, 0);
}

// The real norm cases on the CPU with tiny caps: backward passes (dw couples the rows) take the
// prefix path, forward passes the sampled one, and the ops accept the cut views.
TEST(BenchEngine, NormCasesThroughThePrefixAndSampledGates) {
  RunOptions options;
  options.selection.suites = {"smoke"};
  options.selection.ops = {"rmsnorm_forward", "rmsnorm_backward", "fused_add_rmsnorm_forward", "fused_add_rmsnorm_backward",
                           "layernorm_forward", "layernorm_backward"};
  options.timing.warmup_ms = 0;
  options.timing.stop.min_time_ms = 0;
  options.timing.stop.timeout_ms = 5;
  options.gate = {.full_check_elements = 16 * 512, .sampled_rows = 8, .prefix_elements = 16 * 512};
  RunResult result;
  run_cases(Registry::global(), options, result);
  ASSERT_EQ(result.rows.size(), 12u);  // 6 ops x (fp32, bf16), smoke shape 64 x 512
  for (const Row& r : result.rows) {
    SCOPED_TRACE(r.key());
    EXPECT_EQ(r.status, Status::kOk) << r.message;
    EXPECT_EQ(r.rows_total, 64);
    const bool backward = r.op.ends_with("_backward");
    EXPECT_EQ(r.rows_coverage, backward ? RowCoverage::kPrefix : RowCoverage::kSample);
    EXPECT_EQ(r.rows_checked, backward ? 16 : 8);
  }
}

TEST(BenchRegistry, NormOpsAreInEveryRowSuite) {
  const Registry& r = Registry::global();
  for (const char* op : {"rmsnorm_forward", "rmsnorm_backward", "fused_add_rmsnorm_forward", "fused_add_rmsnorm_backward",
                         "layernorm_forward", "layernorm_backward"}) {
    for (const char* suite : {"smoke", "quack", "quack-m", "dsv3", "llama"}) {
      const auto& configs = r.suite(suite);
      EXPECT_TRUE(std::any_of(configs.begin(), configs.end(), [&](const Config& c) { return c.op == op; }))
          << op << " not in " << suite;
    }
  }
}

// The training suite (issue 25): M in {2048, 4096, 8192, 16384} x N in {2048, 4096, 5120, 8192},
// bf16 and fp16, every norm op with its weight in the activation dtype and, as
// <op>_fp32_weight, in fp32 (dw and db too).
TEST(BenchRegistry, TrainingSuiteHasEveryNormOpWithBothWeightDtypes) {
  const Registry& r = Registry::global();
  const auto& configs = r.suite("training");
  EXPECT_EQ(configs.size(), 16u * 6 * 2 * 2);
  for (const char* op : {"rmsnorm_forward", "rmsnorm_backward", "fused_add_rmsnorm_forward", "fused_add_rmsnorm_backward",
                         "layernorm_forward", "layernorm_backward"}) {
    for (const std::string& name : {std::string(op), std::string(op) + "_fp32_weight"}) {
      const auto count = std::count_if(configs.begin(), configs.end(), [&](const Config& c) { return c.op == name; });
      EXPECT_EQ(count, 32) << name;
      const Case c = r.find_op(name)->make(std::vector<std::int64_t>{2048, 5120}, DType::kFloat16);
      EXPECT_EQ(c.op, name);
      const DType param = name.ends_with("_fp32_weight") ? DType::kFloat32 : DType::kFloat16;
      EXPECT_EQ(c.tensors[c.id("weight").index].dtype, param) << name;
      if (name.starts_with("layernorm_backward")) {
        EXPECT_EQ(c.tensors[c.id("db").index].dtype, param) << name;
      }
      EXPECT_EQ(c.dtype, DType::kFloat16) << name;
    }
  }
}

// Each norm op has one opt-in implementation per kernel variant it has (the rows and pipelined
// variants are forward-only); none is a default baseline.
TEST(BenchRegistry, NormVariantsAreOptIn) {
  const Registry& r = Registry::global();
  const std::vector<std::string> names = r.opt_in_names();
  for (const char* name :
       {"trainscale-registers", "trainscale-two-pass", "trainscale-rows", "trainscale-pipelined"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
    const auto baselines = r.baseline_names();
    EXPECT_EQ(std::find(baselines.begin(), baselines.end(), name), baselines.end()) << name;
  }
  const std::vector<std::string> all = {"trainscale-registers", "trainscale-two-pass", "trainscale-rows",
                                        "trainscale-pipelined"};
  for (const char* op : {"rmsnorm_forward", "rmsnorm_backward", "fused_add_rmsnorm_forward", "fused_add_rmsnorm_backward",
                         "layernorm_forward", "layernorm_backward"}) {
    const Case c = r.find_op(op)->make(std::vector<std::int64_t>{64, 512}, DType::kBFloat16);
    EXPECT_TRUE(r.baselines_for(c, true).size() <= 1) << op;  // cuDNN at most
    std::vector<std::string> forced;
    for (const Implementation& impl : r.baselines_for(c, true, all)) {
      if (impl.name.starts_with("trainscale-")) forced.push_back(impl.name);
    }
    const bool forward = std::string(op).ends_with("_forward");
    EXPECT_EQ(forced.size(), forward ? 4u : 2u) << op;
  }
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
