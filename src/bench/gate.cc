#include "bench/gate.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <sstream>

namespace trainscale::bench {

double default_tolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return 1e-12;
    case DType::kFloat32: return 1e-5;
    case DType::kFloat16: return 2e-3;
    case DType::kBFloat16: return 1e-2;
    default: return 0.0;  // fp8 codes and integers: exact
  }
}

double tolerance_of(const TensorSpec& spec) {
  return spec.tolerance.value_or(default_tolerance(spec.dtype));
}

namespace {

DType reference_dtype(const TensorSpec& spec) {
  if (spec.reference_dtype) return *spec.reference_dtype;
  return is_floating(spec.dtype) ? DType::kFloat64 : spec.dtype;
}

std::string format_number(double v) {
  std::ostringstream os;
  os.precision(3);
  os << v;
  return os.str();
}

// The values of a tensor on any device, as doubles: the rows `rows` of it when given.
std::vector<double> checked_values(const TensorView& t, std::span<const std::int64_t> rows) {
  std::vector<std::int64_t> shape(t.shape.begin(), t.shape.begin() + t.ndim);
  if (!rows.empty()) {
    shape[0] = static_cast<std::int64_t>(rows.size());
    OwnedTensor picked(t.dtype, shape, Device::cpu());
    gather_rows(picked.view(), t, rows);
    return to_doubles(picked.view());
  }
  if (!t.is_cuda()) return to_doubles(t);
  OwnedTensor host(t.dtype, shape, Device::cpu());
  copy_tensor(host.view(), t);
  return to_doubles(host.view());
}

std::int64_t numel_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

}  // namespace

ValueCheck check_values(const std::vector<double>& out, const std::vector<double>& ref, double tolerance) {
  ValueCheck r;
  if (out.size() != ref.size()) {
    r.ok = false;
    r.problem = "has " + std::to_string(out.size()) + " values, the reference " + std::to_string(ref.size());
    return r;
  }
  double diff2 = 0, ref2 = 0;
  std::int64_t mismatches = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double o = out[i], e = ref[i];
    if (!std::isfinite(e)) {
      const bool same = std::isnan(e) ? std::isnan(o) : o == e;
      if (!same && r.problem.empty()) {
        r.problem = "value " + format_number(o) + " at " + std::to_string(i) + " where the reference has " +
                    format_number(e);
      }
      r.ok = r.ok && same;
      continue;
    }
    if (!std::isfinite(o)) {
      if (r.problem.empty()) {
        r.problem = (std::isnan(o) ? std::string("NaN") : std::string("Inf")) + " at " + std::to_string(i) +
                    " where the reference is finite (" + format_number(e) + ")";
      }
      r.ok = false;
      continue;
    }
    diff2 += (o - e) * (o - e);
    ref2 += e * e;
    r.max_abs = std::max(r.max_abs, std::fabs(o - e));
    mismatches += o != e;
  }
  // Relative when the reference has energy, absolute otherwise (an all-zero reference).
  r.rel_l2 = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  if (!r.problem.empty()) return r;
  if (tolerance == 0.0 && mismatches > 0) {
    r.ok = false;
    r.problem = std::to_string(mismatches) + " values differ from the reference (bit-exact required)";
  } else if (r.rel_l2 > tolerance) {
    r.ok = false;
    r.problem = "relative L2 error " + format_number(r.rel_l2) + " > tolerance " + format_number(tolerance) +
                " (max abs error " + format_number(r.max_abs) + ")";
  }
  return r;
}

