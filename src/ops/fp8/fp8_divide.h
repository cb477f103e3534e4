// The fp8 code of x / s (saturate_rn of the float32 quotient, as include/trainscale/fp8.h fixes
// it) without a float32 division per element, bit for bit. Shared by the CUDA kernels and the
// CPU test that checks it (fp8_test.cc), so both run this very code, down to the packing of
// codes into words; `Codec` supplies the fp8 cast: on the GPU the cvt instruction
// (fp8.cu's DeviceCodec), on the CPU the reference codec packed in the cvt's byte order
// (fp8_test.cc's HostCodec). A Codec has
//   encode(v)                 the code of one float (the saturating round-to-nearest-even cast)
//   decode(c)                 the value of a code, as a float (exact)
//   encode4(v0, v1, v2, v3)   the codes of four floats as one word, code k in byte k, built as
//                             cvt.rn.satfinite.<fmt>x2.f32 twice (d, a, b: a's code in d's upper
//                             byte, b's in the lower): lo16 = x2(v1, v0), hi16 = x2(v3, v2).
//
// Per group, once: bounds lo <= 1/s <= hi (real numbers) from r = RN(1/s):
//   s a normal power of two   lo = hi = 1/s, exact: x * lo is then the same real number as
//                             x / s, rounded once, so it IS the quotient, subnormal or not.
//   2^-64 <= s < 2^64         lo = RN(r (1 - 2^-22)), hi = RN(r (1 + 2^-22)): r is within
//                             2^-24 of 1/s (relative), so lo < 1/s < hi.
//   otherwise (s tiny, huge,  lo = 0, hi = Inf: the codes below never agree for a number x
//   Inf or NaN)               (0 vs +-fmax, or NaN), so every element takes the division.
// Per element: a = cast(RN(x lo)), b = cast(RN(x hi)). RN and the saturating cast are monotone
// and keep the sign, and |x lo| <= |x / s| <= |x hi|, so the quotient RN(x / s) lies between
// RN(x lo) and RN(x hi): when a == b it is the quotient's code too (NaN x: both NaN).
// When a != b (about 0.3% of elements: x / s is often within a few float32 ulps of an fp8
// midpoint, say x = amax * 3/4 gives fmax * 3/4), the interval holds exactly one rounding
// boundary m = (a + b) / 2 (it is 2^-21 wide; boundaries are >= 2^-5 apart), and `resolve` finds
// which side of m the float32 quotient lands on with an exact fma remainder.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TRAINSCALE_FP8_HD __host__ __device__ __forceinline__
#else
#define TRAINSCALE_FP8_HD inline
#endif
#if defined(__CUDA_ARCH__)
#define TRAINSCALE_FP8_UNROLL _Pragma("unroll")
#else
#define TRAINSCALE_FP8_UNROLL
#endif

namespace trainscale::ops::fp8 {

TRAINSCALE_FP8_HD std::uint32_t float_bits(float v) {
  std::uint32_t b;
  memcpy(&b, &v, sizeof b);
  return b;
}

TRAINSCALE_FP8_HD float bits_float(std::uint32_t b) {
  float v;
  memcpy(&v, &b, sizeof v);
  return v;
}

struct Fp8Divisor {
  float s;       // the scale
  float lo, hi;  // lo <= 1/s <= hi; lo == hi: exact reciprocal; lo == 0: always divide
};

TRAINSCALE_FP8_HD Fp8Divisor make_divisor(float s) {
  const std::uint32_t b = float_bits(s);
  const std::uint32_t exponent = b >> 23;  // a sign bit (s < 0 never happens) lands out of range
#if defined(__CUDA_ARCH__)
  const float r = __frcp_rn(s);
#else
  const float r = 1.0f / s;
#endif
  if ((b & 0x7fffffu) == 0 && exponent >= 1 && exponent <= 254) return {s, r, r};
  // 2^-64 <= s < 2^64 also keeps every product in `resolve` clear of underflow and overflow.
  if (exponent >= 127 - 64 && exponent < 127 + 64) {
    return {s, r * (1.0f - 0x1p-22f), r * (1.0f + 0x1p-22f)};
  }
  return {s, 0.0f, INFINITY};
}

TRAINSCALE_FP8_HD float exact_quotient(float x, float s) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(x, s);
#else
  return x / s;
#endif
}

