// Between the RoPE entry points (rope.cc), its CPU reference (rope_cpu.cc) and its CUDA
// kernels (rope.cu). Arguments arrive validated, rotary_dim resolved (never -1).
#pragma once

#include <cstdint>

#include "core/check.h"
#include "trainscale/rope.h"

namespace trainscale::ops::rope {

enum class Direction { kForward, kBackward };  // rotate by +angle / by -angle

// Rotates every (token, head) vector of x_q into out_q and, when x_k is given, of x_k into
// out_k; tail dims [rotary_dim, D) are copied.
void rope_cpu(Direction direction, const TensorView& x_q, const TensorView& x_k, TensorView out_q,
              TensorView out_k, const TensorView& cos, const TensorView& sin,
              const TensorView& position_offsets, std::int64_t rotary_dim,
              const RopeOptions& options);

}  // namespace trainscale::ops::rope
