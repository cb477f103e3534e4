// fp64 reference for the norm family. Every row is read into doubles, computed in double and
// rounded once on store. Backward passes use the mean / rstd as saved (as the kernels do), and
// read a whole row before writing it, so dx may be dy's view.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/host_dtype.h"
#include "core/parallel.h"
#include "ops/norm/norm_internal.h"

namespace trainscale::ops::norm {

using detail::load_as_double;
using detail::store_from_double;

namespace {

// A validated (or absent) tensor seen as M rows of N elements, read and written a row at a time.
class RowAccess {
 public:
  explicit RowAccess(const TensorView& t)
      : t_(t), rows_(t.defined() ? detail::row_layout(t) : detail::Rows{}) {}

  bool defined() const { return t_.defined(); }
  std::int64_t rows() const { return rows_.rows; }
  std::int64_t cols() const { return rows_.cols; }

  void load(std::int64_t i, std::vector<double>& out) const {
    out.resize(static_cast<std::size_t>(rows_.cols));
    const std::int64_t base = i * rows_.row_stride;
    for (std::int64_t j = 0; j < rows_.cols; ++j) {
      out[j] = load_as_double(t_.dtype, t_.data, base + j);
    }
  }

  void store(std::int64_t i, const std::vector<double>& values) const {
    const std::int64_t base = i * rows_.row_stride;
    for (std::int64_t j = 0; j < rows_.cols; ++j) {
      store_from_double(t_.dtype, t_.data, base + j, values[j]);
    }
  }

