// Newton-Schulz orthogonalization and the Muon optimizer step built on it.
#pragma once

#include <array>
#include <cstddef>
#include <vector>

#include "trainscale/tensor.h"

namespace trainscale {

struct NewtonSchulzOptions {
  int steps = 5;  // >= 0
  // The quintic X <- a X + b (X X^T) X + c (X X^T)^2 X; every coefficient finite.
  double a = 3.4445, b = -4.7750, c = 2.0315;
  // Optional per-step (a, b, c) replacing the three above; its size must equal `steps`.
  std::vector<std::array<double, 3>> per_step;
  double eps = 1e-7;  // finite, >= 0
};

// g [R, C] (float32 / float16 / bfloat16; float64 on the CPU), rows contiguous (any row
// stride >= C); out [R, C] in g's dtype, same layout rules, disjoint from g.
// X = G / (||G||_F + eps), transposed when R > C so X X^T is the smaller Gram matrix; each
// step: A = X X^T; B = b A + c A A; X = a X + B X; out = X (transposed back).
// workspace: the CUDA path's scratch, at least newton_schulz_workspace_bytes(g) bytes,
// contiguous and 256-byte aligned; ignored on the CPU and may be absent there. On CUDA, X and
// the Gram products A and B are stored in g's dtype between the products (float32
// accumulation), as Muon implementations keep them; the same bits every run.
void newton_schulz(const TensorView& g, TensorView out, const NewtonSchulzOptions& options = {},
                   TensorView workspace = {}, cudaStream_t stream = nullptr);
// Bytes of workspace newton_schulz's CUDA path needs for g's shape and dtype (0 in a build
// without CUDA).
std::size_t newton_schulz_workspace_bytes(const TensorView& g);

struct MuonOptions {
  double lr = 0.02, momentum = 0.95, weight_decay = 0.0;  // each finite, >= 0
  bool nesterov = true;
  NewtonSchulzOptions newton_schulz{};
};

// One Muon step on a 2D parameter, in place on param and momentum_buffer:
//   buf <- momentum * buf + grad;  u = nesterov ? grad + momentum * buf : buf;  o = NS(u);
//   param <- param * (1 - lr * weight_decay) - lr * max(1, R / C)^0.5 * o.
// param [R, C] (float32 / float16 / bfloat16; float64 on the CPU); grad like param;
// momentum_buffer [R, C] in float32 or param's dtype. Rows contiguous; the three disjoint.
// u is the exact (unrounded) new buffer; each output is rounded once on store.
void muon_step(TensorView param, const TensorView& grad, TensorView momentum_buffer,
               const MuonOptions& options = {}, TensorView workspace = {},
               cudaStream_t stream = nullptr);

}  // namespace trainscale
