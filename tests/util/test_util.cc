#include "util/test_util.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>

#include "core/host_dtype.h"

namespace trainscale::test {

std::uint64_t test_seed() {
  static const std::uint64_t seed = [] {
    std::uint64_t s;
    if (const char* env = std::getenv("TRAINSCALE_TEST_SEED")) {
      s = std::strtoull(env, nullptr, 10);
    } else {
      std::random_device rd;
      s = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
    }
    std::cerr << "[trainscale] test seed " << s << " (set TRAINSCALE_TEST_SEED to repeat)\n";
    return s;
  }();
  return seed;
}

std::mt19937_64& rng() {
  static std::mt19937_64 engine(test_seed());
  return engine;
}

HostTensor::HostTensor(DType dtype, std::vector<std::int64_t> shape, std::int64_t row_pad)
    : shape_(std::move(shape)) {
  const int ndim = static_cast<int>(shape_.size());
  std::vector<std::int64_t> strides(ndim);
  std::int64_t s = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    strides[d] = s;
    s *= shape_[d] + (d == ndim - 1 ? row_pad : 0);
  }
  const std::int64_t elements = std::max<std::int64_t>(s, 1);
  storage_.assign((elements * dtype_size(dtype) + 7) / 8 + 1, 0);
  view_ = TensorView::from_arrays(storage_.data(), dtype, ndim, shape_.data(), strides.data(),
                                  Device::cpu());
  fill_nan();
}

HostTensor::HostTensor(const HostTensor& other)
    : storage_(other.storage_), shape_(other.shape_), view_(other.view_) {
  view_.data = storage_.data();
}

HostTensor& HostTensor::operator=(const HostTensor& other) {
  if (this != &other) {
    storage_ = other.storage_;
    shape_ = other.shape_;
    view_ = other.view_;
    view_.data = storage_.data();
  }
  return *this;
}

HostTensor HostTensor::random(DType dtype, std::vector<std::int64_t> shape, double lo, double hi,
                              std::int64_t row_pad) {
  HostTensor t(dtype, std::move(shape), row_pad);
  t.fill_random(lo, hi);
  return t;
}

HostTensor HostTensor::from_values(DType dtype, std::vector<std::int64_t> shape,
                                   const std::vector<double>& values) {
  HostTensor t(dtype, std::move(shape));
  for (std::int64_t i = 0; i < t.numel(); ++i) t.set(i, values.at(i));
  return t;
}

// Row-major storage whose only gaps are the row padding: row (logical / row length) at the row
// stride, one division per element (the tests walk tensors of up to ~10^8 elements).
std::int64_t HostTensor::offset_of(std::int64_t logical) const {
  if (view_.ndim < 2) return logical;
  const std::int64_t row_length = view_.shape[view_.ndim - 1];
  return logical / row_length * view_.strides[view_.ndim - 2] + logical % row_length;
}

double HostTensor::at(std::int64_t i) const {
  return detail::load_as_double(view_.dtype, view_.data, offset_of(i));
}

void HostTensor::set(std::int64_t i, double v) {
  detail::store_from_double(view_.dtype, view_.data, offset_of(i), v);
}

std::vector<double> HostTensor::values() const {
  std::vector<double> v(numel());
  for (std::int64_t i = 0; i < numel(); ++i) v[i] = at(i);
  return v;
}

void HostTensor::fill_random(double lo, double hi) {
  if (view_.dtype == DType::kInt32 || view_.dtype == DType::kInt64) {
    std::uniform_int_distribution<std::int64_t> dist(static_cast<std::int64_t>(lo),
                                                     static_cast<std::int64_t>(hi));
    for (std::int64_t i = 0; i < numel(); ++i) set(i, static_cast<double>(dist(rng())));
    return;
  }
  std::uniform_real_distribution<double> dist(lo, hi);
  if (view_.dtype == DType::kBFloat16) {
    // Through float: bf16's cast rounds a float by integer arithmetic, where a double with more
    // than float's bits takes the general encoder (~1.6x the time per element, draw included).
    for (std::int64_t i = 0; i < numel(); ++i) set(i, static_cast<float>(dist(rng())));
    return;
  }
  for (std::int64_t i = 0; i < numel(); ++i) set(i, dist(rng()));
}

void HostTensor::fill_nan() {
  // 0xFF bytes are NaN in every float dtype and -1 in the integer ones.
  std::memset(storage_.data(), 0xFF, storage_.size() * sizeof(std::uint64_t));
}

double rel_l2(const std::vector<double>& out, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    num += (out[i] - ref[i]) * (out[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}

double max_abs_err(const std::vector<double>& out, const std::vector<double>& ref) {
  double m = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) m = std::max(m, std::fabs(out[i] - ref[i]));
  return m;
}

double tolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return 1e-12;
    case DType::kFloat32: return 1e-5;
    case DType::kFloat16: return 2e-3;
    case DType::kBFloat16: return 1e-2;
    default: return 0.0;
  }
}

::testing::AssertionResult matches_reference(const std::vector<double>& out,
                                             const std::vector<double>& ref, double tol) {
  if (out.size() != ref.size()) {
    return ::testing::AssertionFailure()
           << "size " << out.size() << " vs reference " << ref.size();
  }
  std::vector<double> o, r;
  o.reserve(out.size());
  r.reserve(ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const bool ref_finite = std::isfinite(ref[i]);
    if (!ref_finite || !std::isfinite(out[i])) {
      const bool same = (std::isnan(ref[i]) && std::isnan(out[i])) || out[i] == ref[i];
      if (!same) {
        return ::testing::AssertionFailure()
               << "element " << i << ": got " << out[i] << ", reference " << ref[i];
      }
      continue;
    }
    o.push_back(out[i]);
    r.push_back(ref[i]);
  }
  const double err = rel_l2(o, r);
  if (!(err <= tol)) {
    return ::testing::AssertionFailure() << "relative L2 error " << err << " > " << tol
                                         << " (max abs error " << max_abs_err(o, r) << ")";
  }
  return ::testing::AssertionSuccess() << "relative L2 error " << err;
}

std::vector<double> numeric_gradient(const std::vector<double>& x,
                                     const std::function<double(const std::vector<double>&)>& f,
                                     double h) {
  std::vector<double> g(x.size());
  std::vector<double> xp = x;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double step = h * std::max(1.0, std::fabs(x[i]));
    xp[i] = x[i] + step;
    const double fp = f(xp);
    xp[i] = x[i] - step;
    const double fm = f(xp);
    xp[i] = x[i];
    g[i] = (fp - fm) / (2 * step);
  }
  return g;
}

std::vector<double> random_values(std::int64_t n, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(n);
  for (auto& x : v) x = dist(rng());
  return v;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace trainscale::test
