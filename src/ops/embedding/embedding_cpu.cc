// The embedding family's fp64 reference: each output element rounded once to its dtype.
#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "core/host_dtype.h"
#include "core/parallel.h"
#include "ops/embedding/embedding_internal.h"

namespace trainscale::ops::embedding {
namespace {

// Every id, after checking that it names a row of a table of `rows` rows.
std::vector<std::int64_t> checked_ids(const char* op, const TensorView& ids, std::int64_t rows) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(ids.numel()));
  for (std::int64_t t = 0; t < ids.numel(); ++t) {
    const std::int64_t id = detail::load_index(ids.dtype, ids.data, t);
    if (id < 0 || id >= rows)
      detail::throw_arg_error(op, "ids", "ids in [0, " + std::to_string(rows) + ")",
                              std::to_string(id) + " at position " + std::to_string(t));
    out[static_cast<std::size_t>(t)] = id;
  }
  return out;
}

}  // namespace

void embedding_forward_cpu(const TensorView& weight, const TensorView& ids, TensorView out) {
  const std::vector<std::int64_t> id = checked_ids("embedding_forward", ids, weight.size(0));
  const detail::Rows w = detail::row_layout(weight), o = detail::row_layout(out);
  for (std::int64_t t = 0; t < o.rows; ++t) {
    for (std::int64_t j = 0; j < o.cols; ++j) {
      const double v = detail::load_as_double(weight.dtype, weight.data, id[t] * w.row_stride + j);
      detail::store_from_double(out.dtype, out.data, t * o.row_stride + j, v);
    }
  }
}

void embedding_backward_cpu(const TensorView& grad_output, const TensorView& ids, TensorView grad_weight,
                            std::int64_t padding_idx) {
  const std::int64_t rows = grad_weight.size(0), cols = grad_weight.size(1);
  const std::vector<std::int64_t> id = checked_ids("embedding_backward", ids, rows);
  const detail::Rows g = detail::row_layout(grad_output);
  // The positions grouped by id, increasing within each id: the order the sums run in.
  std::vector<std::int64_t> order(id.size());
  std::iota(order.begin(), order.end(), std::int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return id[a] < id[b]; });
  std::vector<std::int64_t> first(static_cast<std::size_t>(rows) + 1, 0);  // row v: order[first[v], first[v + 1])
  for (std::int64_t v : id) ++first[static_cast<std::size_t>(v) + 1];
  std::partial_sum(first.begin(), first.end(), first.begin());
  detail::parallel_chunks(rows, 256, [&](std::int64_t, std::int64_t begin, std::int64_t end) {
    std::vector<double> sum(static_cast<std::size_t>(cols));
    for (std::int64_t v = begin; v < end; ++v) {
      std::fill(sum.begin(), sum.end(), 0.0);
      if (v != padding_idx) {
        for (std::int64_t k = first[v]; k < first[v + 1]; ++k) {
          const std::int64_t base = order[k] * g.row_stride;
          for (std::int64_t j = 0; j < cols; ++j)
            sum[j] += detail::load_as_double(grad_output.dtype, grad_output.data, base + j);
        }
      }
      for (std::int64_t j = 0; j < cols; ++j)
        detail::store_from_double(grad_weight.dtype, grad_weight.data, v * cols + j, sum[j]);
    }
  });
}

}  // namespace trainscale::ops::embedding
