// fp64 reference for the loss family.
#include <cmath>
#include <vector>

#include "core/host_dtype.h"
#include "core/parallel.h"
#include "ops/loss/loss_internal.h"

namespace trainscale::ops::loss {

using detail::load_as_double;
using detail::store_from_double;

namespace {
// Row offset (in elements) of row i for a view validated with OpChecker::rows().
std::int64_t row_offset(const detail::Rows& r, std::int64_t i) { return i * r.row_stride; }
}  // namespace

void mse_forward_cpu(const TensorView& a, const TensorView& b, TensorView out,
                     Reduction reduction) {
  detail::OpChecker c("mse_forward");
  const auto ra = c.rows(a, "a"), rb = c.rows(b, "b");
  const std::int64_t M = ra.rows, N = ra.cols;
  if (reduction == Reduction::kNone) {
    const auto ro = c.rows(out, "out");
    detail::parallel_for(M, 64, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t i = lo; i < hi; ++i) {
        for (std::int64_t j = 0; j < N; ++j) {
          const double d = load_as_double(a.dtype, a.data, row_offset(ra, i) + j) -
                           load_as_double(b.dtype, b.data, row_offset(rb, i) + j);
          store_from_double(out.dtype, out.data, row_offset(ro, i) + j, d * d);
        }
      }
    });
    return;
  }
  // Fixed row chunks summed in order: the same result whatever the thread count.
  constexpr std::int64_t kGrain = 64;
  std::vector<double> partial(detail::chunk_count(M, kGrain), 0.0);
  detail::parallel_chunks(M, kGrain, [&](std::int64_t chunk, std::int64_t lo, std::int64_t hi) {
    double s = 0;
    for (std::int64_t i = lo; i < hi; ++i) {
      for (std::int64_t j = 0; j < N; ++j) {
        const double d = load_as_double(a.dtype, a.data, row_offset(ra, i) + j) -
                         load_as_double(b.dtype, b.data, row_offset(rb, i) + j);
        s += d * d;
      }
    }
    partial[chunk] = s;
  });
  double total = 0;
  for (double p : partial) total += p;
  if (reduction == Reduction::kMean) total /= static_cast<double>(M * N);
  store_from_double(out.dtype, out.data, 0, total);
}

void mse_backward_cpu(const TensorView& grad_out, const TensorView& a, const TensorView& b,
                      TensorView grad_a, TensorView grad_b, Reduction reduction) {
  detail::OpChecker c("mse_backward");
  const auto ra = c.rows(a, "a"), rb = c.rows(b, "b");
  const std::int64_t M = ra.rows, N = ra.cols;
  const detail::Rows rg = reduction == Reduction::kNone ? c.rows(grad_out, "grad_out") : detail::Rows{};
  const detail::Rows rga = grad_a.defined() ? c.rows(grad_a, "grad_a") : detail::Rows{};
  const detail::Rows rgb = grad_b.defined() ? c.rows(grad_b, "grad_b") : detail::Rows{};
  double scale = 2.0;
  if (reduction != Reduction::kNone) {
    scale *= load_as_double(grad_out.dtype, grad_out.data, 0);
    if (reduction == Reduction::kMean) scale /= static_cast<double>(M * N);
  }
  detail::parallel_for(M, 64, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      for (std::int64_t j = 0; j < N; ++j) {
        double g = scale * (load_as_double(a.dtype, a.data, row_offset(ra, i) + j) -
                            load_as_double(b.dtype, b.data, row_offset(rb, i) + j));
        if (reduction == Reduction::kNone) {
          g *= load_as_double(grad_out.dtype, grad_out.data, row_offset(rg, i) + j);
        }
        if (grad_a.defined()) store_from_double(grad_a.dtype, grad_a.data, row_offset(rga, i) + j, g);
        if (grad_b.defined()) store_from_double(grad_b.dtype, grad_b.data, row_offset(rgb, i) + j, -g);
      }
    }
  });
}

}  // namespace trainscale::ops::loss
