#include "bench/gate.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <random>
#include <set>
#include <sstream>

#include "bench/interrupt.h"

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

// Slices [first, first + count) of a contiguous host tensor along `dim`, as a contiguous tensor.
OwnedTensor slice_along(const TensorView& src, int dim, std::int64_t first, std::int64_t count) {
  std::vector<std::int64_t> shape(src.shape.begin(), src.shape.begin() + src.ndim);
  const std::int64_t extent = shape[dim];
  shape[dim] = count;
  OwnedTensor dst(src.dtype, shape, Device::cpu());
  std::int64_t outer = 1, inner = static_cast<std::int64_t>(dtype_size(src.dtype));
  for (int d = 0; d < dim; ++d) outer *= shape[d];
  for (int d = dim + 1; d < src.ndim; ++d) inner *= shape[d];
  const auto* from = static_cast<const std::byte*>(src.data);
  auto* to = static_cast<std::byte*>(dst.view().data);
  for (std::int64_t o = 0; o < outer; ++o) {
    std::memcpy(to + o * count * inner, from + (o * extent + first) * inner, static_cast<std::size_t>(count * inner));
  }
  return dst;
}

// A tensor's slices of groups [first, first + count) (Case::groups) when it has a group dim.
struct GroupRun {
  std::int64_t groups = 0, first = 0, count = 0;
  bool cuts(const TensorSpec& spec) const { return count > 0 && spec.group_dim >= 0; }
  std::int64_t width(const TensorSpec& spec) const { return spec.shape[spec.group_dim] / groups; }
  OwnedTensor cut(const TensorSpec& spec, const TensorView& host) const {
    return slice_along(host, spec.group_dim, first * width(spec), count * width(spec));
  }
};

// The most rows, at most `cap`, whose prefix problem stays within the FLOP budget (the cost grows
// with rows); a multiple of 16 where it can be, so a path that wants aligned sides (TMA, 16-byte
// vectors) runs on the prefix as on the whole problem.
std::int64_t prefix_rows_within(const Case& c, std::int64_t cap, double budget) {
  std::int64_t lo = 1, hi = std::max<std::int64_t>(cap, 1);
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo + 1) / 2;
    if (c.flops_of_rows(mid) <= budget) lo = mid; else hi = mid - 1;
  }
  return lo >= 16 ? lo / 16 * 16 : lo;
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
    fills_.back().special_share = spec.special_share;
    fills_.back().special = spec.special;
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
  if (c.sampled_check && c.flops > limits.reference_flops) {
    coverage_ = RowCoverage::kCaseSample;
    sample_plan_ = c.sampled_check->plan(seed ^ 0xC4E5u, limits.reference_flops, fills_);
    rows_total_ = sample_plan_->rows_total;
    rows_checked_ = sample_plan_->rows_checked;
  } else if (c.groups > 0 && c.flops_of_rows && c.flops / static_cast<double>(c.groups) > limits.reference_flops) {
    plan_group_prefix(c, limits);
  } else if (c.groups > 0 && c.flops > limits.reference_flops) {
    coverage_ = RowCoverage::kGroups;
    group_count_ = std::clamp<std::int64_t>(
        static_cast<std::int64_t>(limits.reference_flops / (c.flops / static_cast<double>(c.groups))), 1, c.groups);
    std::mt19937_64 rng(seed ^ 0x6A0Bu);
    first_group_ = std::uniform_int_distribution<std::int64_t>(0, c.groups - group_count_)(rng);
    rows_total_ = c.groups;
    rows_checked_ = group_count_;
  } else if (have_rows && same_rows) {
    if (c.rows_independent && largest > limits.full_check_elements && rows_total_ > limits.sampled_rows) {
      coverage_ = RowCoverage::kSample;
      std::mt19937_64 rng(seed ^ 0x5A17u);
      std::uniform_int_distribution<std::int64_t> pick(0, rows_total_ - 1);
      std::set<std::int64_t> chosen;
      while (static_cast<std::int64_t>(chosen.size()) < limits.sampled_rows) chosen.insert(pick(rng));
      sampled_rows_.assign(chosen.begin(), chosen.end());
      rows_checked_ = limits.sampled_rows;
    } else if (!c.rows_independent && (largest > limits.prefix_elements ||
                                       (c.flops_of_rows && c.flops > limits.reference_flops))) {
      std::int64_t prefix = std::max<std::int64_t>(1, limits.prefix_elements / largest_row);
      if (c.flops_of_rows) prefix = prefix_rows_within(c, std::min(prefix, rows_total_), limits.reference_flops);
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
}

namespace {
std::atomic<int> g_abandoned_running{0};
}  // namespace

bool abandoned_references_running() { return g_abandoned_running.load() > 0; }

// Host work on a detached worker thread. The work owns copies of everything it reads, so a job
// abandoned by Ctrl-C can finish or run on after the GateData that started it is gone.
struct GateData::Job {
  std::exception_ptr error;
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  bool abandoned = false;  // Ctrl-C: nobody waits for it any more

  static std::shared_ptr<Job> start(std::function<void()> work) {
    auto job = std::make_shared<Job>();
    std::thread([job, work = std::move(work)] {
      std::exception_ptr error;
      try {
        work();
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(job->mutex);
      job->error = error;
      job->done = true;
      if (job->abandoned) --g_abandoned_running;
      job->cv.notify_all();
    }).detach();
    return job;
  }

  // Waits for the end and rethrows the work's error as "reference failed: ..."; on Ctrl-C
  // throws GateInterrupted and leaves the job to finish on its own.
  void wait() {
    std::unique_lock<std::mutex> lock(mutex);
    while (!done) {
      cv.wait_for(lock, std::chrono::milliseconds(50));
      if (!done && interrupt_requested()) {
        abandoned = true;
        ++g_abandoned_running;
        throw GateInterrupted();
      }
    }
    if (!error) return;
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string("reference failed: ") + e.what());
    }
  }
};

