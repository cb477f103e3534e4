// fp64 reference for the softmax family.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/host_dtype.h"
#include "core/parallel.h"
#include "ops/softmax/softmax_internal.h"

namespace trainscale::ops::softmax {

using detail::load_as_double;
using detail::store_from_double;

namespace {

constexpr std::int64_t kRowGrain = 16;

// Reads row i into `buf` whole first, so the output may be written over the input.
void load_row(const TensorView& t, const detail::Rows& r, std::int64_t i, std::vector<double>& buf) {
  for (std::int64_t j = 0; j < r.cols; ++j) buf[j] = load_as_double(t.dtype, t.data, i * r.row_stride + j);
}

void store_row(TensorView t, const detail::Rows& r, std::int64_t i, const std::vector<double>& buf) {
  for (std::int64_t j = 0; j < r.cols; ++j) store_from_double(t.dtype, t.data, i * r.row_stride + j, buf[j]);
}

}  // namespace

void softmax_forward_cpu(const TensorView& x, TensorView y) {
  detail::OpChecker c("softmax_forward");
  const auto rx = c.rows(x, "x"), ry = c.rows(y, "y");
  detail::parallel_for(rx.rows, kRowGrain, [&](std::int64_t lo, std::int64_t hi) {
    std::vector<double> row(rx.cols);
    for (std::int64_t i = lo; i < hi; ++i) {
      load_row(x, rx, i, row);
      // The max skips NaN, but exp(NaN) poisons the sum and so the whole row, as in torch.
      double max = -std::numeric_limits<double>::infinity();
      for (double v : row) max = std::max(max, v);
      double sum = 0;
      for (double& v : row) sum += (v = std::exp(v - max));
      for (double& v : row) v /= sum;
      store_row(y, ry, i, row);
    }
  });
}

void softmax_backward_cpu(const TensorView& dy, const TensorView& y, TensorView dx) {
  detail::OpChecker c("softmax_backward");
  const auto rdy = c.rows(dy, "dy"), ry = c.rows(y, "y"), rdx = c.rows(dx, "dx");
  detail::parallel_for(rdy.rows, kRowGrain, [&](std::int64_t lo, std::int64_t hi) {
    std::vector<double> grad(rdy.cols), prob(rdy.cols);
    for (std::int64_t i = lo; i < hi; ++i) {
      load_row(dy, rdy, i, grad);
      load_row(y, ry, i, prob);
      double dot = 0;
      for (std::int64_t j = 0; j < rdy.cols; ++j) dot += grad[j] * prob[j];
      for (std::int64_t j = 0; j < rdy.cols; ++j) grad[j] = prob[j] * (grad[j] - dot);
      store_row(dx, rdx, i, grad);
    }
  });
}

}  // namespace trainscale::ops::softmax
