// Between the attention family's entry points (attention.cc), its CPU reference
// (attention_cpu.cc) and its CUDA launchers (attention_*_hdim*.cu). Arguments arrive validated.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/check.h"
#include "trainscale/attention.h"

namespace trainscale::ops::attention {

// The softmax scale the options stand for.
inline double resolved_scale(const AttentionOptions& options, std::int64_t head_dim) {
  return options.scale != 0.0 ? options.scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

void attention_forward_cpu(const TensorView& q, const TensorView& k, const TensorView& v,
                           TensorView out, TensorView lse, const AttentionOptions& options);
void attention_backward_cpu(const TensorView& dout, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& out, const TensorView& lse,
                            TensorView dq, TensorView dk, TensorView dv,
                            const AttentionOptions& options);

}  // namespace trainscale::ops::attention
