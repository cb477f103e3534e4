// The fused linear cross-entropy bench case and the gate's sampled checks (CPU): the case's
// tensors, FLOPs and suites, when the gate samples, which rows it picks, and that its fp64 check
// passes the CPU path and catches an implementation wrong where it looks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <set>

#include "bench/engine.h"
#include "bench/gate.h"
#include "bench/registry.h"
#include "core/host_dtype.h"
#include "trainscale/loss.h"

namespace trainscale::bench {
namespace {

constexpr const char* kOp = "fused_linear_cross_entropy_forward";

Case make_case(std::vector<std::int64_t> shape, DType dtype) {
  const OpInfo* op = Registry::global().find_op(kOp);
  EXPECT_NE(op, nullptr);
  return op->make(shape, dtype);
}

// A full host set of the case's tensors with the gate's inputs, after `entry` ran on the gated
// views (`corrupt` then edits the outputs); returns the gate's verdict.
GateResult gate_on_cpu(const Case& c, const GateData& gate, const std::function<void(CaseTensors)>& corrupt = {}) {
  std::vector<OwnedTensor> tensors;
  for (const TensorSpec& spec : c.tensors) tensors.emplace_back(spec.dtype, spec.shape, Device::cpu());
  gate.load_inputs(tensors);
  const std::vector<TensorView> views = gate.gated_views(tensors);
  c.entry(views, nullptr);
  if (corrupt) corrupt(views);
  return gate.check(tensors);
}

// Multiplies element `index` of a host view by `factor`.
void scale_element(const TensorView& t, std::int64_t index, double factor) {
  detail::store_from_double(t.dtype, t.data, index, factor * detail::load_as_double(t.dtype, t.data, index));
}

// The targets as the gate of case `c` with `seed` fills them.
RandomFill targets_fill(const Case& c, std::uint64_t seed) {
  const TensorId id = c.id("targets");
  const TensorSpec& spec = c.tensors[id.index];
  RandomFill fill(seed + 0x100 * (id.index + 1), spec.lo, spec.hi, spec.dtype);
  fill.special_share = spec.special_share;
  fill.special = spec.special;
  return fill;
}

std::int64_t target_at(const RandomFill& targets, std::int64_t t) {
  return static_cast<std::int64_t>(random_value(targets, t));
}

TEST(BenchFusedLinear, CaseDeclaresItsTensorsWorkAndWorkspace) {
  const Case c = make_case({8192, 4096, 128256}, DType::kBFloat16);
  EXPECT_EQ(c.name(), "fused_linear_cross_entropy_forward 8192x4096x128256 bfloat16");
  EXPECT_EQ(c.bound, Bound::kCompute);
  EXPECT_DOUBLE_EQ(c.flops, 6.0 * 8192 * 4096 * 128256);
  EXPECT_FALSE(c.rows_independent);
  EXPECT_TRUE(c.sampled_check.has_value());
  const std::vector<std::pair<const char*, std::vector<std::int64_t>>> shapes = {
      {"hidden", {8192, 4096}}, {"weight", {128256, 4096}},      {"targets", {8192}},
      {"loss", {}},             {"lse", {8192}},                 {"grad_hidden", {8192, 4096}},
      {"grad_weight", {128256, 4096}}};
  for (const auto& [name, shape] : shapes) EXPECT_EQ(c.tensors[c.id(name).index].shape, shape) << name;
  for (const char* name : {"hidden", "weight", "targets"}) EXPECT_EQ(c.tensors[c.id(name).index].role, Role::kInput);
  for (const char* name : {"loss", "lse", "grad_hidden", "grad_weight"}) {
    EXPECT_EQ(c.tensors[c.id(name).index].role, Role::kOutput) << name;
  }
  // Logits from 16-bit operands: loss and lse are held to the activation dtype's tolerance.
  EXPECT_EQ(c.tensors[c.id("loss").index].tolerance, default_tolerance(DType::kBFloat16));
  EXPECT_EQ(c.tensors[c.id("lse").index].tolerance, default_tolerance(DType::kBFloat16));
  const TensorSpec& targets = c.tensors[c.id("targets").index];
  EXPECT_EQ(targets.special, CrossEntropyOptions{}.ignore_index);
  EXPECT_GT(targets.special_share, 0.0);

  // The workspace is the CUDA path's, as its query gives it.
  const TensorSpec& workspace = c.tensors[c.id("workspace").index];
  EXPECT_EQ(workspace.role, Role::kScratch);
  static std::byte placeholder;
  const auto view = [](DType t, std::initializer_list<std::int64_t> shape) {
    return TensorView(&placeholder, t, shape, Device::cuda());
  };
  const std::size_t query = fused_linear_cross_entropy_workspace_bytes(
      {.hidden = view(DType::kBFloat16, {8192, 4096}), .weight = view(DType::kBFloat16, {128256, 4096}),
       .targets = view(DType::kInt64, {8192}), .loss = view(DType::kFloat32, {}), .lse = view(DType::kFloat32, {8192}),
       .grad_hidden = view(DType::kBFloat16, {8192, 4096}), .grad_weight = view(DType::kBFloat16, {128256, 4096})});
  EXPECT_EQ(c.scratch_bytes(), static_cast<std::int64_t>((query + 3) / 4 * 4));
  // Not counted as traffic: inputs read once, outputs written once.
  const double bf16 = 2, f32 = 4;
  EXPECT_DOUBLE_EQ(c.bytes, 2 * (8192.0 * 4096 + 128256.0 * 4096) * bf16 + 8192 * 8.0 + f32 + 8192 * f32);

  EXPECT_THROW(make_case({8192, 4096}, DType::kBFloat16), Unsupported);
  EXPECT_THROW(make_case({0, 4096, 128256}, DType::kBFloat16), Unsupported);
}

TEST(BenchFusedLinear, Suites) {
  const Registry& r = Registry::global();
  const auto configs_of = [&](const char* suite) {
    std::vector<Config> of_op;
    for (const Config& c : r.suite(suite)) {
      if (c.op == kOp) of_op.push_back(c);
    }
    return of_op;
  };
  const std::vector<Config> flce = configs_of("flce");
  ASSERT_EQ(flce.size(), 9u);
  std::set<std::vector<std::int64_t>> shapes;
  for (const Config& c : flce) {
    EXPECT_EQ(c.dtype, DType::kBFloat16);
    shapes.insert(c.shape);
  }
  for (std::int64_t t : {2048, 8192, 32768}) {
    for (std::int64_t v : {32000, 128256, 256000}) EXPECT_TRUE(shapes.contains({t, 4096, v})) << t << " " << v;
  }
  const std::vector<Config> llama = configs_of("llama");
  ASSERT_EQ(llama.size(), 1u);
  EXPECT_EQ(llama[0].shape, (std::vector<std::int64_t>{8192, 4096, 128256}));
  EXPECT_EQ(configs_of("smoke").size(), 2u);  // fp32 and bf16
}

TEST(BenchFusedLinear, SmallCasesRunTheWholeReferenceLargeOnesTheirOwnCheck) {
  const Case smoke = make_case({64, 32, 1000}, DType::kBFloat16);
  const GateData small(smoke, 1);
  EXPECT_EQ(small.coverage(), RowCoverage::kAll);
  const GateResult whole = gate_on_cpu(smoke, small);
  EXPECT_TRUE(whole.passed) << whole.message;
  EXPECT_EQ(whole.rows_checked, 64);

  const Case head = make_case({8192, 4096, 128256}, DType::kBFloat16);
  const GateData large(head, 1);
  EXPECT_EQ(large.coverage(), RowCoverage::kCaseSample);
}

// Which rows the plan reads: the edges, an ignored token, every sampled token's target; within
// the FLOP budget's counts; the same for a seed, another for another seed.
// Which rows the plan reads: the edges, an ignored token, every sampled token's target; within
// the FLOP budget's counts; the same for a seed, another for another seed.
TEST(BenchFusedLinear, PlanPicksEdgesAnIgnoredTokenAndTheTokensTargets) {
  const Case c = make_case({3000, 16, 5000}, DType::kFloat32);
  const std::int64_t tokens = 3000, classes = 5000;
  const GateLimits limits{.reference_flops = 2 * 4.0 * 16 * classes * 10};  // 10 tokens' worth per kind of row
  const GateData gate(c, 5, limits), again(c, 5, limits), other(c, 6, limits);
  ASSERT_EQ(gate.coverage(), RowCoverage::kCaseSample);
  const SamplePlan& plan = *gate.sample_plan();
  ASSERT_EQ(plan.reads.size(), 4u);
  EXPECT_EQ(plan.reads[0].output.index, c.id("loss").index);
  EXPECT_TRUE(plan.reads[0].rows.empty());
  EXPECT_EQ(plan.reads[1].output.index, c.id("lse").index);
  EXPECT_TRUE(plan.reads[1].rows.empty());  // every token's lse: grad_weight's rows need them
  const std::vector<std::int64_t>& sampled = plan.reads[2].rows;
  const std::vector<std::int64_t>& vocab = plan.reads[3].rows;
  EXPECT_EQ(plan.reads[2].output.index, c.id("grad_hidden").index);
  EXPECT_EQ(plan.reads[3].output.index, c.id("grad_weight").index);
  EXPECT_TRUE(std::is_sorted(sampled.begin(), sampled.end()));
  EXPECT_TRUE(std::is_sorted(vocab.begin(), vocab.end()));
  EXPECT_EQ(sampled.front(), 0);
  EXPECT_EQ(sampled.back(), tokens - 1);
  EXPECT_EQ(plan.rows_total, tokens);
  EXPECT_EQ(plan.rows_checked, static_cast<std::int64_t>(sampled.size()));
  EXPECT_GE(sampled.size(), 10u);  // 10 spread, plus an ignored one unless it is among them
  EXPECT_LE(sampled.size(), 11u);

  const RandomFill targets = targets_fill(c, 5);
  const std::int64_t ignore = CrossEntropyOptions{}.ignore_index;
  std::int64_t first_ignored = -1;
  for (std::int64_t t = 0; t < tokens && first_ignored < 0; ++t) {
    if (target_at(targets, t) == ignore) first_ignored = t;
  }
  ASSERT_GE(first_ignored, 0);
  EXPECT_TRUE(std::binary_search(sampled.begin(), sampled.end(), first_ignored));
  for (std::int64_t t : sampled) {
    const std::int64_t target = target_at(targets, t);
    if (target != ignore) {
      EXPECT_TRUE(std::binary_search(vocab.begin(), vocab.end(), target)) << t;
    }
  }
  EXPECT_TRUE(std::binary_search(vocab.begin(), vocab.end(), 0));
  EXPECT_TRUE(std::binary_search(vocab.begin(), vocab.end(), classes - 1));
  EXPECT_NE(plan.scope.find("of 3000 tokens"), std::string::npos) << plan.scope;
  EXPECT_NE(plan.scope.find("of 5000 vocabulary rows"), std::string::npos) << plan.scope;
  EXPECT_NE(plan.scope.find(std::to_string(first_ignored) + " ignored"), std::string::npos) << plan.scope;

  EXPECT_EQ(plan.reads[2].rows, again.sample_plan()->reads[2].rows);
  EXPECT_EQ(plan.reads[3].rows, again.sample_plan()->reads[3].rows);
  EXPECT_NE(plan.reads[2].rows, other.sample_plan()->reads[2].rows);
}

struct SampledGate : ::testing::TestWithParam<DType> {
  // 6 T H V = 2.3e7 FLOPs, far over the limit: the case's own check, on about ten tokens.
  const Case c = make_case({400, 24, 400}, GetParam());
  const GateData gate{c, 3, GateLimits{.reference_flops = 2e5}};
};

TEST_P(SampledGate, PassesTheCpuPathAndCatchesErrorsWhereItLooks) {
  ASSERT_EQ(gate.coverage(), RowCoverage::kCaseSample);
  const GateResult ok = gate_on_cpu(c, gate);
  EXPECT_TRUE(ok.passed) << ok.message;
  EXPECT_EQ(ok.coverage, RowCoverage::kCaseSample);
  EXPECT_EQ(ok.rows_total, 400);
  EXPECT_GE(ok.rows_checked, 8);
  EXPECT_LT(ok.rows_checked, 400);
  EXPECT_NE(ok.scope.find("fp64 on the host"), std::string::npos) << ok.scope;
  // The CPU path is fp64 rounded once on store: far inside the tolerances.
  EXPECT_LT(ok.rel_l2, GetParam() == DType::kFloat32 ? 1e-6 : 5e-3);

  const std::vector<std::int64_t>& tokens = gate.sample_plan()->reads[2].rows;
  const std::vector<std::int64_t>& vocab = gate.sample_plan()->reads[3].rows;
  const std::int64_t dim = 24;
  std::int64_t unsampled_class = 1;
  while (std::binary_search(vocab.begin(), vocab.end(), unsampled_class)) ++unsampled_class;
  const RandomFill targets = targets_fill(c, 3);
  const auto valid = std::find_if(tokens.begin(), tokens.end(), [&](std::int64_t t) {
    return target_at(targets, t) != CrossEntropyOptions{}.ignore_index;
  });
  const auto ignored = std::find_if(tokens.begin(), tokens.end(), [&](std::int64_t t) {
    return target_at(targets, t) == CrossEntropyOptions{}.ignore_index;
  });
  ASSERT_NE(valid, tokens.end());
  ASSERT_NE(ignored, tokens.end());
  const std::int64_t valid_token = *valid;  // sampled, not ignored
  const auto [loss, lse, grad_hidden, grad_weight] = c.ids("loss", "lse", "grad_hidden", "grad_weight");
  const auto fails_on = [&](const char* output, const std::function<void(CaseTensors)>& corrupt) {
    const GateResult r = gate_on_cpu(c, gate, corrupt);
    EXPECT_FALSE(r.passed) << output;
    EXPECT_NE(r.message.find(std::string("output '") + output + "'"), std::string::npos) << r.message;
    EXPECT_NE(r.message.find("[fp64 on the host"), std::string::npos) << r.message;
  };
  fails_on("loss", [&](CaseTensors t) { scale_element(t[loss], 0, 1.05); });
  // An ignored token's lse: neither the loss nor the gradients read it, only the lse check.
  fails_on("lse", [&](CaseTensors t) { scale_element(t[lse], *ignored, 1.1); });
  fails_on("grad_hidden", [&](CaseTensors t) {
    for (std::int64_t k = 0; k < dim; ++k) scale_element(t[grad_hidden], valid_token * dim + k, 1.2);
  });
  fails_on("grad_weight", [&](CaseTensors t) {
    for (std::int64_t k = 0; k < dim; ++k) scale_element(t[grad_weight], vocab[vocab.size() / 2] * dim + k, 1.2);
  });
  // What it does not see: a vocabulary row it did not sample.
  const GateResult unseen = gate_on_cpu(c, gate, [&](CaseTensors t) {
    for (std::int64_t k = 0; k < dim; ++k) scale_element(t[grad_weight], unsampled_class * dim + k, 1.2);
  });
  EXPECT_TRUE(unseen.passed) << unseen.message;
}

INSTANTIATE_TEST_SUITE_P(Dtypes, SampledGate, ::testing::Values(DType::kFloat32, DType::kBFloat16),
                         [](const ::testing::TestParamInfo<DType>& p) { return std::string(dtype_name(p.param)); });

// The engine end to end on the CPU: the gate's scope and the case's workspace reach the row.
TEST(BenchFusedLinear, EngineRowsCarryTheScopeAndTheWorkspace) {
  Registry registry;
  registry.add_op(*Registry::global().find_op(kOp));
  registry.add_configs("smoke", kOp, {{300, 16, 500}}, {DType::kFloat32});
  RunOptions options;
  options.timing.warmup_ms = 0;
  options.timing.stop.min_time_ms = 0;
  options.timing.stop.timeout_ms = 5;
  options.gate.reference_flops = 1e5;
  RunResult result;
  run_cases(registry, options, result);
  ASSERT_EQ(result.rows.size(), 1u);
  const Row& row = result.rows[0];
  EXPECT_EQ(row.status, Status::kOk) << row.message;
  EXPECT_EQ(row.rows_coverage, RowCoverage::kCaseSample);
  EXPECT_NE(row.gate_scope.find("of 300 tokens"), std::string::npos) << row.gate_scope;
  const Case c = make_case({300, 16, 500}, DType::kFloat32);
  EXPECT_GT(c.scratch_bytes(), 0);
  EXPECT_EQ(row.extra_memory_bytes, c.scratch_bytes());  // the CPU path keeps nothing else
}

TEST(BenchGate, SpreadRowsReachEveryStratum) {
  EXPECT_EQ(spread_rows(5, 8, 1), (std::vector<std::int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(spread_rows(5, 1, 1), (std::vector<std::int64_t>{0, 4}));  // at least the edges
  EXPECT_TRUE(spread_rows(0, 4, 1).empty());
  const std::int64_t n = 1000, count = 10;
  const std::vector<std::int64_t> rows = spread_rows(n, count, 7);
  ASSERT_EQ(rows.size(), 10u);
  EXPECT_EQ(rows.front(), 0);
  EXPECT_EQ(rows.back(), n - 1);
  for (std::int64_t s = 0; s < count - 2; ++s) {  // one in each eighth of [1, 999)
    const std::int64_t lo = 1 + s * (n - 2) / (count - 2), hi = 1 + (s + 1) * (n - 2) / (count - 2);
    EXPECT_TRUE(rows[s + 1] >= lo && rows[s + 1] < hi) << s;
  }
  EXPECT_EQ(spread_rows(n, count, 7), rows);
  EXPECT_NE(spread_rows(n, count, 8), rows);
}

TEST(BenchFill, SpecialIntegersTakeTheirShareAndLeaveTheRestInRange) {
  RandomFill fill(9, 0, 99, DType::kInt64);
  fill.special_share = 0.25;
  fill.special = -100;
  std::int64_t special = 0;
  const std::int64_t n = 20000;
  for (std::int64_t i = 0; i < n; ++i) {
    const double v = random_value(fill, i);
    if (v == -100) {
      ++special;
    } else {
      EXPECT_TRUE(v >= 0 && v <= 99) << v;
    }
  }
  EXPECT_NEAR(static_cast<double>(special) / n, 0.25, 0.02);
  // Without a share nothing changes.
  const RandomFill plain(9, 0, 99, DType::kInt64);
  RandomFill zero_share = plain;
  zero_share.special = -100;
  for (std::int64_t i = 0; i < 1000; ++i) EXPECT_EQ(random_value(plain, i), random_value(zero_share, i));
}

}  // namespace
}  // namespace trainscale::bench
