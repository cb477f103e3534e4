// FP8 quantization for GEMM operands: per-tensor, per-row, 1x128-tile and 128x128-block scales,
// optional transposed copy for the weight-gradient GEMM, and the matching dequantization.
#pragma once

#include "trainscale/tensor.h"

namespace trainscale {

// How elements share a scale. Tiles and blocks at the right / bottom edge are partial when N
// (or M) is not a multiple of 128.
enum class Fp8Granularity {
  kTensor,        // one scale for the whole tensor
  kRow,           // one scale per row
  kTile1x128,     // one scale per 1x128 run of a row (activations, DeepSeek-V3 style)
  kBlock128x128,  // one scale per 128x128 block (weights)
};
const char* fp8_granularity_name(Fp8Granularity granularity);

struct Fp8QuantizeOptions {
  Fp8Granularity granularity = Fp8Granularity::kRow;
  // s = 2^ceil(log2(amax / fmax)) instead of amax / fmax, so scaling is exact in the exponent.
  bool power_of_two_scales = false;
  // kTile1x128 only: scales stored transposed, [ceil(N/128), align4(M)], element (t, i) is row
  // i's tile t; M is padded to a multiple of 4 as DeepGEMM expects and the padding entries
  // (i >= M) are written as 0. Default (false): row-major [M, ceil(N/128)].
  bool scales_m_major = false;
};

// Quantizes x to fp8 with one float32 dequantization scale per group; q's dtype
// (float8_e4m3, fmax 448, or float8_e5m2, fmax 57344) picks the format.
//
// Arithmetic (float32, round to nearest even, IEEE subnormals; a kernel must match it bit for bit):
//   amax = max |x| over the group (x read exactly as float)
//   r    = amax / fmax                                  one float32 division
//   s    = r == 0 ? 1                                   amax == 0 (or so small that r underflows)
//        : power_of_two_scales ? 2^ceil(log2 r)         exact (r itself when r is a power of two)
//        : r
//   q    = saturate_rn(x / s)                           one float32 division, then the cast:
//                                                       overflow, +-Inf clamp to +-fmax; NaN stays
// Non-finite inputs follow float32: a NaN in a group makes amax, s and every q of that group NaN;
// an +-Inf (and no NaN) makes s = Inf, the group's finite elements quantize to +-0 and its
// infinities to NaN (Inf / Inf), so dequantizing that group gives NaN throughout (0 * Inf).
// Other groups are unaffected.
//
// x: float32 / float16 / bfloat16 [M, N], rows contiguous (any row stride).
// q: [M, N], float8_e4m3 or float8_e5m2, rows contiguous (its own row stride).
// scales: float32, contiguous: kTensor [1]; kRow [M]; kTile1x128 [M, ceil(N/128)] (or
//   [ceil(N/128), align4(M)] when scales_m_major); kBlock128x128 [ceil(M/128), ceil(N/128)].
// q_t, scales_t: optional (both or neither) transposed copy: q_t [N, M] (q's dtype, own row
//   stride) and scales_t are exactly what this function gives for x^T with the same options:
//   kTensor: the same scale; kRow: one scale per column of x, [N]; kTile1x128: 128x1 tiles of
//   x, [N, ceil(M/128)] (or [ceil(M/128), align4(N)] when scales_m_major); kBlock128x128: the
//   transpose of scales, [ceil(N/128), ceil(M/128)].
// No output may overlap x or another output. M = 0 and N = 0 are valid.
void fp8_quantize(const TensorView& x, TensorView q, TensorView scales, TensorView q_t,
                  TensorView scales_t, const Fp8QuantizeOptions& options = {},
                  cudaStream_t stream = nullptr);

// y = float(q) * s per group (one float32 multiply), rounded once to y's dtype. q and scales are
// laid out as fp8_quantize writes them for `options` (power_of_two_scales is ignored); pass
// q_t / scales_t with the same options to dequantize the transposed copy.
// q: [M, N] float8_e4m3 / float8_e5m2; y: [M, N] float32 / float16 / bfloat16, not overlapping
// q or scales. Rows contiguous, any row stride.
void fp8_dequantize(const TensorView& q, const TensorView& scales, TensorView y,
                    const Fp8QuantizeOptions& options = {}, cudaStream_t stream = nullptr);

}  // namespace trainscale