// The reference of the rows the gate checks, computed by a Job on copies of what it reads.
struct GateData::Reference {
  Case gated;
  std::vector<RandomFill> fills;
  std::vector<std::int64_t> sampled_rows;
  RowCoverage coverage = RowCoverage::kAll;
  GroupRun group_run;  // kGroups only
  std::vector<std::vector<double>> values;  // per output tensor (empty for inputs)

  // The reference on float64 copies of the rows it checks, made on the host from their indices.
  void compute() {
    std::vector<OwnedTensor> ref_tensors;
    std::vector<TensorView> ref_views;
    for (std::size_t i = 0; i < gated.tensors.size(); ++i) {
      const TensorSpec& spec = gated.tensors[i];
      const bool sample = coverage == RowCoverage::kSample && spec.row_wise;
      std::vector<std::int64_t> shape = spec.shape;
      if (sample) shape[0] = static_cast<std::int64_t>(sampled_rows.size());
      if (group_run.cuts(spec)) {
        // Made whole (the fill is by element index), then cut to the groups checked.
        OwnedTensor whole(reference_dtype(spec), shape, Device::cpu());
        if (has_input_data(spec.role)) fill_random(whole.view(), fills[i]);
        ref_tensors.push_back(group_run.cut(spec, whole.view()));
        if (!has_input_data(spec.role)) poison(ref_tensors.back().view());
        ref_views.push_back(ref_tensors.back().view());
        continue;
      }
      ref_tensors.emplace_back(reference_dtype(spec), shape, Device::cpu());
      const TensorView& dst = ref_tensors.back().view();
      if (has_input_data(spec.role)) {
        fill_random(dst, fills[i], sample ? std::span<const std::int64_t>(sampled_rows) : std::span<const std::int64_t>());
      } else {
        poison(dst);
      }
      ref_views.push_back(dst);
    }
    gated.reference(ref_views);
    values.resize(gated.tensors.size());
    for (std::size_t i = 0; i < gated.tensors.size(); ++i) {
      if (is_checked_output(gated.tensors[i].role)) values[i] = to_doubles(ref_views[i]);
    }
  }
};

const std::vector<std::vector<double>>& GateData::reference() const {
  if (!reference_) {
    auto reference = std::make_shared<Reference>();
    reference->gated = gated_case();
    reference->fills = fills_;
    reference->sampled_rows = sampled_rows_;
    reference->coverage = coverage_;
    if (coverage_ == RowCoverage::kGroups) reference->group_run = {case_.groups, first_group_, group_count_};
    reference_ = reference;
    reference_job_ = Job::start([reference] { reference->compute(); });
  }
  try {
    reference_job_->wait();
  } catch (const GateInterrupted&) {
    reference_.reset();  // a later check starts it again
    reference_job_.reset();
    throw;
  }
  return reference_->values;
}

std::vector<SampledValues> GateData::sampled_values(const std::vector<TensorView>& views) const {
  std::vector<std::vector<double>> read;
  for (const OutputRead& r : sample_plan_->reads) read.push_back(checked_values(views[r.output.index], r.rows));
  auto values = std::make_shared<std::vector<SampledValues>>();
  Job::start([values, check = case_.sampled_check->check, plan = *sample_plan_, fills = fills_, read = std::move(read)] {
    *values = check(plan, fills, read);
  })->wait();
  return *values;
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
    // Contiguous: the first rows of a tensor (of its first group) are a view of it with the same
    // strides.
    const std::vector<std::int64_t>& shape = gated.tensors[i].shape;
    for (std::size_t d = 0; d < shape.size(); ++d) v.shape[d] = shape[d];
    views.push_back(v);
  }
  return views;
}

