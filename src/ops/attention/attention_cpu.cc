// fp64 reference for the attention family.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/host_dtype.h"
#include "core/parallel.h"
#include "ops/attention/attention_internal.h"

namespace trainscale::ops::attention {

using detail::load_as_double;
using detail::store_from_double;

namespace {

// Sizes shared by forward and backward; q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D].
struct Geometry {
  std::int64_t batch, q_len, kv_len, q_heads, kv_heads, head_dim;
  std::int64_t group;  // query heads per kv head
  double scale;
  bool causal;

  Geometry(const TensorView& q, const TensorView& k, const AttentionOptions& options)
      : batch(q.size(0)),
        q_len(q.size(1)),
        kv_len(k.size(1)),
        q_heads(q.size(2)),
        kv_heads(k.size(2)),
        head_dim(q.size(3)),
        group(q_heads / kv_heads),
        scale(resolved_scale(options, head_dim)),
        causal(options.causal) {}

  // Query i sees keys [0, visible_keys(i)); the causal mask is aligned bottom-right.
  std::int64_t visible_keys(std::int64_t i) const {
    if (!causal) return kv_len;
    return std::clamp<std::int64_t>(i + kv_len - q_len + 1, 0, kv_len);
  }
  // Flat index of (b, h, i) in a contiguous [B, Hq, Sq] lse.
  std::int64_t lse_index(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return (b * q_heads + h) * q_len + i;
  }
};

// Element offset of vector (b, s, h) in a [B, S, H, D] view; D has stride 1.
std::int64_t vector_offset(const TensorView& t, std::int64_t b, std::int64_t s, std::int64_t h) {
  return b * t.strides[0] + s * t.strides[1] + h * t.strides[2];
}

void load_vector(const TensorView& t, std::int64_t offset, std::int64_t n, double* dst) {
  for (std::int64_t d = 0; d < n; ++d) dst[d] = load_as_double(t.dtype, t.data, offset + d);
}

void store_vector(const TensorView& t, std::int64_t offset, std::int64_t n, const double* src) {
  for (std::int64_t d = 0; d < n; ++d) store_from_double(t.dtype, t.data, offset + d, src[d]);
}

double dot(const double* a, const double* b, std::int64_t n) {
  double s = 0;
  for (std::int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

// Rows per thread chunk so each chunk does a worthwhile amount of work.
std::int64_t grain_for(std::int64_t work_per_item) {
  constexpr std::int64_t kWorkPerChunk = 1 << 16;
  return std::max<std::int64_t>(1, kWorkPerChunk / std::max<std::int64_t>(1, work_per_item));
}

}  // namespace

void attention_forward_cpu(const TensorView& q, const TensorView& k, const TensorView& v,
                           TensorView out, TensorView lse, const AttentionOptions& options) {
  const Geometry g(q, k, options);
  const std::int64_t D = g.head_dim;
  const std::int64_t rows = g.batch * g.q_heads * g.q_len;  // (b, h, i), lse's order
  detail::parallel_for(rows, grain_for(g.kv_len * D), [&](std::int64_t lo, std::int64_t hi) {
    std::vector<double> q_row(D), key(D), acc(D), scores(g.kv_len);
    for (std::int64_t r = lo; r < hi; ++r) {
      const std::int64_t i = r % g.q_len, h = r / g.q_len % g.q_heads, b = r / g.q_len / g.q_heads;
      const std::int64_t kv_head = h / g.group, keys = g.visible_keys(i);
      std::fill(acc.begin(), acc.end(), 0.0);
      double row_lse = -std::numeric_limits<double>::infinity();
      if (keys > 0) {
        load_vector(q, vector_offset(q, b, i, h), D, q_row.data());
        double max_score = -std::numeric_limits<double>::infinity();
        for (std::int64_t j = 0; j < keys; ++j) {
          load_vector(k, vector_offset(k, b, j, kv_head), D, key.data());
          scores[j] = g.scale * dot(q_row.data(), key.data(), D);
          max_score = std::max(max_score, scores[j]);
        }
        // A NaN score is skipped by max but reaches the sum and every output through exp.
        double sum = 0;
        for (std::int64_t j = 0; j < keys; ++j) {
          const double p = std::exp(scores[j] - max_score);
          sum += p;
          const std::int64_t v_offset = vector_offset(v, b, j, kv_head);
          for (std::int64_t d = 0; d < D; ++d)
            acc[d] += p * load_as_double(v.dtype, v.data, v_offset + d);
        }
        for (double& a : acc) a /= sum;
        row_lse = max_score + std::log(sum);
      }
      store_vector(out, vector_offset(out, b, i, h), D, acc.data());
      if (lse.defined()) store_from_double(lse.dtype, lse.data, g.lse_index(b, h, i), row_lse);
    }
  });
}

void attention_backward_cpu(const TensorView& dout, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& out, const TensorView& lse,
                            TensorView dq, TensorView dk, TensorView dv,
                            const AttentionOptions& options) {
  const Geometry g(q, k, options);
  const std::int64_t D = g.head_dim, Sk = g.kv_len;
  // One item per (b, kv head): it owns dk/dv of that head and dq of the query heads reading it.
  const std::int64_t items = g.batch * g.kv_heads;
  const std::int64_t work_per_item = g.group * g.q_len * Sk * D;
  detail::parallel_for(items, grain_for(work_per_item), [&](std::int64_t lo, std::int64_t hi) {
    std::vector<double> keys(Sk * D), values(Sk * D), dkeys(Sk * D), dvalues(Sk * D);
    std::vector<double> q_row(D), dout_row(D), out_row(D), dq_row(D);
    for (std::int64_t item = lo; item < hi; ++item) {
      const std::int64_t b = item / g.kv_heads, kv_head = item % g.kv_heads;
      for (std::int64_t j = 0; j < Sk; ++j) {
        load_vector(k, vector_offset(k, b, j, kv_head), D, &keys[j * D]);
        load_vector(v, vector_offset(v, b, j, kv_head), D, &values[j * D]);
      }
      std::fill(dkeys.begin(), dkeys.end(), 0.0);
      std::fill(dvalues.begin(), dvalues.end(), 0.0);
      for (std::int64_t h = kv_head * g.group; h < (kv_head + 1) * g.group; ++h) {
        for (std::int64_t i = 0; i < g.q_len; ++i) {
          std::fill(dq_row.begin(), dq_row.end(), 0.0);
          const std::int64_t visible = g.visible_keys(i);
          if (visible > 0) {
            load_vector(q, vector_offset(q, b, i, h), D, q_row.data());
            load_vector(dout, vector_offset(dout, b, i, h), D, dout_row.data());
            load_vector(out, vector_offset(out, b, i, h), D, out_row.data());
            const double row_lse = load_as_double(lse.dtype, lse.data, g.lse_index(b, h, i));
            const double dout_dot_out = dot(dout_row.data(), out_row.data(), D);
            for (std::int64_t j = 0; j < visible; ++j) {
              const double* key = &keys[j * D];
              const double p = std::exp(g.scale * dot(q_row.data(), key, D) - row_lse);
              const double dp = dot(dout_row.data(), &values[j * D], D);
              const double dscore = g.scale * p * (dp - dout_dot_out);
              for (std::int64_t d = 0; d < D; ++d) {
                dvalues[j * D + d] += p * dout_row[d];
                dkeys[j * D + d] += dscore * q_row[d];
                dq_row[d] += dscore * key[d];
              }
            }
          }
          store_vector(dq, vector_offset(dq, b, i, h), D, dq_row.data());
        }
      }
      for (std::int64_t j = 0; j < Sk; ++j) {
        store_vector(dk, vector_offset(dk, b, j, kv_head), D, &dkeys[j * D]);
        store_vector(dv, vector_offset(dv, b, j, kv_head), D, &dvalues[j * D]);
      }
    }
  });
}

}  // namespace trainscale::ops::attention
