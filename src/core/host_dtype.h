// Bit-exact host conversions between double and every storage dtype: round to nearest
// even, IEEE subnormals, and (for fp8) saturation to the largest finite value.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "trainscale/tensor.h"

namespace trainscale::detail {

enum class Overflow { kToInfinity, kSaturate };

// Narrow float with `kExpBits` exponent and `kManBits` mantissa bits, stored in the low
// bits of a uint32_t. kFnuz-style formats are not needed; E4M3 is the "fn" variant: no
// infinities, NaN = all ones, largest finite 448.
template <int kExpBits, int kManBits, bool kHasInfinity>
struct NarrowFloat {
  static constexpr int kBias = (1 << (kExpBits - 1)) - 1;
  static constexpr std::uint32_t kSignBit = 1u << (kExpBits + kManBits);
  static constexpr std::uint32_t kExpMask = ((1u << kExpBits) - 1) << kManBits;
  static constexpr std::uint32_t kManMask = (1u << kManBits) - 1;
  // Largest finite magnitude code.
  static constexpr std::uint32_t kMaxFinite = kHasInfinity ? (kExpMask - (1u << kManBits)) | kManMask
                                                           : kExpMask | (kManMask - 1);
  static constexpr std::uint32_t kInfinity = kExpMask;
  static constexpr std::uint32_t kNaN = kHasInfinity ? kExpMask | (1u << (kManBits - 1))
                                                     : kExpMask | kManMask;

  static double decode(std::uint32_t bits) {
    const bool negative = bits & kSignBit;
    const std::uint32_t e = (bits & kExpMask) >> kManBits;
    const std::uint32_t m = bits & kManMask;
    double v;
    if (kHasInfinity && e == (kExpMask >> kManBits)) {
      v = m ? std::nan("") : INFINITY;
    } else if (!kHasInfinity && (bits & ~kSignBit) == (kExpMask | kManMask)) {
      v = std::nan("");
    } else if (e == 0) {
      v = std::ldexp(static_cast<double>(m), 1 - kBias - kManBits);
    } else {
      v = std::ldexp(static_cast<double>(m | (1u << kManBits)), static_cast<int>(e) - kBias - kManBits);
    }
    return negative ? -v : v;
  }

  static constexpr std::uint32_t overflow_code(Overflow overflow) {
    if (overflow == Overflow::kSaturate) return kMaxFinite;
    return kHasInfinity ? kInfinity : kNaN;
  }