// Groups so costly that one alone exceeds the reference budget (a batch of large Newton-Schulz
// problems): the gate checks the prefix problem of the first group, its first rows along dim 1
// (tensors [groups, rows, ...] with group_dim 0), as many as Case::flops_of_rows keeps within the
// budget.
void GateData::plan_group_prefix(const Case& c, const GateLimits& limits) {
  std::int64_t rows = 0;
  for (const TensorSpec& spec : c.tensors) {
    if (spec.group_dim == 0 && spec.shape.size() >= 2) rows = std::max(rows, spec.shape[1]);
  }
  const std::int64_t kept = prefix_rows_within(c, rows, limits.reference_flops);
  coverage_ = RowCoverage::kPrefix;
  rows_total_ = rows;
  rows_checked_ = kept;
  prefix_case_ = c;
  prefix_case_->groups = 1;
  for (TensorSpec& spec : prefix_case_->tensors) {
    if (spec.group_dim != 0 || spec.shape.size() < 2) continue;
    spec.shape[0] = 1;
    spec.shape[1] = kept;
  }
  if (prefix_case_->shape.size() >= 2 && prefix_case_->shape[0] == c.groups) {
    prefix_case_->shape[0] = 1;
    prefix_case_->shape[1] = kept;
  }
}

std::string GateData::coverage_note() const {
  switch (coverage_) {
    case RowCoverage::kPrefix:
      return " [prefix problem: the first " + std::to_string(rows_checked_) + " of " + std::to_string(rows_total_) +
             " rows]";
    case RowCoverage::kGroups:
      return " [groups " + std::to_string(first_group_) + " to " + std::to_string(first_group_ + group_count_ - 1) +
             " of " + std::to_string(rows_total_) + "]";
    case RowCoverage::kCaseSample: return " [" + sample_plan_->scope + "]";
    default: return "";
  }
}

GateResult GateData::check(const std::vector<OwnedTensor>& tensors) const {
  GateResult result;
  result.passed = true;
  result.rows_total = rows_total_;
  result.rows_checked = rows_checked_;
  result.coverage = coverage_;
  if (sample_plan_) result.scope = sample_plan_->scope;
  const auto add = [&](const TensorSpec& spec, const std::vector<double>& out, const std::vector<double>& ref) {
    const double tol = tolerance_of(spec);
    const ValueCheck v = check_values(out, ref, tol);
    if (v.rel_l2 >= result.rel_l2) {
      result.rel_l2 = v.rel_l2;
      result.tolerance = tol;
    }
    result.max_abs = std::max(result.max_abs, v.max_abs);
    if (!v.ok && result.passed) {
      result.passed = false;
      result.message = "output '" + spec.name + "': " + v.problem + coverage_note();
    }
  };
  const std::vector<TensorView> views = gated_views(tensors);
  if (coverage_ == RowCoverage::kCaseSample) {
    for (const SampledValues& v : sampled_values(views)) add(case_.tensors[v.output.index], v.out, v.ref);
    return result;
  }
  for (std::size_t i = 0; i < views.size(); ++i) {
    const TensorSpec& spec = case_.tensors[i];
    if (!is_checked_output(spec.role)) continue;
    const bool sampled = coverage_ == RowCoverage::kSample && spec.row_wise;
    const GroupRun groups = coverage_ == RowCoverage::kGroups ? GroupRun{case_.groups, first_group_, group_count_}
                                                              : GroupRun{};
    std::vector<double> out;
    if (groups.cuts(spec)) {
      OwnedTensor host(spec.dtype, spec.shape, Device::cpu());
      copy_tensor(host.view(), views[i]);
      out = to_doubles(groups.cut(spec, host.view()).view());
    } else {
      out = checked_values(views[i], sampled ? std::span<const std::int64_t>(sampled_rows_) : std::span<const std::int64_t>());
    }
    add(spec, out, reference()[i]);
  }
  return result;
}

std::vector<std::int64_t> spread_rows(std::int64_t n, std::int64_t count, std::uint64_t seed) {
  std::vector<std::int64_t> rows;
  count = std::max<std::int64_t>(count, 2);
  if (count >= n) {
    for (std::int64_t r = 0; r < n; ++r) rows.push_back(r);
    return rows;
  }
  rows.push_back(0);
  // Strata of [1, n - 1): count - 2 < n - 2 of them, so none is empty.
  std::mt19937_64 rng(seed);
  const std::int64_t inner = n - 2, strata = count - 2;
  for (std::int64_t s = 0; s < strata; ++s) {
    const std::int64_t lo = 1 + s * inner / strata, hi = 1 + (s + 1) * inner / strata;
    rows.push_back(std::uniform_int_distribution<std::int64_t>(lo, hi - 1)(rng));
  }
  rows.push_back(n - 1);
  return rows;
}

}  // namespace trainscale::bench
