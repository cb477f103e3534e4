// Between the Newton-Schulz family's entry points (newton_schulz.cc), its CPU reference
// (newton_schulz_cpu.cc) and its CUDA kernels (newton_schulz.cu). Arguments arrive validated.
#pragma once

#include <algorithm>
#include <cmath>
#include <span>

#include "core/check.h"
#include "trainscale/newton_schulz.h"

namespace trainscale::ops::newton_schulz {

// lr's factor s for the update of an R x C parameter.
inline double lr_factor(MuonLrAdjust adjust, std::int64_t rows, std::int64_t cols) {
  const auto r = static_cast<double>(rows), c = static_cast<double>(cols);
  switch (adjust) {
    case MuonLrAdjust::kMatchRmsAdamW: return 0.2 * std::sqrt(std::max(r, c));
    case MuonLrAdjust::kSpectralUnclamped: return std::sqrt(r / c);
    case MuonLrAdjust::kOriginal: break;
  }
  return std::sqrt(std::max(1.0, r / c));
}

// g and out: a matrix or a batch of them, as newton_schulz takes them.
void newton_schulz_cpu(const TensorView& g, TensorView out, const NewtonSchulzOptions& options);
void muon_step_cpu(TensorView param, const TensorView& grad, TensorView momentum_buffer,
                   const MuonOptions& options);

// Blocks per side into which the CUDA path splits the symmetric Gram products A = X X^T and
// A A (p x p, p = min(R, C)): it computes only the k (k + 1) / 2 blocks of the lower block
// triangle and mirrors them into the upper, (k - 1) / (2 k) of those products' FLOPs saved. 1:
// dense products. The largest of 1, 2, 4 whose blocks keep at least 2048 rows (smaller blocks
// leave a block product's grid near one wave) and a multiple of 32. A function of p alone, so
// each matrix of a batch gets the bits of a call on it alone.
inline int gram_blocks(std::int64_t p) {
  int k = 1;
  while (k < 4 && p % (2 * k * 32) == 0 && p / (2 * k) >= 2048) k *= 2;
  return k;
}

// newton_schulz.cu: workspace of at least the bytes the *_workspace_bytes_cuda functions give
// (checked there). count: matrices of rows x cols. gram_blocks: as the function above gives
// for p (another k that divides p into blocks of a multiple of 32 rows runs too, for tests).
std::size_t newton_schulz_workspace_bytes_cuda(std::int64_t count, std::int64_t rows, std::int64_t cols,
                                               DType dtype);
void newton_schulz_cuda(const TensorView& g, TensorView out, const NewtonSchulzOptions& options,
                        const TensorView& workspace, cudaStream_t stream, int gram_blocks);
std::size_t muon_step_workspace_bytes_cuda(std::int64_t count, std::int64_t rows, std::int64_t cols,
                                           DType dtype);
void muon_step_cuda(std::span<const TensorView> params, std::span<const TensorView> grads,
                    std::span<const TensorView> momentum_buffers, const MuonOptions& options,
                    const TensorView& workspace, cudaStream_t stream);

}  // namespace trainscale::ops::newton_schulz
