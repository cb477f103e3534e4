// CUDA launcher of the RoPE family (rope.cu); arguments arrive validated by rope.cc, rotary_dim
// resolved (never -1).
#pragma once

#include <cstdint>

#include "ops/rope/rope_internal.h"

namespace trainscale::ops::rope {

// kVector: 16-byte accesses (every view 16-byte aligned with 16-byte multiples as strides, and
// head / rotary dims in whole vectors); kScalar: element accesses, any layout. kAuto picks
// kVector where it applies. Tests and the bench can force one; a forced kVector that does not
// apply is an error.
enum class RopeVariant { kAuto, kVector, kScalar };

// q and k (when given) rotated in one launch on `stream`.
void rope_cuda(Direction direction, const TensorView& x_q, const TensorView& x_k, TensorView out_q,
               TensorView out_k, const TensorView& cos, const TensorView& sin,
               const TensorView& position_offsets, std::int64_t rotary_dim,
               const RopeOptions& options, cudaStream_t stream,
               RopeVariant variant = RopeVariant::kAuto);

}  // namespace trainscale::ops::rope
