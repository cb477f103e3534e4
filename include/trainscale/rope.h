// Rotary position embedding (RoPE) of queries and keys, in one call for both.
//
// Pair i (0 <= i < rotary_dim / 2) of the head dim is rotated by angle(p, i) at position p:
//   out[i0] = x[i0] cos - x[i1] sin,   out[i1] = x[i0] sin + x[i1] cos,
// with (i0, i1) = (i, i + rotary_dim / 2) for NeoX (rotate-half) and (2i, 2i + 1) for GPT-J
// (interleaved). Dims from rotary_dim to D pass through unchanged. The backward pass is the
// same rotation by -angle (the transpose), applied to the upstream gradients.
#pragma once

#include <cstdint>

#include "trainscale/tensor.h"

namespace trainscale {

enum class RopeStyle {
  kNeox,  // rotate-half: pairs (i, i + rotary_dim / 2)
  kGptJ,  // interleaved: pairs (2i, 2i + 1)
};
const char* rope_style_name(RopeStyle style);

struct RopeOptions {
  RopeStyle style = RopeStyle::kNeox;
  // -1: the whole head dim D. Otherwise even and <= D; dims beyond it pass through.
  std::int64_t rotary_dim = -1;
  // Used when cos / sin are absent: angle(p, i) = p * theta^(-2i / rotary_dim). Finite, > 0.
  double theta = 10000.0;
};

// q: [B, S, Hq, D]; k: [B, S, Hk, D] or absent (Hk may differ from Hq, as in GQA; B, S and D
// match q). Any strides with stride 1 in the head dim, so [B, H, S, D] memory works through a
// permuted view. Dtypes: float32, float16, bfloat16 (float64 on the CPU); k has q's dtype.
// q_out / k_out: q's / k's shape and dtype, any strides with stride 1 in the head dim; k_out is
// given exactly when k is. For in place pass the same view as the input (q_out == q,
// k_out == k); any other overlap is an error, except that q and k (and so q_out and k_out) may
// be disjoint head slices of one fused QKV buffer.
// cos, sin: both absent (angles computed from options.theta) or both [P, rotary_dim / 2] with
// stride 1 in the last dim, float32 or q's dtype: row p, element i = cos / sin of pair i's
// angle at position p.
// position_offsets: int32 / int64 [B] or absent: token s of batch b sits at position
// offsets[b] + s (s when absent). Positions must be >= 0 and, when tables are given, < P.
// The CPU path checks this; on CUDA the offsets stay on the device, so out-of-range positions
// there are the caller's responsibility (the shape-only S <= P check is still made).
void rope_forward(const TensorView& q, const TensorView& k, TensorView q_out, TensorView k_out,
                  const TensorView& cos, const TensorView& sin, const TensorView& position_offsets,
                  const RopeOptions& options = {}, cudaStream_t stream = nullptr);

// dq = R(-angle) dq_out, dk = R(-angle) dk_out, with every argument rule of rope_forward
// (dq_out in q's place, dq in q_out's).
void rope_backward(const TensorView& dq_out, const TensorView& dk_out, TensorView dq, TensorView dk,
                   const TensorView& cos, const TensorView& sin, const TensorView& position_offsets,
                   const RopeOptions& options = {}, cudaStream_t stream = nullptr);

}  // namespace trainscale
