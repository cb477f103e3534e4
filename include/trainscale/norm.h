// Normalizations over the last dimension: RMSNorm, fused residual-add + RMSNorm, LayerNorm.
//
// Tensors are seen as M rows of N elements (leading dims flattened; last stride 1, one row
// stride >= N for all rows). Activations: float32, float16, bfloat16 (float64 on the CPU).
// Saved statistics (rstd, mean) hold M elements, contiguous, float32 (float64 allowed when x
// is float64, for finite-difference checks). Per-feature parameters (weight, bias) are [N],
// contiguous, float32 or x's dtype; an absent one (TensorView{}) means ones (weight) or zeros
// (bias). Gradients of parameters are reduced over rows deterministically.
//
// Backward passes rebuild the normalized row from x (in double in the reference) with the
// mean / rstd exactly as saved by the forward pass; the statistics are not recomputed.
#pragma once

#include <cstddef>
#include <cstdint>

#include "trainscale/tensor.h"

namespace trainscale {

// The CUDA row kernel; the CPU path ignores it. A forced variant that cannot run the call's
// shape or alignment throws UnsupportedVariantError.
enum class NormVariant {
  kAuto,       // by row length, dtype and alignment
  kRegisters,  // whole row in registers; forward: persistent grid, weight/bias staged in shared
               // memory; aligned rows of at most 4096 (forward) / 32768 (backward) 16-byte vectors
  kTwoPass,    // any row: one block per row, pass 1 reduces, pass 2 re-reads and writes
  kRows,       // forward only (the backward chooses as for kAuto): whole row in registers, one
               // row group per block, weight/bias read from global memory per row; aligned
               // rows of at most 4096 16-byte vectors, and up to 8 x 4096 (bf16/fp16 N <=
               // 262144, fp32 N <= 131072) split over a thread-block cluster of 2, 4 or 8
               // blocks (kAuto's choice for those rows)
  kPipelined,  // forward only (the backward chooses as for kAuto): kRegisters with the rows
               // arriving through a cp.async shared-memory ring, the next row group's loads in
               // flight during this group's reduction and stores (LayerNorm's persistent grid:
               // two row groups; one group per block otherwise: one, overlapping the staging);
               // needs shared memory for the staged parameters and the ring (kAuto's choice up
               // to 256 vectors per row, 512 for the fused add)
  kRing,       // forward only, sm_90 (the backward chooses as for kAuto): a persistent grid
               // whose blocks fetch each row with one bulk copy into a shared-memory ring of
               // several rows, weight and bias held in registers; aligned rows of at most 1024
               // 16-byte vectors (bf16 N <= 8192), no residual; kAuto's choice for 16-bit rows of 257-1024
               // vectors in inputs of up to 2.5 Mi vectors (40 MiB)
};

struct RMSNormOptions {
  double eps = 1e-6;           // >= 0, finite
  double weight_offset = 0.0;  // y = x * rstd * (w + offset); Gemma uses 1.0
  NormVariant variant = NormVariant::kAuto;
};

struct LayerNormOptions {
  double eps = 1e-5;  // >= 0, finite
  NormVariant variant = NormVariant::kAuto;
};

// rstd = 1 / sqrt(mean(x^2) + eps), y = x * rstd * (w + offset).
// y: x's shape and dtype, its own row stride, disjoint from x. rstd: optional output.
void rmsnorm_forward(const TensorView& x, const TensorView& weight, TensorView y, TensorView rstd,
                     const RMSNormOptions& options = {}, cudaStream_t stream = nullptr);

// dy: like x. rstd: as saved by rmsnorm_forward (required). dx: like x; may be exactly dy's
// view (in place), otherwise disjoint from every input. dw: like weight, required iff weight
// is given. workspace: scratch for the CUDA path (ignored on the CPU; may be absent).
void rmsnorm_backward(const TensorView& dy, const TensorView& x, const TensorView& weight,
                      const TensorView& rstd, TensorView dx, TensorView dw, TensorView workspace,
                      const RMSNormOptions& options = {}, cudaStream_t stream = nullptr);

// In place: residual <- x + residual (rounded to residual's dtype), then x <- rmsnorm(residual)
// computed from the residual as stored, so it equals an add followed by rmsnorm_forward.
// residual: x's shape, x's dtype or float32, disjoint from x. rstd: optional output.
void fused_add_rmsnorm_forward(TensorView x, TensorView residual, const TensorView& weight,
                               TensorView rstd, const RMSNormOptions& options = {},
                               cudaStream_t stream = nullptr);

// The same out of place, for training (where the residual is kept for an earlier norm's
// backward): residual_out <- x + residual (rounded to residual's dtype), y <- rmsnorm of the
// sum as stored; x and residual are only read. residual_out: residual's shape and dtype. y: x's
// shape and dtype. y, residual_out and rstd (optional) disjoint from every other argument.
void fused_add_rmsnorm_forward(const TensorView& x, const TensorView& residual,
                               const TensorView& weight, TensorView y, TensorView residual_out,
                               TensorView rstd, const RMSNormOptions& options = {},
                               cudaStream_t stream = nullptr);

// dy: gradient w.r.t. the normalized output (x after the forward pass), x's dtype.
// residual: the saved sum (residual after the forward pass). d_residual: gradient w.r.t. the
// residual output, residual's shape and dtype, or absent. dx: the gradient for both inputs x
// and residual, dx = rmsnorm_backward(dy) + d_residual; like dy, may be exactly dy's view.
// rstd, dw, workspace as in rmsnorm_backward.
void fused_add_rmsnorm_backward(const TensorView& dy, const TensorView& d_residual,
                                const TensorView& residual, const TensorView& weight,
                                const TensorView& rstd, TensorView dx, TensorView dw,
                                TensorView workspace, const RMSNormOptions& options = {},
                                cudaStream_t stream = nullptr);

// mean = mean(x), rstd = 1 / sqrt(mean((x - mean)^2) + eps) (biased variance),
// y = (x - mean) * rstd * w + b. weight, bias optional; mean, rstd optional outputs.
// y: x's shape and dtype, its own row stride, disjoint from x.
void layernorm_forward(const TensorView& x, const TensorView& weight, const TensorView& bias,
                       TensorView y, TensorView mean, TensorView rstd,
                       const LayerNormOptions& options = {}, cudaStream_t stream = nullptr);

// The tensors of layernorm_backward, named at the call so that none can be swapped:
//   layernorm_backward({.dy = dy, .x = x, .weight = w, .mean = mean, .rstd = rstd, .dx = dx,
//                       .dw = dw, .workspace = ws}, options, stream);
struct LayerNormBackwardArgs {
  TensorView dy;
  TensorView x;
  TensorView weight;  // optional
  TensorView mean;    // as saved by layernorm_forward (required)
  TensorView rstd;    // likewise
  TensorView dx;      // like x; may be exactly dy's view
  TensorView dw;      // like weight, required iff weight is given
  TensorView db;      // like a bias, optional (the bias is no input of the backward pass)
  TensorView workspace;  // as in rmsnorm_backward
};
void layernorm_backward(const LayerNormBackwardArgs& args, const LayerNormOptions& options = {},
                        cudaStream_t stream = nullptr);

// Bytes of scratch the CUDA backward passes need for `rows` x `cols` inputs of `dtype` (the
// weight- and bias-gradient partial sums, one row per block); 0 on the CPU. Pass at least this
// much, 16-byte aligned, as `workspace` (any dtype; its size in bytes is what counts).
std::size_t norm_backward_workspace_bytes(std::int64_t rows, std::int64_t cols, DType dtype,
                                          Device device);

}  // namespace trainscale
