// The optimizer family's fp64 reference: every value read as a double, each output rounded
// once to its dtype.
#include <cmath>

#include "core/host_dtype.h"
#include "ops/optim/optim_internal.h"

namespace trainscale::ops::optim {

void adamw_step_cpu(std::span<const TensorView> params, std::span<const TensorView> grads,
                    std::span<const TensorView> exp_avgs, std::span<const TensorView> exp_avg_sqs,
                    const AdamWOptions& options, const TensorView& grad_scale) {
  const AdamWScalars s = adamw_scalars(options);
  const double scale = grad_scale.defined() ? detail::load_as_double(grad_scale.dtype, grad_scale.data, 0) : 1.0;
  for (std::size_t t = 0; t < params.size(); ++t) {
    const TensorView &p = params[t], &g = grads[t], &m = exp_avgs[t], &v = exp_avg_sqs[t];
    for (std::int64_t i = 0; i < p.numel(); ++i) {
      const double gi = detail::load_as_double(g.dtype, g.data, i) * scale;
      const double mi = detail::load_as_double(m.dtype, m.data, i);
      const double vi = detail::load_as_double(v.dtype, v.data, i);
      const double m_new = mi + (1.0 - options.beta1) * (gi - mi);
      const double v_new = options.beta2 * vi + (1.0 - options.beta2) * gi * gi;
      const double pi = detail::load_as_double(p.dtype, p.data, i);
      const double p_new = pi * s.decay - s.step_size * m_new / (std::sqrt(v_new) * s.inv_sqrt_bc2 + options.eps);
      detail::store_from_double(m.dtype, m.data, i, m_new);
      detail::store_from_double(v.dtype, v.data, i, v_new);
      detail::store_from_double(p.dtype, p.data, i, p_new);
    }
  }
}

void grad_norm_cpu(std::span<const TensorView> grads, double max_norm, TensorView norm, TensorView clip_factor) {
  double sum = 0;
  for (const TensorView& g : grads) {
    for (std::int64_t i = 0; i < g.numel(); ++i) {
      const double x = detail::load_as_double(g.dtype, g.data, i);
      sum += x * x;
    }
  }
  const double n = std::sqrt(sum);
  detail::store_from_double(norm.dtype, norm.data, 0, n);
  detail::store_from_double(clip_factor.dtype, clip_factor.data, 0, clip_factor_of(n, max_norm));
}

void scale_by_device_factor_cpu(std::span<const TensorView> tensors, const TensorView& factor) {
  const double f = detail::load_as_double(factor.dtype, factor.data, 0);
  if (f == 1.0) return;
  for (const TensorView& t : tensors) {
    for (std::int64_t i = 0; i < t.numel(); ++i)
      detail::store_from_double(t.dtype, t.data, i, detail::load_as_double(t.dtype, t.data, i) * f);
  }
}

}  // namespace trainscale::ops::optim
