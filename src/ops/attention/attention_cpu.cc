// fp64 reference for the attention family. Queries and keys are taken in blocks, so the work is
// small dense fp64 matrix products whose inner loops run over contiguous rows and vectorize;
// every sum still adds its terms in increasing index order. The forward runs an online softmax
// over key blocks; the backward recomputes probabilities from the saved lse, once for dq (per
// query block) and once for dk/dv (per key block), so that no two threads write one output.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/host_dtype.h"
#include "core/parallel.h"
#include "ops/attention/attention_internal.h"
#include "ops/attention/attention_mask.h"

namespace trainscale::ops::attention {

using detail::load_as_double;
using detail::store_from_double;

namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();
constexpr std::int64_t kBlock = 64;  // queries or keys per block

// Half-open index range.
struct Range {
  std::int64_t begin, end;
  std::int64_t size() const { return end - begin; }
};

// Sizes shared by forward and backward; q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D].
struct Geometry {
  std::int64_t batch, q_len, kv_len, q_heads, kv_heads, head_dim;
  std::int64_t group;  // query heads per kv head
  double scale;
  double softcap;  // 0: off
  AttentionMask<std::int64_t> mask;
  std::int64_t lse_batch_stride, lse_head_stride;  // of lse [B, Hq, Sq] (unit stride in Sq)

  Geometry(const TensorView& q, const TensorView& k, const TensorView& lse,
           const AttentionOptions& options)
      : batch(q.size(0)),
        q_len(q.size(1)),
        kv_len(k.size(1)),
        q_heads(q.size(2)),
        kv_heads(k.size(2)),
        head_dim(q.size(3)),
        group(q_heads / kv_heads),
        scale(resolved_scale(options, head_dim)),
        softcap(options.softcap),
        mask(make_attention_mask<std::int64_t>(q_len, kv_len, options.causal, options.window_left,
                                               options.window_right)),
        lse_batch_stride(lse.defined() ? lse.strides[0] : q_heads * q_len),
        lse_head_stride(lse.defined() ? lse.strides[1] : q_len) {}

  // Keys query i sees, and queries key j is seen by (attention_mask.h).
  Range keys_of(std::int64_t i) const { return {mask.key_begin(i), mask.key_end(i)}; }
  Range queries_of(std::int64_t j) const { return {mask.query_begin(j), mask.query_end(j)}; }
  std::int64_t lse_index(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return b * lse_batch_stride + h * lse_head_stride + i;
  }
  // The score of an unscaled dot product q.k, and d(score)/d(q.k).
  double score(double dot) const {
    const double s = scale * dot;
    return softcap > 0 ? softcap * std::tanh(s / softcap) : s;
  }
  double score_slope(double dot) const {
    if (!(softcap > 0)) return scale;
    const double t = std::tanh(scale * dot / softcap);
    return scale * (1 - t * t);
  }
};

std::int64_t block_count(std::int64_t n) { return (n + kBlock - 1) / kBlock; }

// The part of `r` inside `block`, relative to block.begin (empty: begin == end).
Range relative_part(Range r, Range block) {
  const std::int64_t begin = std::clamp<std::int64_t>(r.begin - block.begin, 0, block.size());
  return {begin, std::clamp<std::int64_t>(r.end - block.begin, begin, block.size())};
}

// The keys a block of queries sees (each row's range moves right with the row), and the
// queries a block of keys is seen by.
Range keys_of_block(const Geometry& g, Range rows) {
  return {g.keys_of(rows.begin).begin, std::max(g.keys_of(rows.begin).begin, g.keys_of(rows.end - 1).end)};
}
Range queries_of_block(const Geometry& g, Range cols) {
  return {g.queries_of(cols.begin).begin,
          std::max(g.queries_of(cols.begin).begin, g.queries_of(cols.end - 1).end)};
}

// The block'th block of [first, last).
Range block_range(std::int64_t first, std::int64_t last, std::int64_t block) {
  const std::int64_t begin = first + block * kBlock;
  return {begin, std::min(last, begin + kBlock)};
}

// Row-major fp64 scratch.
struct Matrix {
  std::int64_t rows = 0, cols = 0;
  std::vector<double> values;

