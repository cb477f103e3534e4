// The correctness gate: every implementation, before it is timed, runs on fresh random inputs
// with NaN-poisoned outputs, and each output is compared with the fp64 reference computed on
// float64 copies of the same inputs (the whole tensor when small, a random sample of rows when
// large and the case's rows are independent).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/registry.h"
#include "bench/tensors.h"

namespace trainscale::bench {

// DESIGN.md: relative L2 fp32 1e-5, fp16 2e-3, bf16 1e-2 (fp64 1e-12); fp8 and integers exact.
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
};

// Inputs and the reference answer of one case, shared by all its implementations.
class GateData {
 public:
  // Above this many elements in a row-wise tensor, rows are sampled (when allowed).
  static constexpr std::int64_t kFullCheckElements = std::int64_t{1} << 22;
  static constexpr std::int64_t kSampledRows = 512;

  GateData(const Case& c, std::uint64_t seed);

  // Fills `tensors` (one per TensorSpec, any device) from the host inputs and poisons outputs.
  void load_inputs(const std::vector<OwnedTensor>& tensors) const;
  bool sampled() const { return !rows_.empty(); }
  // Compares the outputs in `tensors` (after an implementation ran) with the reference.
  GateResult check(const std::vector<OwnedTensor>& tensors) const;

 private:
  const Case& case_;
  std::vector<OwnedTensor> host_;  // inputs in the case's dtypes (empty for pure outputs)
  std::vector<std::int64_t> rows_;  // sampled rows; empty: every row
  std::int64_t rows_total_ = 0;
  std::vector<std::vector<double>> reference_;  // per output tensor (empty for inputs)
};

}  // namespace trainscale::bench