GateData::GateData(const Case& c, std::uint64_t seed, const GateLimits& limits) : case_(c) {
  for (std::size_t i = 0; i < c.tensors.size(); ++i) {
    const TensorSpec& spec = c.tensors[i];
    fills_.emplace_back(seed + 0x100 * (i + 1), spec.lo, spec.hi, spec.dtype);
  }

  // Rows: dim 0 of the row-wise tensors, when they agree on it.
  bool have_rows = false, same_rows = true;
  std::int64_t largest = 0, largest_row = 1;
  for (const TensorSpec& spec : c.tensors) {
    if (!spec.row_wise || spec.shape.empty()) continue;
    if (!have_rows) rows_total_ = spec.shape[0];
    have_rows = true;
    same_rows = same_rows && spec.shape[0] == rows_total_;
    largest = std::max(largest, numel_of(spec.shape));
    if (spec.shape[0] > 0) largest_row = std::max(largest_row, numel_of(spec.shape) / spec.shape[0]);
  }
  rows_checked_ = rows_total_;
  if (have_rows && same_rows) {
    if (c.rows_independent && largest > limits.full_check_elements && rows_total_ > limits.sampled_rows) {
      coverage_ = RowCoverage::kSample;
      std::mt19937_64 rng(seed ^ 0x5A17u);
      std::uniform_int_distribution<std::int64_t> pick(0, rows_total_ - 1);
      std::set<std::int64_t> chosen;
      while (static_cast<std::int64_t>(chosen.size()) < limits.sampled_rows) chosen.insert(pick(rng));
      sampled_rows_.assign(chosen.begin(), chosen.end());
      rows_checked_ = limits.sampled_rows;
    } else if (!c.rows_independent && largest > limits.prefix_elements) {
      const std::int64_t prefix = std::max<std::int64_t>(1, limits.prefix_elements / largest_row);
      if (prefix < rows_total_) {
        coverage_ = RowCoverage::kPrefix;
        rows_checked_ = prefix;
        prefix_case_ = c;
        for (TensorSpec& spec : prefix_case_->tensors) {
          if (spec.row_wise && !spec.shape.empty()) spec.shape[0] = prefix;
        }
        if (!c.shape.empty() && c.shape[0] == rows_total_) prefix_case_->shape[0] = prefix;
      }
    }
  }

  // The reference on float64 copies of the rows it checks, made on the host from their indices.
  const Case& gated = gated_case();
  std::vector<OwnedTensor> ref_tensors;
  std::vector<TensorView> ref_views;
  for (std::size_t i = 0; i < gated.tensors.size(); ++i) {
    const TensorSpec& spec = gated.tensors[i];
    const bool sample = coverage_ == RowCoverage::kSample && spec.row_wise;
    std::vector<std::int64_t> shape = spec.shape;
    if (sample) shape[0] = static_cast<std::int64_t>(sampled_rows_.size());
    ref_tensors.emplace_back(reference_dtype(spec), shape, Device::cpu());
    const TensorView& dst = ref_tensors.back().view();
    if (has_input_data(spec.role)) {
      fill_random(dst, fills_[i], sample ? std::span<const std::int64_t>(sampled_rows_) : std::span<const std::int64_t>());
    } else {
      poison(dst);
    }
    ref_views.push_back(dst);
  }
  gated.reference(ref_views);
  reference_.resize(gated.tensors.size());
  for (std::size_t i = 0; i < gated.tensors.size(); ++i) {
    if (is_checked_output(gated.tensors[i].role)) reference_[i] = to_doubles(ref_views[i]);
  }
}

void GateData::load_inputs(const std::vector<OwnedTensor>& tensors) const {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (has_input_data(case_.tensors[i].role)) {
      fill_random(tensors[i].view(), fills_[i]);
    } else {
      poison(tensors[i].view());
    }
  }
}

std::vector<TensorView> GateData::gated_views(const std::vector<OwnedTensor>& tensors) const {
  const Case& gated = gated_case();
  std::vector<TensorView> views;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    TensorView v = tensors[i].view();
    // Contiguous: the first rows of a tensor are a view of it with the same strides.
    if (!gated.tensors[i].shape.empty()) v.shape[0] = gated.tensors[i].shape[0];
    views.push_back(v);
  }
  return views;
}

GateResult GateData::check(const std::vector<OwnedTensor>& tensors) const {
  GateResult result;
  result.passed = true;
  result.rows_total = rows_total_;
  result.rows_checked = rows_checked_;
  result.coverage = coverage_;
  const std::vector<TensorView> views = gated_views(tensors);
  for (std::size_t i = 0; i < views.size(); ++i) {
    const TensorSpec& spec = case_.tensors[i];
    if (!is_checked_output(spec.role)) continue;
    const bool sampled = coverage_ == RowCoverage::kSample && spec.row_wise;
    const std::vector<double> out =
        checked_values(views[i], sampled ? std::span<const std::int64_t>(sampled_rows_) : std::span<const std::int64_t>());
    const double tol = tolerance_of(spec);
    const ValueCheck v = check_values(out, reference_[i], tol);
    if (v.rel_l2 >= result.rel_l2) {
      result.rel_l2 = v.rel_l2;
      result.tolerance = tol;
    }
    result.max_abs = std::max(result.max_abs, v.max_abs);
    if (!v.ok && result.passed) {
      result.passed = false;
      result.message = "output '" + spec.name + "': " + v.problem;
      if (coverage_ == RowCoverage::kPrefix) {
        result.message += " [prefix problem: the first " + std::to_string(rows_checked_) + " of " +
                          std::to_string(rows_total_) + " rows]";
      }
    }
  }
  return result;
}

}  // namespace trainscale::bench
