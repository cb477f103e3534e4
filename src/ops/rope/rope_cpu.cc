// fp64 reference for RoPE.
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "core/host_dtype.h"
#include "core/parallel.h"
#include "ops/rope/rope_internal.h"

namespace trainscale::ops::rope {

using detail::load_as_double;
using detail::store_from_double;

namespace {

// Head-dim indices of rotated pair i.
std::pair<std::int64_t, std::int64_t> pair_dims(RopeStyle style, std::int64_t i,
                                                std::int64_t rotary_dim) {
  return style == RopeStyle::kNeox ? std::pair{i, i + rotary_dim / 2} : std::pair{2 * i, 2 * i + 1};
}

// Rotates the Hx head vectors of token (b, s) of x into out by the angles whose cosines and
// (direction-signed) sines are given per pair.
void rotate_token(const TensorView& x, TensorView out, std::int64_t b, std::int64_t s,
                  const std::vector<double>& cos_v, const std::vector<double>& sin_v,
                  std::int64_t rotary_dim, RopeStyle style) {
  const std::int64_t heads = x.size(2), dims = x.size(3);
  for (std::int64_t h = 0; h < heads; ++h) {
    const std::int64_t in_base = b * x.stride(0) + s * x.stride(1) + h * x.stride(2);
    const std::int64_t out_base = b * out.stride(0) + s * out.stride(1) + h * out.stride(2);
    auto in_at = [&](std::int64_t d) { return in_base + d * x.stride(3); };
    auto out_at = [&](std::int64_t d) { return out_base + d * out.stride(3); };
    for (std::int64_t i = 0; i < rotary_dim / 2; ++i) {
      const auto [d0, d1] = pair_dims(style, i, rotary_dim);
      const double x0 = load_as_double(x.dtype, x.data, in_at(d0));
      const double x1 = load_as_double(x.dtype, x.data, in_at(d1));
      store_from_double(out.dtype, out.data, out_at(d0), x0 * cos_v[i] - x1 * sin_v[i]);
      store_from_double(out.dtype, out.data, out_at(d1), x0 * sin_v[i] + x1 * cos_v[i]);
    }
    for (std::int64_t d = rotary_dim; d < dims; ++d) {
      store_from_double(out.dtype, out.data, out_at(d), load_as_double(x.dtype, x.data, in_at(d)));
    }
  }
}

}  // namespace

void rope_cpu(Direction direction, const TensorView& x_q, const TensorView& x_k, TensorView out_q,
              TensorView out_k, const TensorView& cos, const TensorView& sin,
              const TensorView& position_offsets, std::int64_t rotary_dim,
              const RopeOptions& options) {
  const std::int64_t batch = x_q.size(0), seq = x_q.size(1), pairs = rotary_dim / 2;
  const double sin_sign = direction == Direction::kForward ? 1.0 : -1.0;
  const bool tables = cos.defined();
  std::vector<double> inv_freq(tables ? 0 : pairs);
  for (std::int64_t i = 0; i < static_cast<std::int64_t>(inv_freq.size()); ++i) {
    inv_freq[i] =
        std::pow(options.theta, -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim));
  }
  const std::int64_t heads = x_q.size(2) + (x_k.defined() ? x_k.size(2) : 0);
  const std::int64_t tokens_per_chunk =
      std::max<std::int64_t>(1, 16384 / std::max<std::int64_t>(1, heads * x_q.size(3)));
  detail::parallel_for(batch * seq, tokens_per_chunk, [&](std::int64_t lo, std::int64_t hi) {
    std::vector<double> cos_v(pairs), sin_v(pairs);
    for (std::int64_t t = lo; t < hi; ++t) {
      const std::int64_t b = t / seq, s = t % seq;
      std::int64_t position = s;
      if (position_offsets.defined()) {
        position += detail::load_index(position_offsets.dtype, position_offsets.data,
                                       b * position_offsets.stride(0));
      }
      for (std::int64_t i = 0; i < pairs; ++i) {
        if (tables) {
          cos_v[i] =
              load_as_double(cos.dtype, cos.data, position * cos.stride(0) + i * cos.stride(1));
          sin_v[i] =
              load_as_double(sin.dtype, sin.data, position * sin.stride(0) + i * sin.stride(1));
        } else {
          const double angle = static_cast<double>(position) * inv_freq[i];
          cos_v[i] = std::cos(angle);
          sin_v[i] = std::sin(angle);
        }
        sin_v[i] *= sin_sign;
      }
      rotate_token(x_q, out_q, b, s, cos_v, sin_v, rotary_dim, options.style);
      if (x_k.defined()) rotate_token(x_k, out_k, b, s, cos_v, sin_v, rotary_dim, options.style);
    }
  });
}

}  // namespace trainscale::ops::rope
