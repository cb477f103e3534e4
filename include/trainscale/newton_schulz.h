// Newton-Schulz orthogonalization and the Muon optimizer step built on it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "trainscale/tensor.h"

namespace trainscale {

// How the CUDA path runs the steps (the CPU path computes the standard iteration for both: in
// exact arithmetic they give the same X).
enum class NewtonSchulzMethod : std::uint8_t {
  kStandard,  // per step A = X X^T, B = b A + c A A, X = a X + B X on the [p, q] X
  // Gram Newton-Schulz: X_k = Q_k X_0 with Q_k a polynomial in X_0 X_0^T, so the steps run on
  // [p, p] matrices and X is formed only after the second step (a restart that recomputes the
  // Gram matrix from it) and the last. Fewer FLOPs than kStandard where q >= 1.5 p; used where
  // q >= 3 p (the [p, p] iterates then fit in the workspace X's next value takes), the standard
  // steps elsewhere.
  kGram,
};

struct NewtonSchulzOptions {
  int steps = 5;  // >= 0
  // The quintic X <- a X + b (X X^T) X + c (X X^T)^2 X; every coefficient finite.
  double a = 3.4445, b = -4.7750, c = 2.0315;
  // Optional per-step (a, b, c) replacing the three above; its size must equal `steps`.
  std::vector<std::array<double, 3>> per_step;
  double eps = 1e-7;  // finite, >= 0
  NewtonSchulzMethod method = NewtonSchulzMethod::kStandard;
};

// g [R, C], or a batch [N, R, C] of matrices of one shape (N <= 65535)
// (float32 / float16 / bfloat16; float64 on the CPU), rows contiguous with one row stride >= C
// (matrix n starts R row strides after matrix n - 1); out like g, same layout rules, disjoint
// from g. For each matrix G: X = G / (||G||_F + eps), transposed when R > C so X X^T is the
// smaller Gram matrix; each step: A = X X^T; B = b A + c A A; X = a X + B X; out = X
// (transposed back).
// workspace: the CUDA path's scratch, at least newton_schulz_workspace_bytes(g) bytes,
// contiguous and 256-byte aligned; ignored on the CPU and may be absent there. On CUDA, X and
// the Gram products A and B are stored in g's dtype between the products (float32
// accumulation), as Muon implementations keep them; the same bits every run, and each matrix
// of a batch gets the bits a call on that matrix alone gives (the batch runs strided-batched
// products whose algorithm is chosen for one matrix).
void newton_schulz(const TensorView& g, TensorView out, const NewtonSchulzOptions& options = {},
                   TensorView workspace = {}, cudaStream_t stream = nullptr);
// Bytes of workspace newton_schulz's CUDA path needs for g's shape and dtype (0 in a build
// without CUDA).
std::size_t newton_schulz_workspace_bytes(const TensorView& g);

// Parameters muon_step's CUDA path takes through Newton-Schulz in one batch.
inline constexpr std::int64_t kMuonMaxBatch = 32;

// The factor s of lr in the update of an R x C parameter (the names of torch.optim.Muon's
// adjust_lr_fn).
enum class MuonLrAdjust : std::uint8_t {
  kOriginal,           // max(1, R / C)^0.5 (Keller Jordan's Muon)
  kMatchRmsAdamW,      // 0.2 * max(R, C)^0.5 (Moonlight: the update's RMS near AdamW's)
  kSpectralUnclamped,  // (R / C)^0.5
};

struct MuonOptions {
  double lr = 0.02, momentum = 0.95, weight_decay = 0.0;  // each finite, >= 0
  bool nesterov = true;
  MuonLrAdjust lr_adjust = MuonLrAdjust::kOriginal;
  NewtonSchulzOptions newton_schulz{};
};

// One Muon step on a 2D parameter, in place on param and momentum_buffer:
//   buf <- momentum * buf + grad;  u = nesterov ? grad + momentum * buf : buf;  o = NS(u);
//   param <- param * (1 - lr * weight_decay) - lr * s * o   (s: options.lr_adjust).
// param [R, C] (float32 / float16 / bfloat16; float64 on the CPU); grad like param;
// momentum_buffer [R, C] in float32 or param's dtype. Rows contiguous; the three disjoint.
// On the CPU u is the exact (unrounded) new buffer; on CUDA the momentum pass computes in
// float32 and rounds u once to param's dtype, the dtype Newton-Schulz runs in. Each output is
// rounded once on store.
// workspace: on CUDA at least muon_step_workspace_bytes(param) bytes, contiguous and 256-byte
// aligned; ignored on the CPU.
void muon_step(TensorView param, const TensorView& grad, TensorView momentum_buffer,
               const MuonOptions& options = {}, TensorView workspace = {},
               cudaStream_t stream = nullptr);

// The same step on many parameters of one shape, dtype and device (a model's layers), each
// with its own grad and momentum buffer (one dtype for all buffers); every tensor may have its
// own row stride and none overlaps another. On CUDA the parameters go through Newton-Schulz in
// batches of up to kMuonMaxBatch: each parameter gets the bits a muon_step on it alone
// gives. workspace: at least muon_step_workspace_bytes(params[0], params.size()) bytes.
void muon_step(std::span<const TensorView> params, std::span<const TensorView> grads,
               std::span<const TensorView> momentum_buffers, const MuonOptions& options = {},
               TensorView workspace = {}, cudaStream_t stream = nullptr);
// Bytes of workspace muon_step's CUDA path needs for `count` parameters like param (0 in a
// build without CUDA).
std::size_t muon_step_workspace_bytes(const TensorView& param, std::int64_t count = 1);

}  // namespace trainscale