  static std::uint32_t encode(double v, Overflow overflow) {
    if (std::isnan(v)) return kNaN;
    const std::uint32_t sign = std::signbit(v) ? kSignBit : 0u;
    double a = std::fabs(v);
    if (std::isinf(a)) return sign | overflow_code(overflow);
    if (a == 0.0) return sign;
    int exp2;
    std::frexp(a, &exp2);  // a = f * 2^exp2, f in [0.5, 1)
    int e = exp2 - 1;      // a in [2^e, 2^(e+1))
    constexpr int kMinNormalExp = 1 - kBias;
    // Quantum of the destination's grid near a; subnormals share the smallest one.
    const int quantum_exp = (e < kMinNormalExp ? kMinNormalExp : e) - kManBits;
    // Exact: scaling by a power of two; nearbyint rounds half to even.
    const double q = std::nearbyint(std::ldexp(a, -quantum_exp));
    std::uint64_t code;
    if (e < kMinNormalExp) {
      code = static_cast<std::uint64_t>(q);  // q == 2^kManBits lands on the smallest normal
    } else {
      std::uint64_t mant = static_cast<std::uint64_t>(q);
      if (mant == (2ull << kManBits)) {  // rounded up to the next binade
        mant >>= 1;
        ++e;
      }
      const std::int64_t biased = static_cast<std::int64_t>(e) + kBias;
      code = (static_cast<std::uint64_t>(biased) << kManBits) | (mant & kManMask);
    }
    if (code > kMaxFinite) return sign | overflow_code(overflow);
    return sign | static_cast<std::uint32_t>(code);
  }
};

using Float16Format = NarrowFloat<5, 10, true>;
using BFloat16Format = NarrowFloat<8, 7, true>;
using Float8E4M3Format = NarrowFloat<4, 3, false>;
using Float8E5M2Format = NarrowFloat<5, 2, true>;

// The fast paths below are exact: bf16 is the top half of a float, fp16 has 65536 values,
// and a value that is exactly a float rounds to bf16 once from its bits.
inline double bf16_to_double(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline double half_to_double(std::uint16_t b) {
  static const std::vector<float> table = [] {
    std::vector<float> t(1u << 16);
    for (std::uint32_t i = 0; i < t.size(); ++i) t[i] = static_cast<float>(Float16Format::decode(i));
    return t;
  }();
  return table[b];
}
inline std::uint16_t double_to_half(double v) {
  return static_cast<std::uint16_t>(Float16Format::encode(v, Overflow::kToInfinity));
}
inline std::uint16_t double_to_bf16(double v) {
  const float f = static_cast<float>(v);
  if (static_cast<double>(f) == v) {  // false for NaN, which takes the general path
    std::uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  return static_cast<std::uint16_t>(BFloat16Format::encode(v, Overflow::kToInfinity));
}
// fp8 casts as the contract's saturate_rn: finite overflow and +-Inf clamp to +-max, NaN stays NaN.
inline std::uint8_t double_to_e4m3(double v) {
  return static_cast<std::uint8_t>(Float8E4M3Format::encode(v, Overflow::kSaturate));
}
inline std::uint8_t double_to_e5m2(double v) {
  return static_cast<std::uint8_t>(Float8E5M2Format::encode(v, Overflow::kSaturate));
}
inline double e4m3_to_double(std::uint8_t b) { return Float8E4M3Format::decode(b); }
inline double e5m2_to_double(std::uint8_t b) { return Float8E5M2Format::decode(b); }

// Element access by runtime dtype; `index` is in elements from `base`.
inline double load_as_double(DType dtype, const void* base, std::int64_t index) {
  switch (dtype) {
    case DType::kFloat64: return static_cast<const double*>(base)[index];
    case DType::kFloat32: return static_cast<const float*>(base)[index];
    case DType::kFloat16: return half_to_double(static_cast<const std::uint16_t*>(base)[index]);
    case DType::kBFloat16: return bf16_to_double(static_cast<const std::uint16_t*>(base)[index]);
    case DType::kFloat8E4M3: return e4m3_to_double(static_cast<const std::uint8_t*>(base)[index]);
    case DType::kFloat8E5M2: return e5m2_to_double(static_cast<const std::uint8_t*>(base)[index]);
    case DType::kInt32: return static_cast<const std::int32_t*>(base)[index];
    case DType::kInt64: return static_cast<double>(static_cast<const std::int64_t*>(base)[index]);
  }
  return 0.0;
}

// Rounds once, from double, to the destination dtype (fp8 saturates).
inline void store_from_double(DType dtype, void* base, std::int64_t index, double v) {
  switch (dtype) {
    case DType::kFloat64: static_cast<double*>(base)[index] = v; return;
    case DType::kFloat32: static_cast<float*>(base)[index] = static_cast<float>(v); return;
    case DType::kFloat16: static_cast<std::uint16_t*>(base)[index] = double_to_half(v); return;
    case DType::kBFloat16: static_cast<std::uint16_t*>(base)[index] = double_to_bf16(v); return;
    case DType::kFloat8E4M3: static_cast<std::uint8_t*>(base)[index] = double_to_e4m3(v); return;
    case DType::kFloat8E5M2: static_cast<std::uint8_t*>(base)[index] = double_to_e5m2(v); return;
    case DType::kInt32: static_cast<std::int32_t*>(base)[index] = static_cast<std::int32_t>(v); return;
    case DType::kInt64: static_cast<std::int64_t*>(base)[index] = static_cast<std::int64_t>(v); return;
  }
}

inline std::int64_t load_index(DType dtype, const void* base, std::int64_t index) {
  return dtype == DType::kInt32 ? static_cast<const std::int32_t*>(base)[index]
                                : static_cast<const std::int64_t*>(base)[index];
}

// The value a double takes once stored in `dtype` (what a kernel's output can hold).
inline double round_to(DType dtype, double v) {
  unsigned char buf[8];
  store_from_double(dtype, buf, 0, v);
  return load_as_double(dtype, buf, 0);
}

}  // namespace trainscale::detail
