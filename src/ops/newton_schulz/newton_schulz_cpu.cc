// fp64 reference for Newton-Schulz and Muon: exact double math, rounded once on store.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/host_dtype.h"
#include "core/parallel.h"
#include "ops/newton_schulz/newton_schulz_internal.h"

namespace trainscale::ops::newton_schulz {

using detail::load_as_double;
using detail::store_from_double;

namespace {

// Row-major matrix of doubles.
struct Matrix {
  std::int64_t rows = 0, cols = 0;
  std::vector<double> values;

  Matrix(std::int64_t r, std::int64_t c) : rows(r), cols(c), values(r * c, 0.0) {}
  double& operator()(std::int64_t i, std::int64_t j) { return values[i * cols + j]; }
  double operator()(std::int64_t i, std::int64_t j) const { return values[i * cols + j]; }
};

// Rows per thread chunk, given the multiply-adds one row costs.
std::int64_t grain_for(std::int64_t work_per_row) {
  constexpr std::int64_t kWorkPerChunk = 1 << 16;
  return std::max<std::int64_t>(1, kWorkPerChunk / std::max<std::int64_t>(1, work_per_row));
}

// `rows` rows of t's row layout from row `first`, and the way back.
Matrix load_matrix(const TensorView& t, const detail::Rows& layout, std::int64_t first, std::int64_t rows) {
  Matrix m(rows, layout.cols);
  for (std::int64_t i = 0; i < m.rows; ++i) {
    for (std::int64_t j = 0; j < m.cols; ++j)
      m(i, j) = load_as_double(t.dtype, t.data, (first + i) * layout.row_stride + j);
  }
  return m;
}
void store_matrix(const Matrix& m, TensorView t, const detail::Rows& layout, std::int64_t first) {
  for (std::int64_t i = 0; i < m.rows; ++i) {
    for (std::int64_t j = 0; j < m.cols; ++j)
      store_from_double(t.dtype, t.data, (first + i) * layout.row_stride + j, m(i, j));
  }
}

Matrix transposed(const Matrix& m) {
  Matrix t(m.cols, m.rows);
  for (std::int64_t i = 0; i < m.rows; ++i) {
    for (std::int64_t j = 0; j < m.cols; ++j) t(j, i) = m(i, j);
  }
  return t;
}

// lhs * rhs, or lhs * rhs^T with `rhs_transposed`; rows of the result in parallel.
Matrix product(const Matrix& lhs, const Matrix& rhs, bool rhs_transposed) {
  const std::int64_t inner = lhs.cols, cols = rhs_transposed ? rhs.rows : rhs.cols;
  Matrix result(lhs.rows, cols);
  detail::parallel_for(lhs.rows, grain_for(inner * cols), [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      for (std::int64_t j = 0; j < cols; ++j) {
        double s = 0;
        for (std::int64_t p = 0; p < inner; ++p)
          s += lhs(i, p) * (rhs_transposed ? rhs(j, p) : rhs(p, j));
        result(i, j) = s;
      }
    }
  });
  return result;
}

// x <- alpha * x + beta * y, elementwise.
void scale_add(Matrix& x, double alpha, const Matrix& y, double beta) {
  for (std::size_t i = 0; i < x.values.size(); ++i)
    x.values[i] = alpha * x.values[i] + beta * y.values[i];
}

std::array<double, 3> step_coefficients(const NewtonSchulzOptions& options, int step) {
  return options.per_step.empty() ? std::array{options.a, options.b, options.c}
                                  : options.per_step[step];
}

// NS of an R x C matrix, returned as R x C; iterates on the orientation whose Gram matrix
// X X^T is the smaller one.
Matrix newton_schulz_matrix(const Matrix& g, const NewtonSchulzOptions& options) {
  const bool transpose = g.rows > g.cols;
  Matrix x = transpose ? transposed(g) : g;
  double squares = 0;
  for (double v : x.values) squares += v * v;
  const double inv_norm = 1.0 / (std::sqrt(squares) + options.eps);
  for (double& v : x.values) v *= inv_norm;
  for (int step = 0; step < options.steps; ++step) {
    const auto [a, b, c] = step_coefficients(options, step);
    const Matrix gram = product(x, x, /*rhs_transposed=*/true);        // A = X X^T
    Matrix poly = product(gram, gram, /*rhs_transposed=*/false);       // A A
    scale_add(poly, c, gram, b);                                       // B = b A + c A A
    scale_add(x, a, product(poly, x, /*rhs_transposed=*/false), 1.0);  // X = a X + B X
  }
  return transpose ? transposed(x) : x;
}

}  // namespace

void newton_schulz_cpu(const TensorView& g, TensorView out, const NewtonSchulzOptions& options) {
  const auto g_layout = detail::row_layout(g), out_layout = detail::row_layout(out);
  const std::int64_t rows = g.size(-2), count = g_layout.rows / std::max<std::int64_t>(rows, 1);
  for (std::int64_t n = 0; n < count; ++n) {  // matrix n: `rows` rows from row n * rows
    store_matrix(newton_schulz_matrix(load_matrix(g, g_layout, n * rows, rows), options), out, out_layout,
                 n * rows);
  }
}

void muon_step_cpu(TensorView param, const TensorView& grad, TensorView momentum_buffer,
                   const MuonOptions& options) {
  const auto param_layout = detail::row_layout(param),
             buffer_layout = detail::row_layout(momentum_buffer);
  const auto grad_layout = detail::row_layout(grad);
  const Matrix gradient = load_matrix(grad, grad_layout, 0, grad_layout.rows);
  const std::int64_t R = gradient.rows, C = gradient.cols;
  Matrix update(R, C);  // u
  detail::parallel_for(R, grain_for(C), [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      for (std::int64_t j = 0; j < C; ++j) {
        const std::int64_t at = i * buffer_layout.row_stride + j;
        const double buffer =
            options.momentum * load_as_double(momentum_buffer.dtype, momentum_buffer.data, at) +
            gradient(i, j);
        store_from_double(momentum_buffer.dtype, momentum_buffer.data, at, buffer);
        update(i, j) = options.nesterov ? gradient(i, j) + options.momentum * buffer : buffer;
      }
    }
  });
  const Matrix orthogonal = newton_schulz_matrix(update, options.newton_schulz);
  const double decay = 1.0 - options.lr * options.weight_decay;
  const double step = options.lr * lr_factor(options.lr_adjust, R, C);
  detail::parallel_for(R, grain_for(C), [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      for (std::int64_t j = 0; j < C; ++j) {
        const std::int64_t at = i * param_layout.row_stride + j;
        store_from_double(
            param.dtype, param.data, at,
            load_as_double(param.dtype, param.data, at) * decay - step * orthogonal(i, j));
      }
    }
  });
}

}  // namespace trainscale::ops::newton_schulz