  void resize(std::int64_t r, std::int64_t c) {
    rows = r;
    cols = c;
    values.resize(r * c);
  }
  void zero(std::int64_t r, std::int64_t c) {
    resize(r, c);
    std::fill(values.begin(), values.end(), 0.0);
  }
  double* row(std::int64_t i) { return values.data() + i * cols; }
  const double* row(std::int64_t i) const { return values.data() + i * cols; }
};

// Element offset of vector (b, s, h) in a [B, S, H, D] view; D has stride 1.
std::int64_t vector_offset(const TensorView& t, std::int64_t b, std::int64_t s, std::int64_t h) {
  return b * t.strides[0] + s * t.strides[1] + h * t.strides[2];
}

// The D-vector at `offset` in fp64; fp64 views (what the benchmark gate passes) are plain copies.
void load_vector(const TensorView& t, std::int64_t offset, double* dst) {
  const std::int64_t D = t.size(3);
  if (t.dtype == DType::kFloat64) {
    std::copy_n(static_cast<const double*>(t.data) + offset, D, dst);
    return;
  }
  for (std::int64_t d = 0; d < D; ++d) dst[d] = load_as_double(t.dtype, t.data, offset + d);
}

// Vectors s in `seq` of (b, h) as the rows of `dst` [seq.size(), D].
void load_rows(const TensorView& t, std::int64_t b, std::int64_t h, Range seq, Matrix& dst) {
  dst.resize(seq.size(), t.size(3));
  for (std::int64_t r = 0; r < seq.size(); ++r)
    load_vector(t, vector_offset(t, b, seq.begin + r, h), dst.row(r));
}

void transpose(const Matrix& src, Matrix& dst) {
  dst.resize(src.cols, src.rows);
  for (std::int64_t r = 0; r < src.rows; ++r) {
    for (std::int64_t c = 0; c < src.cols; ++c) dst.row(c)[r] = src.row(r)[c];
  }
}

void store_rows(const TensorView& t, std::int64_t b, std::int64_t h, Range seq, const Matrix& src) {
  for (std::int64_t r = 0; r < seq.size(); ++r) {
    const std::int64_t offset = vector_offset(t, b, seq.begin + r, h);
    const double* row = src.row(r);
    for (std::int64_t d = 0; d < src.cols; ++d)
      store_from_double(t.dtype, t.data, offset + d, row[d]);
  }
}

double dot(const double* a, const double* b, std::int64_t n) {
  double s = 0;
  for (std::int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

// c[i][cols] += a[i][k] * b[k][cols] for k in `terms`, in increasing k.
void update_row(const Matrix& a, const Matrix& b, Matrix& c, std::int64_t i, Range terms,
                Range cols) {
  double* out = c.row(i);
  for (std::int64_t k = terms.begin; k < terms.end; ++k) {
    const double x = a.row(i)[k];
    const double* in = b.row(k);
    for (std::int64_t j = cols.begin; j < cols.end; ++j) out[j] += x * in[j];
  }
}

// Two doubles, one SSE2 register (the x86-64 baseline), as a GCC/Clang vector type. Written
// with scalars, GCC vectorizes the tile along k and spends its time shuffling.
using Lanes = double __attribute__((vector_size(2 * sizeof(double))));
constexpr std::int64_t kLanes = 2;
constexpr std::int64_t kTileRows = 4, kTileCols = 2 * kLanes;

// update_row for rows [i, i + kTileRows) and columns [col, col + kTileCols), the tile held in
// registers across the whole sum.
void update_tile(const Matrix& a, const Matrix& b, Matrix& c, std::int64_t i, Range terms,
                 std::int64_t col) {
  constexpr std::int64_t kVectors = kTileCols / kLanes;
  Lanes acc[kTileRows][kVectors];
  for (std::int64_t r = 0; r < kTileRows; ++r) {
    std::memcpy(acc[r], c.row(i + r) + col, sizeof acc[r]);
  }
  const double* a_rows[kTileRows];
  for (std::int64_t r = 0; r < kTileRows; ++r) a_rows[r] = a.row(i + r);
  for (std::int64_t k = terms.begin; k < terms.end; ++k) {
    Lanes in[kVectors];
    std::memcpy(in, b.row(k) + col, sizeof in);
    for (std::int64_t r = 0; r < kTileRows; ++r) {
      const double x = a_rows[r][k];
      for (std::int64_t v = 0; v < kVectors; ++v) acc[r][v] += x * in[v];
    }
  }
  for (std::int64_t r = 0; r < kTileRows; ++r) {
    std::memcpy(c.row(i + r) + col, acc[r], sizeof acc[r]);
  }
}

// c += a b where row i of the product sums only k in terms(i) (the keys or queries the mask
// lets it see), in increasing k. Rows are taken kTileRows at a time; the k range all of them
// share goes through register tiles, the rest row by row.
template <class Terms>
void multiply_accumulate(const Matrix& a, const Matrix& b, Matrix& c, Terms terms) {
  const Range all_cols{0, c.cols};
  std::int64_t i = 0;
  for (; i + kTileRows <= c.rows; i += kTileRows) {
    Range shared = terms(i);
    for (std::int64_t r = 1; r < kTileRows; ++r) {
      shared.begin = std::max(shared.begin, terms(i + r).begin);
      shared.end = std::min(shared.end, terms(i + r).end);
    }
    if (shared.size() <= 0) {
      for (std::int64_t r = 0; r < kTileRows; ++r)
        update_row(a, b, c, i + r, terms(i + r), all_cols);
      continue;
    }
    for (std::int64_t r = 0; r < kTileRows; ++r) {
      update_row(a, b, c, i + r, {terms(i + r).begin, shared.begin}, all_cols);
    }
    std::int64_t col = 0;
    for (; col + kTileCols <= c.cols; col += kTileCols) update_tile(a, b, c, i, shared, col);
    for (std::int64_t r = 0; r < kTileRows; ++r) {
      update_row(a, b, c, i + r, shared, {col, c.cols});
      update_row(a, b, c, i + r, {shared.end, terms(i + r).end}, all_cols);
    }
  }
  for (; i < c.rows; ++i) update_row(a, b, c, i, terms(i), all_cols);
}

// c = a b over all of a's columns.
void multiply(const Matrix& a, const Matrix& b, Matrix& c) {
  c.zero(a.rows, b.cols);
  multiply_accumulate(a, b, c, [&](std::int64_t) { return Range{0, a.cols}; });
}

// Items per thread chunk so each chunk does a worthwhile amount of work.
std::int64_t grain_for(std::int64_t work_per_item) {
  constexpr std::int64_t kWorkPerChunk = 1 << 16;
  return std::max<std::int64_t>(1, kWorkPerChunk / std::max<std::int64_t>(1, work_per_item));
}

}  // namespace

void attention_forward_cpu(const TensorView& q, const TensorView& k, const TensorView& v,
                           TensorView out, TensorView lse, const AttentionOptions& options) {
  const Geometry g(q, k, lse, options);
  const std::int64_t q_blocks = block_count(g.q_len);
  const std::int64_t items = g.batch * g.q_heads * q_blocks;  // (b, h, query block)
  const std::int64_t work_per_item = std::min(kBlock, g.q_len) * g.kv_len * g.head_dim;
  detail::parallel_for(items, grain_for(work_per_item), [&](std::int64_t lo, std::int64_t hi) {
    Matrix queries, keys, keys_t, values, probs, acc;
    std::vector<double> row_max, row_sum;
    for (std::int64_t item = lo; item < hi; ++item) {
      const std::int64_t b = item / q_blocks / g.q_heads, h = item / q_blocks % g.q_heads;
      const Range rows = block_range(0, g.q_len, item % q_blocks);
      const std::int64_t kv_head = h / g.group, n = rows.size();
      load_rows(q, b, h, rows, queries);
      acc.zero(n, g.head_dim);
      row_max.assign(n, -kInfinity);
      row_sum.assign(n, 0.0);
      const Range keys_seen = keys_of_block(g, rows);
      for (std::int64_t kb = 0; kb < block_count(keys_seen.size()); ++kb) {
        const Range cols = block_range(keys_seen.begin, keys_seen.end, kb);
        auto seen = [&](std::int64_t r) { return relative_part(g.keys_of(rows.begin + r), cols); };
        load_rows(k, b, kv_head, cols, keys);
        transpose(keys, keys_t);
        load_rows(v, b, kv_head, cols, values);
        multiply(queries, keys_t, probs);
        // Online softmax: when a row's max grows, its sum and accumulator are rescaled. A NaN
        // score is skipped by max but reaches the sum and every output through exp.
        for (std::int64_t r = 0; r < n; ++r) {
          double* p = probs.row(r);
          const Range terms = seen(r);
          double new_max = row_max[r];
          for (std::int64_t j = terms.begin; j < terms.end; ++j) {
            p[j] = g.score(p[j]);
            new_max = std::max(new_max, p[j]);
          }
          if (new_max != row_max[r]) {
            const double rescale = std::exp(row_max[r] - new_max);
            row_sum[r] *= rescale;
            for (std::int64_t d = 0; d < g.head_dim; ++d) acc.row(r)[d] *= rescale;
            row_max[r] = new_max;
          }
          for (std::int64_t j = terms.begin; j < terms.end; ++j) {
            p[j] = std::exp(p[j] - new_max);
            row_sum[r] += p[j];
          }
        }
        multiply_accumulate(probs, values, acc, seen);
      }
      for (std::int64_t r = 0; r < n; ++r) {
        double row_lse = -kInfinity;  // a query that sees no key: zero output
        if (g.keys_of(rows.begin + r).size() > 0) {
          for (std::int64_t d = 0; d < g.head_dim; ++d) acc.row(r)[d] /= row_sum[r];
          row_lse = row_max[r] + std::log(row_sum[r]);
        }
        if (lse.defined())
          store_from_double(lse.dtype, lse.data, g.lse_index(b, h, rows.begin + r), row_lse);
      }
      store_rows(out, b, h, rows, acc);
    }
  });
}

namespace {

// Per-query terms of the backward: lse and dot(dout, out), the softmax's Jacobian term.
void load_row_statistics(const Geometry& g, const TensorView& out, const TensorView& lse,
                         std::int64_t b, std::int64_t h, Range rows, const Matrix& dout_rows,
                         Matrix& out_rows, std::vector<double>& row_lse,
                         std::vector<double>& dout_dot_out) {
  load_rows(out, b, h, rows, out_rows);
  row_lse.resize(rows.size());
  dout_dot_out.resize(rows.size());
  for (std::int64_t r = 0; r < rows.size(); ++r) {
    row_lse[r] = load_as_double(lse.dtype, lse.data, g.lse_index(b, h, rows.begin + r));
    dout_dot_out[r] = dot(dout_rows.row(r), out_rows.row(r), g.head_dim);
  }
}

// p = exp(score(q.k) - lse) and dscore = score'(q.k) * p * (dp - dot(dout, out)) for one
// (query, key) pair; `dot` and `dp` are the unscaled dot products q.k and dout.v.
struct Probability {
  double p, dscore;
};
Probability probability(const Geometry& g, double dot, double dp, double row_lse,
                        double dout_dot_out) {
  const double p = std::exp(g.score(dot) - row_lse);
  return {p, g.score_slope(dot) * p * (dp - dout_dot_out)};
}

// dq for the query block `rows` of (b, h): sums over the key blocks its queries see.
void query_gradient_block(const Geometry& g, const TensorView& dout, const TensorView& q,
                          const TensorView& k, const TensorView& v, const TensorView& out,
                          const TensorView& lse, TensorView dq, std::int64_t b, std::int64_t h,
                          Range rows) {
  const std::int64_t kv_head = h / g.group;
  Matrix queries, dout_rows, out_rows, keys, keys_t, values, values_t, dscores, dprobs, dq_acc;
  std::vector<double> row_lse, dout_dot_out;
  load_rows(q, b, h, rows, queries);
  load_rows(dout, b, h, rows, dout_rows);
  load_row_statistics(g, out, lse, b, h, rows, dout_rows, out_rows, row_lse, dout_dot_out);
  dq_acc.zero(rows.size(), g.head_dim);
  const Range keys_seen = keys_of_block(g, rows);
  for (std::int64_t kb = 0; kb < block_count(keys_seen.size()); ++kb) {
    const Range cols = block_range(keys_seen.begin, keys_seen.end, kb);
    auto seen = [&](std::int64_t r) { return relative_part(g.keys_of(rows.begin + r), cols); };
    load_rows(k, b, kv_head, cols, keys);
    transpose(keys, keys_t);
    load_rows(v, b, kv_head, cols, values);
    transpose(values, values_t);
    multiply(queries, keys_t, dscores);
    multiply(dout_rows, values_t, dprobs);
    for (std::int64_t r = 0; r < rows.size(); ++r) {
      for (std::int64_t j = seen(r).begin; j < seen(r).end; ++j) {
        dscores.row(r)[j] =
            probability(g, dscores.row(r)[j], dprobs.row(r)[j], row_lse[r], dout_dot_out[r]).dscore;
      }
    }
    multiply_accumulate(dscores, keys, dq_acc, seen);
  }
  store_rows(dq, b, h, rows, dq_acc);
}

// dk and dv for the key block `cols` of (b, kv head): sums over every query of the group's
// heads that sees one of its keys, working on transposed (key-major) score tiles.
void key_value_gradient_block(const Geometry& g, const TensorView& dout, const TensorView& q,
                              const TensorView& k, const TensorView& v, const TensorView& out,
                              const TensorView& lse, TensorView dk, TensorView dv, std::int64_t b,
                              std::int64_t kv_head, Range cols) {
  Matrix keys, values, queries, queries_t, dout_rows, dout_t, out_rows, probs_t, dscores_t, dk_acc,
      dv_acc;
  std::vector<double> row_lse, dout_dot_out;
  load_rows(k, b, kv_head, cols, keys);
  load_rows(v, b, kv_head, cols, values);
  dk_acc.zero(cols.size(), g.head_dim);
  dv_acc.zero(cols.size(), g.head_dim);
  const Range queries_seen = queries_of_block(g, cols);
  for (std::int64_t h = kv_head * g.group; h < (kv_head + 1) * g.group; ++h) {
    for (std::int64_t qb = 0; qb < block_count(queries_seen.size()); ++qb) {
      const Range rows = block_range(queries_seen.begin, queries_seen.end, qb);
      auto seen_by = [&](std::int64_t c) { return relative_part(g.queries_of(cols.begin + c), rows); };
      load_rows(q, b, h, rows, queries);
      transpose(queries, queries_t);
      load_rows(dout, b, h, rows, dout_rows);
      transpose(dout_rows, dout_t);
      load_row_statistics(g, out, lse, b, h, rows, dout_rows, out_rows, row_lse, dout_dot_out);
      multiply(keys, queries_t, probs_t);
      multiply(values, dout_t, dscores_t);
      for (std::int64_t c = 0; c < cols.size(); ++c) {
        for (std::int64_t r = seen_by(c).begin; r < seen_by(c).end; ++r) {
          const Probability pr =
              probability(g, probs_t.row(c)[r], dscores_t.row(c)[r], row_lse[r], dout_dot_out[r]);
          probs_t.row(c)[r] = pr.p;
          dscores_t.row(c)[r] = pr.dscore;
        }
      }
      multiply_accumulate(probs_t, dout_rows, dv_acc, seen_by);
      multiply_accumulate(dscores_t, queries, dk_acc, seen_by);
    }
  }
  store_rows(dk, b, kv_head, cols, dk_acc);
  store_rows(dv, b, kv_head, cols, dv_acc);
}

}  // namespace

void attention_backward_cpu(const TensorView& dout, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& out, const TensorView& lse,
                            TensorView dq, TensorView dk, TensorView dv,
                            const AttentionOptions& options) {
  const Geometry g(q, k, lse, options);
  const std::int64_t q_blocks = block_count(g.q_len), k_blocks = block_count(g.kv_len);
  // dq: one item per (b, h, query block).
  detail::parallel_for(g.batch * g.q_heads * q_blocks,
                       grain_for(std::min(kBlock, g.q_len) * g.kv_len * g.head_dim),
                       [&](std::int64_t lo, std::int64_t hi) {
                         for (std::int64_t item = lo; item < hi; ++item) {
                           const std::int64_t b = item / q_blocks / g.q_heads;
                           const std::int64_t h = item / q_blocks % g.q_heads;
                           query_gradient_block(g, dout, q, k, v, out, lse, dq, b, h,
                                                block_range(0, g.q_len, item % q_blocks));
                         }
                       });
  // dk, dv: one item per (b, kv head, key block), which owns those rows of both.
  detail::parallel_for(g.batch * g.kv_heads * k_blocks,
                       grain_for(g.group * g.q_len * std::min(kBlock, g.kv_len) * g.head_dim),
                       [&](std::int64_t lo, std::int64_t hi) {
                         for (std::int64_t item = lo; item < hi; ++item) {
                           const std::int64_t b = item / k_blocks / g.kv_heads;
                           const std::int64_t kv_head = item / k_blocks % g.kv_heads;
                           key_value_gradient_block(g, dout, q, k, v, out, lse, dk, dv, b, kv_head,
                                                    block_range(0, g.kv_len, item % k_blocks));
                         }
                       });
}

}  // namespace trainscale::ops::attention
