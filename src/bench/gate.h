// The correctness gate: every implementation, before it is timed, runs on fresh random inputs
// with NaN-poisoned outputs, and each output is compared with the fp64 reference computed on
// float64 copies of the same inputs. The reference runs when the first implementation is checked
// (an implementation that cannot run the case never waits for it), on a worker thread that
// Ctrl-C abandons. Inputs are made where they live (random_fill.h: the device
// fills its tensors, the host makes only the rows the reference needs). Small cases are checked
// whole; large ones on a random sample of rows when their rows are independent, else on a prefix
// problem: the first rows only, the implementation called on views of those rows. Compute-bound
// cases that split into independent groups (attention heads) are checked on a run of groups;
// those whose rows are coupled may bring their own fp64 check of sampled rows (SampledCheck).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/registry.h"
#include "bench/result.h"
#include "bench/tensors.h"

namespace trainscale::bench {

// docs/contract.md: relative L2 fp32 1e-5, fp16 2e-3, bf16 1e-2 (fp64 1e-12); fp8 and integers
// exact.
double default_tolerance(DType dtype);
double tolerance_of(const TensorSpec& spec);

struct ValueCheck {
  bool ok = true;
  double rel_l2 = 0;   // over the finite reference positions
  double max_abs = 0;  // likewise
  std::string problem;  // why it failed, empty when ok
};

// NaN/Inf must sit exactly where the reference has them; tolerance 0 means bit-exact values.
ValueCheck check_values(const std::vector<double>& out, const std::vector<double>& ref, double tolerance);

struct GateResult {
  bool passed = false;
  std::string message;       // first failing output and why; empty when passed
  double rel_l2 = 0;         // worst over the outputs
  double max_abs = 0;        // worst over the outputs
  double tolerance = 0;      // of the output with the worst rel_l2
  std::int64_t rows_checked = 0, rows_total = 0;
  RowCoverage coverage = RowCoverage::kAll;
  std::string scope;  // kCaseSample: SamplePlan::scope
};

// When the gate checks part of a case's rows. Row-wise tensors are those with
// TensorSpec::row_wise; all of them must share dim 0 (the rows), else the case is checked whole.
struct GateLimits {
  // Rows independent: above this many elements in a row-wise tensor, check a random sample.
  std::int64_t full_check_elements = std::int64_t{1} << 22;
  std::int64_t sampled_rows = 512;
  // Rows coupled (e.g. a weight gradient sums over rows): above this many elements in a
  // row-wise tensor, check the prefix problem with as many rows as keep each row-wise tensor
  // within it (at least one row). 2^26 elements: 512 MiB per float64 copy.
  std::int64_t prefix_elements = std::int64_t{1} << 26;
  // Compute-bound cases above this many FLOPs do not run their fp64 reference whole: those with
  // independent groups (Case::groups) check as many consecutive groups as stay within it (at
  // least one), those with a Case::sampled_check spend about this many FLOPs on it, those with
  // Case::flops_of_rows check the prefix problem that stays within it. 2e10: seconds of fp64 on
  // a few cores.
  double reference_flops = 2e10;
};

// `count` (at least 2) distinct rows of [0, n), sorted: the first, the last, and one drawn from
// each of count - 2 equal strata between them, so that the sample reaches every part of the rows
// (every chunk a kernel splits them into, when there are at most count - 2). Every row when
// count >= n.
std::vector<std::int64_t> spread_rows(std::int64_t n, std::int64_t count, std::uint64_t seed);

// Thrown by GateData::check when Ctrl-C came while the reference was computed.
class GateInterrupted : public std::runtime_error {
 public:
  GateInterrupted() : std::runtime_error("interrupted while the reference was computed") {}
};

// Whether a reference abandoned by Ctrl-C is still computing (the process should then end
// without running static destructors under it).
bool abandoned_references_running();

// Inputs and the reference answer of one case, shared by all its implementations.
class GateData {
 public:
  GateData(const Case& c, std::uint64_t seed, const GateLimits& limits = {});
  // It keeps a reference to the case: a temporary would dangle.
  GateData(Case&& c, std::uint64_t seed, const GateLimits& limits = {}) = delete;

  RowCoverage coverage() const { return coverage_; }
  // kCaseSample: what the case's own check reads (nullopt otherwise).
  const std::optional<SamplePlan>& sample_plan() const { return sample_plan_; }
  // The problem the gated call solves: the case, or its prefix problem (row-wise tensors cut to
  // the first rows; config dim 0 too when it is the row count). Implementations that plan for
  // a shape (baselines) are made for it to run the gated call.
  const Case& gated_case() const { return prefix_case_ ? *prefix_case_ : case_; }
  // Fills the inputs of `tensors` (one full set of the case, any device) where they live and
  // poisons the outputs.
  void load_inputs(const std::vector<OwnedTensor>& tensors) const;
  // The views the gated call takes: `tensors`, row-wise ones cut to the prefix rows.
  std::vector<TensorView> gated_views(const std::vector<OwnedTensor>& tensors) const;
  // Compares the outputs in `tensors` (after the gated call) with the reference, computing the
  // reference first if no earlier check did. Throws GateInterrupted on Ctrl-C.
  GateResult check(const std::vector<OwnedTensor>& tensors) const;

 private:
  const Case& case_;
  void plan_group_prefix(const Case& c, const GateLimits& limits);

  std::optional<Case> prefix_case_;
  std::vector<RandomFill> fills_;  // per tensor (used for inputs)
  RowCoverage coverage_ = RowCoverage::kAll;
  std::vector<std::int64_t> sampled_rows_;  // sorted; kSample only
  std::int64_t first_group_ = 0, group_count_ = 0;  // kGroups only
  std::optional<SamplePlan> sample_plan_;  // kCaseSample only
  std::int64_t rows_total_ = 0, rows_checked_ = 0;
  struct Job;        // host work on a worker thread that Ctrl-C abandons
  struct Reference;  // computed by a Job, which owns it with this object
  const std::vector<std::vector<double>>& reference() const;
  mutable std::shared_ptr<Reference> reference_;
  mutable std::shared_ptr<Job> reference_job_;
  // kCaseSample: the case's check of the outputs in `views`, on a worker thread.
  std::vector<SampledValues> sampled_values(const std::vector<TensorView>& views) const;
  // What a failure message adds about the rows checked ("" when all were).
  std::string coverage_note() const;
};

}  // namespace trainscale::bench