// The code of x / s given a = cast(x * d.lo) != b = cast(x * d.hi).
//
// With finite bounds the codes are neighbours (same sign) and m = (a + b) / 2, exact, is the
// one rounding boundary between them. It has at most 5 significant bits, so in float32 it is
// even (ties go to it) and, unless |m| is a power of two (only the boundary between 0 and the
// smallest fp8 subnormal), its neighbours are m +- 2h with h half its ulp. The float32
// quotient is m exactly when |x / s - m| <= h, i.e. |x - m s| <= h s; both sides are exact:
// x is within 2^-20 of m s (relative), m s has at most 29 significant bits, so x - m s fits
// in 24 bits, and h s is a power-of-two multiple of s (2^-64 <= s < 2^64 keeps both normal).
// Otherwise the quotient is past m on the side of the remainder's sign, and m +- 2h, also
// between m and the quotient, has the same code. Anything else takes the division.
template <class Codec>
TRAINSCALE_FP8_HD std::uint8_t resolve(float x, const Fp8Divisor& d, std::uint8_t a,
                                       std::uint8_t b) {
  if (d.lo != 0.0f) {
    const float m = (Codec::decode(a) + Codec::decode(b)) * 0.5f;
    const std::uint32_t mb = float_bits(m);
    if ((mb & 0x7fffffu) != 0) {
      const float h = bits_float((mb & 0x7f800000u) - (24u << 23));
      const float rem = fmaf(-m, d.s, x);
      const float q = fabsf(rem) <= h * d.s ? m : m + copysignf(2.0f * h, rem);
      return Codec::encode(q);
    }
  }
  return Codec::encode(exact_quotient(x, d.s));
}

TRAINSCALE_FP8_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// One element.
template <class Codec>
TRAINSCALE_FP8_HD std::uint8_t quantize_one(float x, const Fp8Divisor& d) {
  const std::uint8_t a = Codec::encode(mul_rn(x, d.lo)), b = Codec::encode(mul_rn(x, d.hi));
  return a == b ? b : resolve<Codec>(x, d, a, b);
}

// Eight codes as the kernels store them (8 bytes, little endian): code k in byte k % 4 of word
// k / 4, x holding codes 0..3 and y codes 4..7.
struct Codes8 {
  std::uint32_t x, y;
};

// Eight elements sharing divisor d, as every kernel quantizes (fp8.cu): the words of the casts
// of x * d.lo and of x * d.hi, equal except near an fp8 rounding boundary; there each byte that
// differs goes through `resolve` and replaces its byte of the hi word.
//
// The codes stay in 32-bit words from the cast on (Codec::encode4 is one opaque asm on the GPU).
// With 16-bit packed casts instead (__nv_cvt_float2_to_fp8x2 per pair, then lo | hi << 16),
// NVVM read the bytes of this loop straight from the 16-bit cast results, and ptxas (CUDA 13.0,
// sm_90a, -O1 and up), having fused the pairs into F2FP.PACK_AB_MERGE_C, read those 16-bit
// values from R1 (the stack pointer) in the slow branch: bytes of the lo words were garbage
// there, and the GPU wrote wrong codes (half or twice the value, NaN, other signs) in the chunks
// that took the branch. Only the GPU test and the SASS show that class of fault: check
// `cuobjdump -sass` of fp8.cu.o for PRMT reading R1 after changing this code.
template <class Codec>
TRAINSCALE_FP8_HD Codes8 quantize8(const float (&v)[8], const Fp8Divisor& d) {
  float pl[8], ph[8];
  TRAINSCALE_FP8_UNROLL
  for (int k = 0; k < 8; ++k) {
    pl[k] = mul_rn(v[k], d.lo);
    ph[k] = mul_rn(v[k], d.hi);
  }
  const Codes8 a{Codec::encode4(pl[0], pl[1], pl[2], pl[3]),
                 Codec::encode4(pl[4], pl[5], pl[6], pl[7])};
  Codes8 b{Codec::encode4(ph[0], ph[1], ph[2], ph[3]), Codec::encode4(ph[4], ph[5], ph[6], ph[7])};
  if (__builtin_expect(a.x != b.x || a.y != b.y, 0)) {
    TRAINSCALE_FP8_UNROLL
    for (int k = 0; k < 8; ++k) {
      const std::uint32_t wa = k < 4 ? a.x : a.y, shift = 8 * (k & 3);
      std::uint32_t& wb = k < 4 ? b.x : b.y;
      const std::uint32_t ca = (wa >> shift) & 0xffu, cb = (wb >> shift) & 0xffu;
      if (ca != cb) {
        const std::uint32_t c = resolve<Codec>(v[k], d, static_cast<std::uint8_t>(ca),
                                               static_cast<std::uint8_t>(cb));
        wb = (wb & ~(0xffu << shift)) | (c << shift);
      }
    }
  }
  return b;
}

}  // namespace trainscale::ops::fp8
