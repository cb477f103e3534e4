// Host-side helpers for tests: owning tensors with random data, comparisons at docs/contract.md's
// tolerances, and central finite differences.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "trainscale/error.h"
#include "trainscale/tensor.h"

namespace trainscale::test {

// Fresh per process (printed once) unless TRAINSCALE_TEST_SEED is set.
std::uint64_t test_seed();
std::mt19937_64& rng();

// Owns host memory for a tensor of `shape`; `row_pad` extra elements after every row of
// the last dimension make the rows strided.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(const HostTensor& other);
  HostTensor& operator=(const HostTensor& other);
  HostTensor(HostTensor&&) = default;
  HostTensor& operator=(HostTensor&&) = default;
  HostTensor(DType dtype, std::vector<std::int64_t> shape, std::int64_t row_pad = 0);
  static HostTensor random(DType dtype, std::vector<std::int64_t> shape, double lo = -1.0,
                           double hi = 1.0, std::int64_t row_pad = 0);
  static HostTensor from_values(DType dtype, std::vector<std::int64_t> shape,
                                const std::vector<double>& values);

  TensorView view() const { return view_; }
  DType dtype() const { return view_.dtype; }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  std::int64_t numel() const { return view_.numel(); }
  std::int64_t storage_bytes() const {
    return static_cast<std::int64_t>(storage_.size() * sizeof(std::uint64_t));
  }
  void* data() const { return view_.data; }

  // Logical (row-major over shape) element access; set() rounds to the dtype.
  double at(std::int64_t i) const;
  void set(std::int64_t i, double v);
  std::vector<double> values() const;
  void fill_random(double lo, double hi);
  void fill_nan();  // poison every byte of storage, padding included

 private:
  std::int64_t offset_of(std::int64_t logical) const;
  mutable std::vector<std::uint64_t> storage_;  // 8-byte aligned
  std::vector<std::int64_t> shape_;
  TensorView view_;
};

double rel_l2(const std::vector<double>& out, const std::vector<double>& ref);
double max_abs_err(const std::vector<double>& out, const std::vector<double>& ref);
// docs/contract.md: fp32 1e-5, fp16 2e-3, bf16 1e-2 (fp64: 1e-12).
double tolerance(DType dtype);

// Passes when NaN/Inf sit exactly where the reference has them and the relative L2 error of
// the finite rest is within `tol`.
::testing::AssertionResult matches_reference(const std::vector<double>& out,
                                             const std::vector<double>& ref, double tol);

// d f / d x_i by central differences in fp64.
std::vector<double> numeric_gradient(const std::vector<double>& x,
                                     const std::function<double(const std::vector<double>&)>& f,
                                     double h = 1e-6);

// Random weights for a scalar loss sum_i w_i * y_i, so backward tests see a dense upstream
// gradient.
std::vector<double> random_values(std::int64_t n, double lo = -1.0, double hi = 1.0);
double dot(const std::vector<double>& a, const std::vector<double>& b);

// EXPECT that `fn` throws trainscale::Error whose message contains every fragment.
#define TS_EXPECT_ERROR(stmt, ...)                                                        \
  do {                                                                                    \
    try {                                                                                 \
      stmt;                                                                               \
      ADD_FAILURE() << "expected trainscale::Error from: " #stmt;                         \
    } catch (const ::trainscale::Error& e_) {                                             \
      for (const char* frag_ : {__VA_ARGS__}) {                                           \
        EXPECT_NE(std::string(e_.what()).find(frag_), std::string::npos)                  \
            << "message '" << e_.what() << "' lacks '" << frag_ << "'";                   \
      }                                                                                   \
    }                                                                                     \
  } while (0)

}  // namespace trainscale::test
