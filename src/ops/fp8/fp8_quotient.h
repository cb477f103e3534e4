// q = x / s, the fp8 contract's float32 quotient, without a division per element: shared by the
// CUDA kernels (fp8_quantize_device.cuh) and the tests that prove it equal to the division (fp8_test.cc).
//
// Markstein's correction. With r = RN(1/s) once per group:
//   y = RN(x * r);  d = RN(y * s - x);  q = RN(y - d * r)   (a multiply and two FMAs)
// Markstein's theorem (Muller et al., Handbook of Floating-Point Arithmetic, division with an FMA)
// gives q == RN(x / s) when y is faithful, r = RN(1/s) and nothing under- or overflows. But
// RN(x * r) is not always faithful (up to 1.5 ulps off when x < s), so the tests prove the
// sequence directly: for x, s in [1, 2), y - d * r before its rounding is within 5 * 2^-48 of
// x / s, so q != RN(x / s) needs x / s that close to a rounding midpoint; that leaves a few x per
// scale significand, and all of them, for all 2^23 significands, give the division's bits
// (fp8_test.cc, Fp8Quotient.ExactNearEveryRoundingMidpointForEveryScaleSignificand).
//
// Other exponents, for s in [kMinReciprocalScale, kMaxReciprocalScale] and |x / s| <= 2^64:
//  - |x / s| >= 2^-19: x, r, y and q are normal, and d is normal or an exact subnormal (its exact
//    value is a multiple of 2^-149), so this is the [1, 2) case scaled: q == RN(x / s).
//  - |x / s| < 2^-19: q may differ from RN(x / s) in float32 (subnormal steps), but both keep the
//    sign of x and stay below 2^-17, so both cast to the same signed fp8 zero (the smallest fp8
//    subnormal is 2^-16). Zeros keep their sign: d = y*s - x, not x - y*s, gives q = -0 for -0.
// Outside that range (tiny, infinite or NaN scales) the kernels divide.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define TRAINSCALE_FP8_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TRAINSCALE_FP8_HOST_DEVICE inline
#endif

namespace trainscale::ops::fp8 {

// Below 2^-80 the remainder d of an element that still matters to fp8 can be an inexact
// subnormal; above 2^125 r = RN(1/s) is subnormal.
inline constexpr float kMinReciprocalScale = 0x1p-80f;
inline constexpr float kMaxReciprocalScale = 0x1p125f;

// False for NaN too.
TRAINSCALE_FP8_HOST_DEVICE bool reciprocal_quotient_is_exact(float s) {
  return s >= kMinReciprocalScale && s <= kMaxReciprocalScale;
}

// RN(1/s), correctly rounded.
TRAINSCALE_FP8_HOST_DEVICE float nearest_reciprocal(float s) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(s);
#else
  return 1.0f / s;
#endif
}

// RN(x / s) in the sense above, given r = nearest_reciprocal(s).
TRAINSCALE_FP8_HOST_DEVICE float reciprocal_quotient(float x, float s, float r) {
#if defined(__CUDA_ARCH__)
  const float y = __fmul_rn(x, r);
  const float d = __fmaf_rn(y, s, -x);
  return __fmaf_rn(-d, r, y);
#else
  const float y = x * r;
  const float d = std::fma(y, s, -x);
  return std::fma(-d, r, y);
#endif
}

}  // namespace trainscale::ops::fp8
