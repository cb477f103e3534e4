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

// The tile triangle's tiles: kGramTriangleTile x kGramTriangleTile.
inline constexpr std::int64_t kGramTriangleTile = 128;

// The tile triangle's schedule: the lower triangle (n <= m) of a t x t tile grid, t even,
// folded into a t / 2 x (t + 1) rectangle whose row r holds tile row t - 1 - r (t - r tiles)
// and then tile row r (r + 1 tiles). Returns (m, n) of rectangle cell (r, c).
struct TileMN {
  std::int64_t m, n;
};
#if defined(__CUDACC__)
__host__ __device__
#endif
inline constexpr TileMN folded_triangle_tile(std::int64_t r, std::int64_t c, std::int64_t t) {
  return c < t - r ? TileMN{t - 1 - r, c} : TileMN{r, c - (t - r)};
}

// gram_triangle.cu: the lower triangle of tiles of
//   out = alpha rows @ rows^T + beta addend
// for `count` bf16 matrices in one CUTLASS launch, each diagonal tile whole; the caller mirrors
// the tiles above. rows [p, k] row-major (ld k), matrix n rows_stride elements on; out and
// addend [p, p] (ld p), out_stride apart; addend null: beta 0. Only where gram_triangle_applies:
// bf16, p a multiple of two tiles, k of 8, a compute capability 9.0 device and an sm_90a build.
bool gram_triangle_applies(DType dtype, std::int64_t p, std::int64_t k);
void gram_triangle_bf16(const char* op, const void* rows, std::int64_t rows_stride, std::int64_t p, std::int64_t k,
                        void* out, const void* addend, std::int64_t out_stride, float alpha, float beta,
                        std::int64_t count, cudaStream_t stream);

// newton_schulz_cuda's gram_split for the tile triangle (where gram_triangle_applies; else
// gram_blocks(p)). Measured no faster than the blocks (docs/perf/newton_schulz.md), so only the
// bench and tests ask for it.
inline constexpr int kGramTriangle = 0;

// newton_schulz.cu: workspace of at least the bytes the *_workspace_bytes_cuda functions give
// (checked there). count: matrices of rows x cols. gram_split: as gram_blocks gives for p
// (kGramTriangle, or another k that divides p into blocks of a multiple of 32 rows, runs too,
// for tests and the bench).
std::size_t newton_schulz_workspace_bytes_cuda(std::int64_t count, std::int64_t rows, std::int64_t cols,
                                               DType dtype);
void newton_schulz_cuda(const TensorView& g, TensorView out, const NewtonSchulzOptions& options,
                        const TensorView& workspace, cudaStream_t stream, int gram_split);
std::size_t muon_step_workspace_bytes_cuda(std::int64_t count, std::int64_t rows, std::int64_t cols,
                                           DType dtype);
void muon_step_cuda(std::span<const TensorView> params, std::span<const TensorView> grads,
                    std::span<const TensorView> momentum_buffers, const MuonOptions& options,
                    const TensorView& workspace, cudaStream_t stream);

}  // namespace trainscale::ops::newton_schulz
