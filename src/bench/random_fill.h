// Counter-based random inputs: element i of a tensor is a pure function of (tensor seed, i),
// so the host and the device produce the same values without sharing state, and the host can
// make any rows it needs (a sample, a prefix) without making the rest. Compiled by the host
// compiler and by nvcc: one definition of the values for the host fill and the CUDA fill.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "trainscale/tensor.h"

#if defined(__CUDACC__)
#define TRAINSCALE_BENCH_HD __host__ __device__
#else
#define TRAINSCALE_BENCH_HD
#endif

namespace trainscale::bench {

TRAINSCALE_BENCH_HD inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// What a tensor's values are drawn from: uniform in [lo, hi] (integers: over [lo, hi]),
// exactly representable in `dtype`.
struct RandomFill {
  std::uint64_t key = 0;  // the tensor's seed, hashed once
  double lo = -1.0, hi = 1.0;
  DType dtype = DType::kFloat32;
  // Integers only: this share of the elements (drawn per index like the values) holds
  // `special` instead, e.g. cross-entropy's ignore_index among the targets.
  double special_share = 0.0;
  std::int64_t special = 0;

  RandomFill() = default;
  RandomFill(std::uint64_t seed, double lo_, double hi_, DType dtype_)
      : key(splitmix64(seed)), lo(lo_), hi(hi_), dtype(dtype_) {}
};

// v rounded to nearest even onto the grid of a float format with `man_bits` mantissa bits and
// smallest normal 2^min_exp, clamped to +-max_finite. Exact scalings by powers of two around
// one rintf, so it rounds alike on the host and the device.
TRAINSCALE_BENCH_HD inline float round_to_format(float v, int man_bits, int min_exp, float max_finite) {
  if (v == 0.0f) return v;
  int e = 0;
  frexpf(fabsf(v), &e);  // |v| in [2^(e-1), 2^e)
  const int quantum_exp = (e - 1 > min_exp ? e - 1 : min_exp) - man_bits;
  const float r = ldexpf(rintf(ldexpf(v, -quantum_exp)), quantum_exp);
  return fminf(fmaxf(r, -max_finite), max_finite);
}

// Element `index` of the tensor `fill` describes, already rounded to fill.dtype (fp8
// saturating), so storing it in that dtype, or converting it to a wider one, is exact.
TRAINSCALE_BENCH_HD inline double random_value(const RandomFill& fill, std::int64_t index) {
  const std::uint64_t bits = splitmix64(fill.key + static_cast<std::uint64_t>(index) * 0x9E3779B97F4A7C15ull);
  if (fill.dtype == DType::kInt32 || fill.dtype == DType::kInt64) {
    if (static_cast<double>(bits >> 40) * 0x1p-24 < fill.special_share) return static_cast<double>(fill.special);
    const auto lo = static_cast<std::int64_t>(fill.lo);
    const auto span = static_cast<std::uint64_t>(static_cast<std::int64_t>(fill.hi) - lo) + 1;
    return static_cast<double>(lo + static_cast<std::int64_t>(bits % span));
  }
  // float32 on a 2^-24 grid of [lo, hi]; fmaf rounds once, the same everywhere.
  const float lo = static_cast<float>(fill.lo);
  const float u = static_cast<float>(bits >> 40) * 0x1p-24f;
  const float v = fmaf(static_cast<float>(fill.hi) - lo, u, lo);
  switch (fill.dtype) {
    case DType::kBFloat16: return round_to_format(v, 7, -126, FLT_MAX);
    case DType::kFloat16: return round_to_format(v, 10, -14, 65504.0f);
    case DType::kFloat8E4M3: return round_to_format(v, 3, -6, 448.0f);
    case DType::kFloat8E5M2: return round_to_format(v, 2, -14, 57344.0f);
    default: return v;  // float32, float64
  }
}

}  // namespace trainscale::bench
