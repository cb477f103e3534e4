// GPU-test helper for elementwise ops (activation_cuda_test, mse_cuda_test): a device tensor of
// rows x cols seen through a view with padded rows and, optionally, a base pointer one element
// past the (256-byte aligned) allocation, so that no row is 16-byte aligned. Storage outside
// the view stays NaN-poisoned, and padding_untouched() checks that no kernel wrote there.
#pragma once

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/host_dtype.h"
#include "util/gpu_util.h"

namespace trainscale::test {

struct Layout {
  std::int64_t rows, cols, pad;
  bool shift;
};

inline std::string describe(DType dt, const Layout& l) {
  return std::string(dtype_name(dt)) + " " + std::to_string(l.rows) + "x" +
         std::to_string(l.cols) + " pad " + std::to_string(l.pad) +
         (l.shift ? " shifted by one element" : "");
}

class StridedDeviceBuffer {
 public:
  // NaN everywhere, or `values` (row-major over the view) inside the view.
  StridedDeviceBuffer(DType dt, const Layout& l, const std::vector<double>* values = nullptr)
      : dt_(dt), l_(l) {
    HostTensor host(dt, {storage_elements()});
    if (values != nullptr) {
      for (std::int64_t i = 0; i < l.rows; ++i) {
        for (std::int64_t j = 0; j < l.cols; ++j) {
          detail::store_from_double(dt, host.data(), offset(i, j), values->at(i * l.cols + j));
        }
      }
    }
    device_ = std::make_unique<DeviceTensor>(host, /*copy=*/true);
  }

  TensorView view() const {
    char* base = static_cast<char*>(device_->view().data) + (l_.shift ? dtype_size(dt_) : 0);
    return TensorView(base, dt_, {l_.rows, l_.cols}, {stride(), 1}, Device::cuda(0));
  }

  // The view's elements, row-major (synchronizes the device).
  std::vector<double> values() const {
    const HostTensor host = device_->to_host();
    std::vector<double> v;
    v.reserve(static_cast<std::size_t>(l_.rows * l_.cols));
    for (std::int64_t i = 0; i < l_.rows; ++i) {
      for (std::int64_t j = 0; j < l_.cols; ++j) {
        v.push_back(detail::load_as_double(dt_, host.data(), offset(i, j)));
      }
    }
    return v;
  }

  // Every storage element outside the view still holds the NaN poison.
  ::testing::AssertionResult padding_untouched() const {
    const HostTensor host = device_->to_host();
    const std::int64_t first = l_.shift ? 1 : 0;
    for (std::int64_t e = 0; e < storage_elements(); ++e) {
      const std::int64_t rel = e - first;
      const bool inside = rel >= 0 && rel / stride() < l_.rows && rel % stride() < l_.cols;
      if (!inside && !std::isnan(detail::load_as_double(dt_, host.data(), e))) {
        return ::testing::AssertionFailure() << "storage element " << e << " outside the view "
                                             << "was written";
      }
    }
    return ::testing::AssertionSuccess();
  }

 private:
  std::int64_t stride() const { return l_.cols + l_.pad; }
  std::int64_t offset(std::int64_t i, std::int64_t j) const {
    return (l_.shift ? 1 : 0) + i * stride() + j;
  }
  std::int64_t storage_elements() const { return l_.rows * stride() + 2; }

  DType dt_;
  Layout l_;
  std::unique_ptr<DeviceTensor> device_;
};

// Uniform values in [lo, hi] rounded to dt, with specials (NaN, +-Inf, +-big, +-0, ...) at
// positions [slot * kSpecials, (slot + 1) * kSpecials) when there is room for three slots, so
// the inputs of one call never hold specials at the same element.
inline constexpr std::int64_t kSpecials = 12;
inline std::vector<double> random_inputs(DType dt, std::int64_t n, int slot, double lo = -5,
                                         double hi = 5, bool specials = true) {
  std::vector<double> v = random_values(n, lo, hi);
  if (specials && n >= 3 * kSpecials) {
    const double inf = std::numeric_limits<double>::infinity();
    const double big = dt == DType::kFloat16 ? 2e4 : 1e30;
    const double s[kSpecials] = {std::nan(""), inf, -inf, big, -big, 0.0,
                                 -0.0,         20,  -20,  88,  -88,  1e-3};
    for (std::int64_t k = 0; k < kSpecials; ++k) v[slot * kSpecials + k] = s[k];
  }
  for (double& x : v) x = detail::round_to(dt, x);
  return v;
}

// An fp64 reference output as the kernel's dtype can hold it (overflow to Inf included).
inline std::vector<double> rounded(DType dt, const HostTensor& t) {
  std::vector<double> v = t.values();
  for (double& x : v) x = detail::round_to(dt, x);
  return v;
}

inline HostTensor as_f64(const std::vector<double>& values, std::int64_t rows, std::int64_t cols) {
  return HostTensor::from_values(DType::kFloat64, {rows, cols}, values);
}

}  // namespace trainscale::test