 private:
  TensorView t_;
  detail::Rows rows_;
};

// Rows per task: about 16k elements, so short rows are batched and long rows still spread.
std::int64_t row_grain(std::int64_t cols) {
  return std::max<std::int64_t>(1, 16384 / std::max<std::int64_t>(cols, 1));
}

// Per-feature parameter in double (+ offset); an absent one is `absent_value` everywhere.
std::vector<double> load_param(const TensorView& p, std::int64_t cols, double absent_value,
                               double offset = 0.0) {
  std::vector<double> v(static_cast<std::size_t>(cols), absent_value + offset);
  if (p.defined()) {
    for (std::int64_t j = 0; j < cols; ++j) v[j] = load_as_double(p.dtype, p.data, j) + offset;
  }
  return v;
}

// Writes sums[first, first + cols) to the [N] gradient g when it is given.
void store_param_grad(const TensorView& g, const std::vector<double>& sums, std::int64_t first,
                      std::int64_t cols) {
  if (!g.defined()) return;
  for (std::int64_t j = 0; j < cols; ++j) store_from_double(g.dtype, g.data, j, sums[first + j]);
}

double load_stat(const TensorView& s, std::int64_t i) { return load_as_double(s.dtype, s.data, i); }

void store_stat(const TensorView& s, std::int64_t i, double v) {
  if (s.defined()) store_from_double(s.dtype, s.data, i, v);
}

// chunk_fn(begin, end, acc) over all rows in fixed chunks that add into their own `width`
// partial sums; the partials are combined in chunk order, so the totals never depend on the
// thread count. Chunk boundaries depend on M and N only; at most kMaxChunks partial vectors.
template <class ChunkFn>
std::vector<double> reduce_row_chunks(std::int64_t rows, std::int64_t cols, std::int64_t width,
                                      ChunkFn&& chunk_fn) {
  constexpr std::int64_t kMaxChunks = 256;
  const std::int64_t grain = std::max(row_grain(cols), (rows + kMaxChunks - 1) / kMaxChunks);
  const std::int64_t chunks = detail::chunk_count(rows, grain);
  std::vector<double> partial(static_cast<std::size_t>(chunks * width), 0.0);
  detail::parallel_chunks(rows, grain, [&](std::int64_t chunk, std::int64_t lo, std::int64_t hi) {
    chunk_fn(lo, hi, partial.data() + chunk * width);
  });
  std::vector<double> total(static_cast<std::size_t>(width), 0.0);
  for (std::int64_t chunk = 0; chunk < chunks; ++chunk) {
    for (std::int64_t k = 0; k < width; ++k) total[k] += partial[chunk * width + k];
  }
  return total;
}

// In place over one row: v <- v * rstd * w, with rstd = 1 / sqrt(mean(v^2) + eps) returned.
double rmsnorm_row(std::vector<double>& v, const std::vector<double>& w, double eps) {
  double sum_sq = 0;
  for (double e : v) sum_sq += e * e;
  const double rstd = 1.0 / std::sqrt(sum_sq / static_cast<double>(v.size()) + eps);
  for (std::size_t j = 0; j < v.size(); ++j) v[j] = v[j] * rstd * w[j];
  return rstd;
}

// Shared by rmsnorm_backward and fused_add_rmsnorm_backward (which adds d_residual): with
// w' = w + offset and r the saved rstd,
//   dx = r * w' * dy - r^3 / N * x * sum(dy * w' * x)  [+ d_residual],  dw = sum_rows dy * x * r.
void rmsnorm_backward_rows(const TensorView& dy, const TensorView& d_residual,
                           const TensorView& x, const TensorView& weight,
                           const TensorView& rstd, TensorView dx, TensorView dw, double offset) {
  const RowAccess grad(dy), residual_grad(d_residual), input(x), grad_in(dx);
  const std::int64_t M = input.rows(), N = input.cols();
  const std::vector<double> w = load_param(weight, N, 1.0, offset);
  const std::int64_t width = dw.defined() ? N : 0;
  auto backward_rows = [&](std::int64_t lo, std::int64_t hi, double* dw_acc) {
    std::vector<double> g, xv, extra;
    for (std::int64_t i = lo; i < hi; ++i) {
      grad.load(i, g);
      input.load(i, xv);
      const double r = load_stat(rstd, i);
      double dot = 0;
      for (std::int64_t j = 0; j < N; ++j) dot += g[j] * w[j] * xv[j];
      const double coef = r * r * r * dot / static_cast<double>(N);
      for (std::int64_t j = 0; j < width; ++j) dw_acc[j] += g[j] * xv[j] * r;
      for (std::int64_t j = 0; j < N; ++j) g[j] = r * w[j] * g[j] - coef * xv[j];
      if (residual_grad.defined()) {
        residual_grad.load(i, extra);
        for (std::int64_t j = 0; j < N; ++j) g[j] += extra[j];
      }
      grad_in.store(i, g);
    }
  };
  store_param_grad(dw, reduce_row_chunks(M, N, width, backward_rows), 0, width);
}

}  // namespace

void rmsnorm_forward_cpu(const TensorView& x, const TensorView& weight, TensorView y,
                         TensorView rstd, const RMSNormOptions& options) {
  const RowAccess input(x), output(y);
  const std::int64_t M = input.rows(), N = input.cols();
  const std::vector<double> w = load_param(weight, N, 1.0, options.weight_offset);
  detail::parallel_for(M, row_grain(N), [&](std::int64_t lo, std::int64_t hi) {
    std::vector<double> v;
    for (std::int64_t i = lo; i < hi; ++i) {
      input.load(i, v);
      store_stat(rstd, i, rmsnorm_row(v, w, options.eps));
      output.store(i, v);
    }
  });
}

void rmsnorm_backward_cpu(const TensorView& dy, const TensorView& x, const TensorView& weight,
                          const TensorView& rstd, TensorView dx, TensorView dw,
                          const RMSNormOptions& options) {
  rmsnorm_backward_rows(dy, TensorView{}, x, weight, rstd, dx, dw, options.weight_offset);
}

void fused_add_rmsnorm_forward_cpu(const TensorView& x, const TensorView& residual,
                                   const TensorView& weight, TensorView y, TensorView residual_out,
                                   TensorView rstd, const RMSNormOptions& options) {
  const RowAccess input(x), addend(residual), sum(residual_out), output(y);
  const std::int64_t M = input.rows(), N = input.cols();
  const std::vector<double> w = load_param(weight, N, 1.0, options.weight_offset);
  detail::parallel_for(M, row_grain(N), [&](std::int64_t lo, std::int64_t hi) {
    std::vector<double> v, r;
    for (std::int64_t i = lo; i < hi; ++i) {
      input.load(i, v);
      addend.load(i, r);
      // Normalize the sum as stored, so the backward pass (which gets the stored residual)
      // and an add followed by rmsnorm_forward see the same values.
      for (std::int64_t j = 0; j < N; ++j) v[j] = detail::round_to(residual.dtype, v[j] + r[j]);
      sum.store(i, v);
      store_stat(rstd, i, rmsnorm_row(v, w, options.eps));
      output.store(i, v);
    }
  });
}

void fused_add_rmsnorm_backward_cpu(const TensorView& dy, const TensorView& d_residual,
                                    const TensorView& residual, const TensorView& weight,
                                    const TensorView& rstd, TensorView dx, TensorView dw,
                                    const RMSNormOptions& options) {
  rmsnorm_backward_rows(dy, d_residual, residual, weight, rstd, dx, dw, options.weight_offset);
}

void layernorm_forward_cpu(const TensorView& x, const TensorView& weight, const TensorView& bias,
                           TensorView y, TensorView mean, TensorView rstd,
                           const LayerNormOptions& options) {
  const RowAccess input(x), output(y);
  const std::int64_t M = input.rows(), N = input.cols();
  const std::vector<double> w = load_param(weight, N, 1.0), b = load_param(bias, N, 0.0);
  detail::parallel_for(M, row_grain(N), [&](std::int64_t lo, std::int64_t hi) {
    std::vector<double> v;
    for (std::int64_t i = lo; i < hi; ++i) {
      input.load(i, v);
      double sum = 0;
      for (double e : v) sum += e;
      const double mu = sum / static_cast<double>(N);
      // Two passes: the variance from centered values, not E[x^2] - mean^2.
      double sum_sq = 0;
      for (double e : v) sum_sq += (e - mu) * (e - mu);
      const double r = 1.0 / std::sqrt(sum_sq / static_cast<double>(N) + options.eps);
      for (std::int64_t j = 0; j < N; ++j) v[j] = (v[j] - mu) * r * w[j] + b[j];
      output.store(i, v);
      store_stat(mean, i, mu);
      store_stat(rstd, i, r);
    }
  });
}

// With xhat = (x - mean) * r and g = dy * w, all from the saved mean and r:
//   dx = r * (g - mean(g) - xhat * mean(g * xhat)),  dw = sum_rows dy * xhat,  db = sum_rows dy.
void layernorm_backward_cpu(const TensorView& dy, const TensorView& x, const TensorView& weight,
                            const TensorView& mean, const TensorView& rstd, TensorView dx,
                            TensorView dw, TensorView db) {
  const RowAccess grad(dy), input(x), grad_in(dx);
  const std::int64_t M = input.rows(), N = input.cols();
  const std::vector<double> w = load_param(weight, N, 1.0);
  // Partial sums laid out as [dw (N if given) | db (N if given)].
  const std::int64_t dw_width = dw.defined() ? N : 0, db_width = db.defined() ? N : 0;
  auto backward_rows = [&](std::int64_t lo, std::int64_t hi, double* acc) {
    std::vector<double> g, xhat;
    for (std::int64_t i = lo; i < hi; ++i) {
      grad.load(i, g);
      input.load(i, xhat);
      const double mu = load_stat(mean, i), r = load_stat(rstd, i);
      double sum_gw = 0, sum_gw_xhat = 0;
      for (std::int64_t j = 0; j < N; ++j) {
        xhat[j] = (xhat[j] - mu) * r;
        sum_gw += g[j] * w[j];
        sum_gw_xhat += g[j] * w[j] * xhat[j];
      }
      for (std::int64_t j = 0; j < dw_width; ++j) acc[j] += g[j] * xhat[j];
      for (std::int64_t j = 0; j < db_width; ++j) acc[dw_width + j] += g[j];
      const double mean_gw = sum_gw / static_cast<double>(N);
      const double mean_gw_xhat = sum_gw_xhat / static_cast<double>(N);
      for (std::int64_t j = 0; j < N; ++j) {
        g[j] = r * (g[j] * w[j] - mean_gw - xhat[j] * mean_gw_xhat);
      }
      grad_in.store(i, g);
    }
  };
  const auto sums = reduce_row_chunks(M, N, dw_width + db_width, backward_rows);
  store_param_grad(dw, sums, 0, dw_width);
  store_param_grad(db, sums, dw_width, db_width);
}

}  // namespace trainscale::ops::norm
