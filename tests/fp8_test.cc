#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/host_dtype.h"
#include "core/parallel.h"
#include "ops/fp8/fp8_quotient.h"
#include "trainscale/fp8.h"
#include "util/gpu_util.h"
#include "util/test_util.h"

namespace trainscale {
namespace {

using test::HostTensor;

constexpr DType kInputTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
constexpr DType kFp8Types[] = {DType::kFloat8E4M3, DType::kFloat8E5M2};
constexpr Fp8Granularity kGranularities[] = {Fp8Granularity::kTensor, Fp8Granularity::kRow,
                                             Fp8Granularity::kTile1x128,
                                             Fp8Granularity::kBlock128x128};
constexpr std::uint8_t kPoisonByte = 0xFF;  // what HostTensor fills fresh storage with

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }
std::int64_t align4(std::int64_t n) { return ceil_div(n, 4) * 4; }
float fp8_max(DType fp8) { return fp8 == DType::kFloat8E4M3 ? 448.0f : 57344.0f; }
float pow2f(int e) { return std::ldexp(1.0f, e); }

std::uint8_t encode(DType fp8, float v) {
  return fp8 == DType::kFloat8E4M3 ? detail::double_to_e4m3(v) : detail::double_to_e5m2(v);
}
float decode(DType fp8, std::uint8_t code) {
  return static_cast<float>(fp8 == DType::kFloat8E4M3 ? detail::e4m3_to_double(code)
                                                      : detail::e5m2_to_double(code));
}

std::vector<Fp8QuantizeOptions> every_layout(bool power_of_two) {
  std::vector<Fp8QuantizeOptions> layouts;
  for (Fp8Granularity g : kGranularities) layouts.push_back({g, power_of_two, false});
  layouts.push_back({Fp8Granularity::kTile1x128, power_of_two, true});
  return layouts;
}

std::string describe(const Fp8QuantizeOptions& o, DType fp8, DType input) {
  return std::string(fp8_granularity_name(o.granularity)) + (o.scales_m_major ? " m-major" : "") +
         (o.power_of_two_scales ? " pow2" : "") + " " + dtype_name(fp8) + " from " +
         dtype_name(input);
}

// --- An independent restatement of the contract: one group (a rectangle of x) at a time. ---

// Smallest power of two >= r, by doubling and halving (not frexp, as the reference does).
float power_of_two_at_least(float r) {
  float s = 1.0f;
  while (s < r) s *= 2.0f;
  while (s * 0.5f >= r) s *= 0.5f;
  return s;
}

// The contract's dequant scale for a group's amax.
float contract_scale(float amax, float fmax, bool power_of_two) {
  const float r = amax / fmax;
  if (r == 0.0f) return 1.0f;
  return power_of_two && std::isfinite(r) ? power_of_two_at_least(r) : r;
}

std::pair<std::int64_t, std::int64_t> group_of(Fp8Granularity g, std::int64_t i, std::int64_t j) {
  switch (g) {
    case Fp8Granularity::kTensor: return {0, 0};
    case Fp8Granularity::kRow: return {i, 0};
    case Fp8Granularity::kTile1x128: return {i, j / 128};
    case Fp8Granularity::kBlock128x128: return {i / 128, j / 128};
  }
  return {0, 0};
}

struct Expected {
  std::int64_t groups_across = 1;
  std::vector<float> scales;        // row-major over the group grid
  std::vector<std::uint8_t> codes;  // row-major [M, N]
  float scale_of(Fp8Granularity g, std::int64_t i, std::int64_t j) const {
    auto [gi, gj] = group_of(g, i, j);
    return scales[gi * groups_across + gj];
  }
};

// x: row-major [M, N] values.
Expected naive_quantize(const std::vector<float>& x, std::int64_t M, std::int64_t N,
                        Fp8Granularity g, DType fp8, bool power_of_two) {
  const bool whole_rows = g == Fp8Granularity::kTensor || g == Fp8Granularity::kRow;
  const std::int64_t height = g == Fp8Granularity::kTensor       ? std::max<std::int64_t>(M, 1)
                              : g == Fp8Granularity::kBlock128x128 ? 128
                                                                   : 1;
  const std::int64_t width = whole_rows ? std::max<std::int64_t>(N, 1) : 128;
  const std::int64_t groups_down = g == Fp8Granularity::kTensor ? 1 : ceil_div(M, height);
  Expected e;
  e.groups_across = whole_rows ? 1 : ceil_div(N, width);
  e.codes.assign(static_cast<std::size_t>(M * N), 0);
  for (std::int64_t gi = 0; gi < groups_down; ++gi) {
    for (std::int64_t gj = 0; gj < e.groups_across; ++gj) {
      const std::int64_t r0 = gi * height, r1 = std::min(M, r0 + height);
      const std::int64_t c0 = gj * width, c1 = std::min(N, c0 + width);
      bool any_nan = false;
      float amax = 0.0f;
      for (std::int64_t i = r0; i < r1; ++i) {
        for (std::int64_t j = c0; j < c1; ++j) {
          const float v = x[i * N + j];
          any_nan = any_nan || std::isnan(v);
          if (!std::isnan(v)) amax = std::max(amax, std::fabs(v));
        }
      }
      if (any_nan) amax = NAN;
      const float s = contract_scale(amax, fp8_max(fp8), power_of_two);
      e.scales.push_back(s);
      for (std::int64_t i = r0; i < r1; ++i) {
        for (std::int64_t j = c0; j < c1; ++j) e.codes[i * N + j] = encode(fp8, x[i * N + j] / s);
      }
    }
  }
  return e;
}

// The expected grid as the op stores it (m-major: transposed, rows padded to 4 with zeros).
std::vector<float> stored_layout(const Expected& e, const Fp8QuantizeOptions& o,
                                 std::int64_t rows) {
  if (!o.scales_m_major) return e.scales;
  const std::int64_t pitch = align4(rows);
  std::vector<float> out(static_cast<std::size_t>(e.groups_across * pitch), 0.0f);
  for (std::int64_t gi = 0; gi < rows; ++gi) {
    for (std::int64_t gj = 0; gj < e.groups_across; ++gj) {
      out[gj * pitch + gi] = e.scales[gi * e.groups_across + gj];
    }
  }
  return out;
}

// --- Reading results ---

std::vector<float> values_f32(const HostTensor& t) {
  const std::vector<double> v = t.values();
  return {v.begin(), v.end()};  // exact: every input dtype is a float
}

std::vector<float> transpose(const std::vector<float>& v, std::int64_t M, std::int64_t N) {
  std::vector<float> t(v.size());
  for (std::int64_t i = 0; i < M; ++i) {
    for (std::int64_t j = 0; j < N; ++j) t[j * M + i] = v[i * N + j];
  }
  return t;
}

std::uint8_t code_at(const HostTensor& q, std::int64_t i, std::int64_t j) {
  return static_cast<const std::uint8_t*>(q.data())[i * q.view().strides[0] + j];
}

std::vector<std::uint8_t> codes(const HostTensor& q) {
  std::vector<std::uint8_t> c;
  for (std::int64_t i = 0; i < q.shape()[0]; ++i) {
    for (std::int64_t j = 0; j < q.shape()[1]; ++j) c.push_back(code_at(q, i, j));
  }
  return c;
}

std::vector<float> floats(const HostTensor& scales) {
  const float* p = static_cast<const float*>(scales.data());
  return {p, p + scales.numel()};
}

::testing::AssertionResult same_codes(const std::vector<std::uint8_t>& got,
                                      const std::vector<std::uint8_t>& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << got.size() << " codes, expected " << want.size();
  }
  for (std::size_t k = 0; k < want.size(); ++k) {
    if (got[k] != want[k]) {
      char message[64];
      std::snprintf(message, sizeof message, "code %zu: got 0x%02X, expected 0x%02X", k,
                    unsigned{got[k]}, unsigned{want[k]});
      return ::testing::AssertionFailure() << message;
    }
  }
  return ::testing::AssertionSuccess();
}

// Bit-identical, except that any NaN matches any NaN.
::testing::AssertionResult same_floats(const std::vector<float>& got,
                                       const std::vector<float>& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << got.size() << " values, expected " << want.size();
  }
  for (std::size_t k = 0; k < want.size(); ++k) {
    const bool both_nan = std::isnan(got[k]) && std::isnan(want[k]);
    if (!both_nan && std::memcmp(&got[k], &want[k], sizeof(float)) != 0) {
      return ::testing::AssertionFailure() << "value " << k << ": got " << got[k] << ", expected "
                                           << want[k];
    }
  }
  return ::testing::AssertionSuccess();
}

// Bytes between the end of each row and the next row stay poisoned.
bool row_padding_untouched(const HostTensor& q) {
  const std::int64_t rows = q.shape()[0], cols = q.shape()[1], stride = q.view().strides[0];
  const auto* bytes = static_cast<const std::uint8_t*>(q.data());
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = cols; j < stride; ++j) {
      if (bytes[i * stride + j] != kPoisonByte) return false;
    }
  }
  return true;
}

// --- Running the op ---

std::vector<std::int64_t> scales_shape(const Fp8QuantizeOptions& o, std::int64_t rows,
                                       std::int64_t cols) {
  switch (o.granularity) {
    case Fp8Granularity::kTensor: return {1};
    case Fp8Granularity::kRow: return {rows};
    case Fp8Granularity::kTile1x128:
      if (o.scales_m_major) return {ceil_div(cols, 128), align4(rows)};
      return {rows, ceil_div(cols, 128)};
    case Fp8Granularity::kBlock128x128: return {ceil_div(rows, 128), ceil_div(cols, 128)};
  }
  return {};
}

struct Quantized {
  HostTensor q, scales, q_t, scales_t;  // q_t / scales_t absent unless asked for
};

Quantized quantize(const HostTensor& x, DType fp8, const Fp8QuantizeOptions& o,
                   bool transposed_copy = false, std::int64_t row_pad = 0) {
  const std::int64_t M = x.shape()[0], N = x.shape()[1];
  Quantized r{HostTensor(fp8, {M, N}, row_pad), HostTensor(DType::kFloat32, scales_shape(o, M, N)),
              {}, {}};
  if (transposed_copy) {
    r.q_t = HostTensor(fp8, {N, M}, row_pad + 1);
    r.scales_t = HostTensor(DType::kFloat32, scales_shape(o, N, M));
  }
  fp8_quantize(x.view(), r.q.view(), r.scales.view(), r.q_t.view(), r.scales_t.view(), o);
  return r;
}

// Uniform in [-1, 1] times 2^k with k uniform in [-10, 6] per element: groups with very
// different amax, and plenty of fp8 subnormals.
HostTensor random_input(DType dtype, std::int64_t M, std::int64_t N, std::int64_t row_pad = 0) {
  HostTensor x(dtype, {M, N}, row_pad);
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  std::uniform_int_distribution<int> exponent(-10, 6);
  for (std::int64_t k = 0; k < x.numel(); ++k) {
    x.set(k, std::ldexp(unit(test::rng()), exponent(test::rng())));
  }
  return x;
}

const std::pair<std::int64_t, std::int64_t> kShapes[] = {{1, 1}, {3, 127}, {5, 129}, {130, 300},
                                                         {129, 128}};

// --- Quantize against the group-by-group loop ---

TEST(Fp8Quantize, MatchesGroupLoopForEveryDtypeLayoutAndTail) {
  for (DType input : kInputTypes) {
    for (DType fp8 : kFp8Types) {
      for (bool pow2 : {false, true}) {
        for (const Fp8QuantizeOptions& o : every_layout(pow2)) {
          for (auto [M, N] : kShapes) {
            SCOPED_TRACE(describe(o, fp8, input) + " M=" + std::to_string(M) +
                         " N=" + std::to_string(N));
            const HostTensor x = random_input(input, M, N, /*row_pad=*/3);
            const Quantized r = quantize(x, fp8, o, /*transposed_copy=*/true, /*row_pad=*/5);
            const std::vector<float> xv = values_f32(x);
            const Expected e = naive_quantize(xv, M, N, o.granularity, fp8, pow2);
            EXPECT_TRUE(same_codes(codes(r.q), e.codes));
            EXPECT_TRUE(same_floats(floats(r.scales), stored_layout(e, o, M)));
            // The transposed copy is the same quantization applied to x^T.
            const Expected et = naive_quantize(transpose(xv, M, N), N, M, o.granularity, fp8, pow2);
            EXPECT_TRUE(same_codes(codes(r.q_t), et.codes));
            EXPECT_TRUE(same_floats(floats(r.scales_t), stored_layout(et, o, N)));
            EXPECT_TRUE(row_padding_untouched(r.q));
            EXPECT_TRUE(row_padding_untouched(r.q_t));
          }
        }
      }
    }
  }
}

TEST(Fp8Quantize, TransposedCopyEqualsQuantizingTheTransposedInput) {
  const std::int64_t M = 130, N = 300;
  const HostTensor x = random_input(DType::kBFloat16, M, N);
  HostTensor xt(DType::kBFloat16, {N, M}, /*row_pad=*/2);
  for (std::int64_t i = 0; i < M; ++i) {
    for (std::int64_t j = 0; j < N; ++j) xt.set(j * M + i, x.at(i * N + j));
  }
  for (DType fp8 : kFp8Types) {
    for (const Fp8QuantizeOptions& o : every_layout(/*power_of_two=*/false)) {
      SCOPED_TRACE(describe(o, fp8, DType::kBFloat16));
      const Quantized both = quantize(x, fp8, o, /*transposed_copy=*/true);
      const Quantized of_xt = quantize(xt, fp8, o);
      EXPECT_TRUE(same_codes(codes(both.q_t), codes(of_xt.q)));
      EXPECT_TRUE(same_floats(floats(both.scales_t), floats(of_xt.scales)));
      if (o.granularity == Fp8Granularity::kTensor) {
        EXPECT_TRUE(same_floats(floats(both.scales_t), floats(both.scales)));
      }
      if (o.granularity == Fp8Granularity::kBlock128x128) {
        EXPECT_TRUE(same_floats(floats(both.scales_t), transpose(floats(both.scales), 2, 3)));
      }
    }
  }
}

TEST(Fp8Quantize, MMajorScalesAreTheTransposedRowMajorScalesWithZeroPadding) {
  for (auto [M, N] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {3, 129}, {4, 300}, {5, 127},
                      {130, 256}}) {
    SCOPED_TRACE("M=" + std::to_string(M) + " N=" + std::to_string(N));
    const HostTensor x = random_input(DType::kFloat32, M, N);
    const Quantized row_major = quantize(x, DType::kFloat8E4M3, {Fp8Granularity::kTile1x128},
                                         /*transposed_copy=*/true);
    const Quantized m_major = quantize(x, DType::kFloat8E4M3,
                                       {Fp8Granularity::kTile1x128, false, true}, true);
    EXPECT_TRUE(same_codes(codes(m_major.q), codes(row_major.q)));
    EXPECT_TRUE(same_codes(codes(m_major.q_t), codes(row_major.q_t)));
    for (auto [mm, rm, rows, cols] :
         {std::tuple{&m_major.scales, &row_major.scales, M, N},
          std::tuple{&m_major.scales_t, &row_major.scales_t, N, M}}) {
      const std::int64_t tiles = ceil_div(cols, 128), pitch = align4(rows);
      const std::vector<float> stored = floats(*mm), reference = floats(*rm);
      ASSERT_EQ(static_cast<std::int64_t>(stored.size()), tiles * pitch);
      for (std::int64_t t = 0; t < tiles; ++t) {
        for (std::int64_t i = 0; i < pitch; ++i) {
          const float want = i < rows ? reference[i * tiles + t] : 0.0f;
          EXPECT_EQ(stored[t * pitch + i], want) << "tile " << t << " row " << i;
        }
      }
    }
  }
}

// amax of a union is the max of the parts' amax and s(amax) is monotone, so a coarser
// granularity's scale is exactly the max of the finer scales it covers.
TEST(Fp8Quantize, CoarserScalesAreTheMaxOfTheFinerScalesTheyCover) {
  const std::int64_t M = 130, N = 300, tiles = 3;
  const HostTensor x = random_input(DType::kFloat32, M, N);
  for (bool pow2 : {false, true}) {
    auto scales_for = [&](Fp8Granularity g) {
      return floats(quantize(x, DType::kFloat8E4M3, {g, pow2}).scales);
    };
    const auto tensor = scales_for(Fp8Granularity::kTensor);
    const auto row = scales_for(Fp8Granularity::kRow);
    const auto tile = scales_for(Fp8Granularity::kTile1x128);
    const auto block = scales_for(Fp8Granularity::kBlock128x128);
    EXPECT_EQ(tensor[0], *std::max_element(row.begin(), row.end()));
    EXPECT_EQ(tensor[0], *std::max_element(tile.begin(), tile.end()));
    EXPECT_EQ(tensor[0], *std::max_element(block.begin(), block.end()));
    for (std::int64_t i = 0; i < M; ++i) {
      EXPECT_EQ(row[i], *std::max_element(&tile[i * tiles], &tile[(i + 1) * tiles])) << i;
    }
    for (std::int64_t bi = 0; bi < 2; ++bi) {
      for (std::int64_t t = 0; t < tiles; ++t) {
        float tile_max = 0.0f;
        for (std::int64_t i = bi * 128; i < std::min(M, (bi + 1) * 128); ++i) {
          tile_max = std::max(tile_max, tile[i * tiles + t]);
        }
        EXPECT_EQ(block[bi * tiles + t], tile_max) << bi << ", " << t;
      }
    }
  }
}

// --- Hand-computed bytes ---

struct ExactCase {
  std::vector<std::vector<double>> rows;
  std::vector<float> scales;                     // kRow
  std::vector<std::vector<std::uint8_t>> codes;  // per row
};

void expect_exact_rows(const ExactCase& c, DType input, DType fp8, bool pow2 = false) {
  SCOPED_TRACE(std::string(dtype_name(fp8)) + " from " + dtype_name(input));
  const auto M = static_cast<std::int64_t>(c.rows.size());
  const auto N = static_cast<std::int64_t>(c.rows[0].size());
  std::vector<double> flat;
  for (const auto& row : c.rows) flat.insert(flat.end(), row.begin(), row.end());
  const HostTensor x = HostTensor::from_values(input, {M, N}, flat);
  ASSERT_EQ(x.values(), flat) << "the hand-picked inputs must be exact in this dtype";
  const Quantized r = quantize(x, fp8, {Fp8Granularity::kRow, pow2});
  EXPECT_TRUE(same_floats(floats(r.scales), c.scales));
  std::vector<std::uint8_t> want;
  for (const auto& row : c.codes) want.insert(want.end(), row.begin(), row.end());
  EXPECT_TRUE(same_codes(codes(r.q), want));
}

TEST(Fp8Quantize, ExactBytesE4M3) {
  const double sub = std::ldexp(1.0, -9);  // smallest e4m3 subnormal
  const ExactCase c{
      {
          // amax 448: s = 1. Ties to even (1.0625, 1.1875), subnormals and their ties, rounding up
          // into the first normal (7.5 * 2^-9).
          {448, -448, 1, 1.0625, 1.1875, sub, sub / 2, 1.5 * sub, -7.5 * sub, 1.125},
          // amax 896: s = 2; 100 / 2 = 50 is a tie between 48 and 52.
          {896, 1, 3, 2.125, -4.25, 0, 0.25, 100, -896, 2},
          // amax 0: s = 1, signed zeros kept.
          {0, -0.0, 0, 0, -0.0, 0, 0, 0, 0, 0},
          // amax 448 * 2^-10: s = 2^-10; quotients land in the fp8 subnormals.
          {0.4375, std::ldexp(1, -10), std::ldexp(1, -19), std::ldexp(1, -20), 0.0625,
           -3 * std::ldexp(1, -20), 0, 0, 0, 0},
          // amax 1: s = fl(1/448), not a power of two; quotients round to 448 and 224.
          {1, -1, 0.5, 0, 0, 0, 0, 0, 0, 0},
      },
      {1.0f, 2.0f, 1.0f, pow2f(-10), 1.0f / 448.0f},
      {
          {0x7E, 0xFE, 0x38, 0x38, 0x3A, 0x01, 0x00, 0x02, 0x88, 0x39},
          {0x7E, 0x30, 0x3C, 0x38, 0xC0, 0x00, 0x20, 0x64, 0xFE, 0x38},
          {0x00, 0x80, 0x00, 0x00, 0x80, 0x00, 0x00, 0x00, 0x00, 0x00},
          {0x7E, 0x38, 0x01, 0x00, 0x68, 0x82, 0x00, 0x00, 0x00, 0x00},
          {0x7E, 0xFE, 0x76, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00},
      }};
  for (DType input : kInputTypes) expect_exact_rows(c, input, DType::kFloat8E4M3);
}

TEST(Fp8Quantize, ExactBytesE5M2) {
  const double sub = std::ldexp(1.0, -16);  // smallest e5m2 subnormal
  const ExactCase c{
      {
          {57344, -57344, 1, 1.125, 1.375, sub, sub / 2, 1.5 * sub},  // s = 1
          {1, -0.5, 0, 0, 0, 0, 0, 0},                                // s = fl(1/57344)
          {14336, 3, -0.3125, 0, 0, 0, 0, 0},                         // s = 1/4
      },
      {1.0f, 1.0f / 57344.0f, 0.25f},
      {
          {0x7B, 0xFB, 0x3C, 0x3C, 0x3E, 0x01, 0x00, 0x02},
          {0x7B, 0xF7, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00},
          {0x7B, 0x4A, 0xBD, 0x00, 0x00, 0x00, 0x00, 0x00},
      }};
  for (DType input : kInputTypes) expect_exact_rows(c, input, DType::kFloat8E5M2);
}

// The contract rounds x / s to float32 first, then to fp8: here the float32 quotient is exactly
// the e4m3 tie 1.0625 (-> 1.0, even) although the exact quotient lies above it (-> 1.125).
TEST(Fp8Quantize, QuotientIsRoundedToFloat32BeforeTheFp8Cast) {
  const float amax = 0x1.c072bcp+8f, x = 0x1.1045aap+0f;
  ASSERT_EQ(x / (amax / 448.0f), 1.0625f);
  ASSERT_GT(static_cast<double>(x) / static_cast<double>(amax / 448.0f), 1.0625);
  expect_exact_rows({{{amax, x}}, {amax / 448.0f}, {{0x7E, 0x38}}}, DType::kFloat32,
                    DType::kFloat8E4M3);
}

// Only a scale rounded below amax / fmax can push x / s past fmax: with float32 subnormal
// inputs, r = fl(600 * 2^-149 / 448) = 2^-149, so the quotients are the integers themselves
// and meet the saturation boundary (448 | tie 464 | 480 for e4m3).
TEST(Fp8Quantize, SubnormalScaleSaturatesAtTheFp8Boundary) {
  auto tiny = [](std::vector<double> ks) {
    for (double& k : ks) k = std::ldexp(k, -149);
    return ks;
  };
  for (bool pow2 : {false, true}) {
    expect_exact_rows({{tiny({600, 464, 480, 456, 440, 420, 432, 1, -600, 0})},
                       {pow2f(-149)},
                       {{0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7D, 0x7E, 0x38, 0xFE, 0x00}}},
                      DType::kFloat32, DType::kFloat8E4M3, pow2);
    // e5m2 near the top: 49152 | tie 53248 | 57344 | tie 61440 | (65536 overflows).
    expect_exact_rows({{tiny({70000, 61440, 60000, 55296, 53248, 1})},
                       {pow2f(-149)},
                       {{0x7B, 0x7B, 0x7B, 0x7B, 0x7A, 0x3C}}},
                      DType::kFloat32, DType::kFloat8E5M2, pow2);
  }
}

// When amax / fmax underflows float32 (amax below ~224 * 2^-149) the scale is 1, as for
// amax == 0, instead of 0 (which would make q = x / 0).
TEST(Fp8Quantize, RatioUnderflowingToZeroGivesScaleOne) {
  const double d = std::ldexp(1.0, -149);
  expect_exact_rows({{{d, -d, 0}, {224 * d, 0, 0}, {225 * d, 0, 0}},
                     {1.0f, 1.0f, pow2f(-149)},
                     {{0x00, 0x80, 0x00}, {0x00, 0x00, 0x00}, {0x76, 0x00, 0x00}}},
                    DType::kFloat32, DType::kFloat8E4M3);
}

TEST(Fp8Quantize, PowerOfTwoScalesAreExact) {
  // amax:      1     448  449  447  448 * 2^-10  0    3
  // amax/448:  2^-8.8 1   >1   <1   2^-10        0    2^-7.2
  const ExactCase e4m3{{{1, 0.5}, {448, 1}, {449, 1}, {447, 1}, {0.4375, 0.25}, {0, 0}, {3, -1}},
                       {pow2f(-8), 1, 2, 1, pow2f(-10), 1, pow2f(-7)},
                       {{0x78, 0x70}, {0x7E, 0x38}, {0x76, 0x30}, {0x7E, 0x38}, {0x7E, 0x78},
                        {0x00, 0x00}, {0x7C, 0xF0}}};
  expect_exact_rows(e4m3, DType::kFloat32, DType::kFloat8E4M3, /*pow2=*/true);
  const ExactCase e5m2{{{1, 0.5}, {57344, 1}, {57345, 1}},
                       {pow2f(-15), 1, 2},
                       {{0x78, 0x74}, {0x7B, 0x3C}, {0x77, 0x38}}};
  expect_exact_rows(e5m2, DType::kFloat32, DType::kFloat8E5M2, /*pow2=*/true);
}

TEST(Fp8Quantize, TileAndBlockEdgesExact) {
  {  // Tiles of row 0 end at columns 127 / 255; the last one holds 44 columns. Row 1 is zero.
    HostTensor x = HostTensor::from_values(DType::kFloat32, {2, 300}, std::vector<double>(600, 0));
    x.set(0, 0.25);
    x.set(127, 448);
    x.set(128, 896);
    x.set(129, 2);
    x.set(256, 0.4375);
    x.set(299, std::ldexp(1, -10));
    std::vector<std::uint8_t> want(600, 0);
    want[0] = 0x28;
    want[127] = want[128] = want[256] = 0x7E;
    want[129] = want[299] = 0x38;
    const Quantized r = quantize(x, DType::kFloat8E4M3, {Fp8Granularity::kTile1x128});
    EXPECT_TRUE(same_floats(floats(r.scales), {1, 2, pow2f(-10), 1, 1, 1}));
    EXPECT_TRUE(same_codes(codes(r.q), want));
    const Quantized mm = quantize(x, DType::kFloat8E4M3, {Fp8Granularity::kTile1x128, false, true});
    EXPECT_TRUE(same_floats(floats(mm.scales), {1, 1, 0, 0, 2, 1, 0, 0, pow2f(-10), 1, 0, 0}));
  }
  {  // 130 x 130: blocks end at row / column 127; block (1, 1) is all zero.
    const std::int64_t n = 130;
    HostTensor x = HostTensor::from_values(DType::kFloat32, {n, n}, std::vector<double>(n * n, 0));
    std::vector<std::uint8_t> want(n * n, 0);
    for (auto [i, j, v, code] : {std::tuple{127, 127, 448.0, 0x7E}, {127, 0, 1.0, 0x38},
                                 {128, 0, 896.0, 0x7E}, {128, 1, 2.0, 0x38},
                                 {0, 128, 0.4375, 0x7E}, {1, 128, std::ldexp(1, -10), 0x38}}) {
      x.set(i * n + j, v);
      want[i * n + j] = static_cast<std::uint8_t>(code);
    }
    const Quantized r = quantize(x, DType::kFloat8E4M3, {Fp8Granularity::kBlock128x128});
    EXPECT_TRUE(same_floats(floats(r.scales), {1, pow2f(-10), 2, 1}));
    EXPECT_TRUE(same_codes(codes(r.q), want));
  }
}

// --- Non-finite inputs and empty shapes ---

TEST(Fp8Quantize, NaNPoisonsOnlyItsGroup) {
  const std::int64_t M = 130, N = 300, bad_i = 129, bad_j = 200;
  const HostTensor clean = random_input(DType::kFloat32, M, N);
  HostTensor x = clean;
  x.set(bad_i * N + bad_j, NAN);
  for (DType fp8 : kFp8Types) {
    for (Fp8Granularity g : kGranularities) {
      SCOPED_TRACE(std::string(fp8_granularity_name(g)) + " " + dtype_name(fp8));
      const Quantized r = quantize(x, fp8, {g}), ref = quantize(clean, fp8, {g});
      const auto bad_group = group_of(g, bad_i, bad_j);
      const bool whole_rows = g == Fp8Granularity::kTensor || g == Fp8Granularity::kRow;
      const std::int64_t across = whole_rows ? 1 : 3;
      const std::vector<float> s = floats(r.scales), s_ref = floats(ref.scales);
      for (std::size_t k = 0; k < s.size(); ++k) {
        const auto bad_index = bad_group.first * across + bad_group.second;
        const bool bad = static_cast<std::int64_t>(k) == bad_index;
        if (bad) {
          EXPECT_TRUE(std::isnan(s[k])) << k;
        } else {
          EXPECT_EQ(s[k], s_ref[k]) << k;
        }
      }
      for (std::int64_t i = 0; i < M; ++i) {
        for (std::int64_t j = 0; j < N; ++j) {
          if (group_of(g, i, j) == bad_group) {
            ASSERT_TRUE(std::isnan(decode(fp8, code_at(r.q, i, j)))) << i << ", " << j;
          } else {
            ASSERT_EQ(code_at(r.q, i, j), code_at(ref.q, i, j)) << i << ", " << j;
          }
        }
      }
    }
  }
}

// An infinity makes its group's scale Inf: finite elements quantize to signed zero, the
// infinities to NaN (Inf / Inf), and dequantizing the group gives NaN (0 * Inf).
TEST(Fp8Quantize, InfinityGivesInfiniteScaleZerosAndNaN) {
  const std::int64_t M = 2, N = 200;
  const HostTensor clean = random_input(DType::kFloat16, M, N);
  HostTensor x = clean;
  x.set(10, INFINITY);
  x.set(20, -INFINITY);
  const Fp8QuantizeOptions o{Fp8Granularity::kTile1x128};
  for (DType fp8 : kFp8Types) {
    SCOPED_TRACE(dtype_name(fp8));
    const Quantized r = quantize(x, fp8, o), ref = quantize(clean, fp8, o);
    const std::vector<float> s = floats(r.scales), s_ref = floats(ref.scales);
    EXPECT_EQ(s[0], INFINITY);
    for (std::size_t k = 1; k < s.size(); ++k) EXPECT_EQ(s[k], s_ref[k]);
    HostTensor y(DType::kFloat32, {M, N});
    fp8_dequantize(r.q.view(), r.scales.view(), y.view(), o);
    for (std::int64_t j = 0; j < N; ++j) {
      for (std::int64_t i = 0; i < M; ++i) {
        const std::uint8_t c = code_at(r.q, i, j);
        if (i == 0 && j < 128) {
          if (j == 10 || j == 20) {
            EXPECT_TRUE(std::isnan(decode(fp8, c))) << j;
          } else {
            EXPECT_EQ(c, std::signbit(x.at(j)) ? 0x80 : 0x00) << j;
          }
          EXPECT_TRUE(std::isnan(y.at(j))) << j;
        } else {
          EXPECT_EQ(c, code_at(ref.q, i, j)) << i << ", " << j;
          EXPECT_TRUE(std::isfinite(y.at(i * N + j)));
        }
      }
    }
  }
}

TEST(Fp8Quantize, EmptyRowsOrColumns) {
  for (auto [M, N] : {std::pair<std::int64_t, std::int64_t>{0, 5}, {3, 0}, {0, 0}}) {
    for (const Fp8QuantizeOptions& o : every_layout(false)) {
      SCOPED_TRACE(describe(o, DType::kFloat8E4M3, DType::kFloat32) + " M=" + std::to_string(M) +
                   " N=" + std::to_string(N));
      const HostTensor x(DType::kFloat32, {M, N});
      const Quantized r = quantize(x, DType::kFloat8E4M3, o, /*transposed_copy=*/true);
      // Groups over no elements have amax 0, so scale 1; m-major padding is 0.
      auto expected_scales = [&](std::int64_t rows, std::int64_t cols) {
        const Expected e = naive_quantize({}, rows, cols, o.granularity, DType::kFloat8E4M3, false);
        return stored_layout(e, o, rows);
      };
      EXPECT_TRUE(same_floats(floats(r.scales), expected_scales(M, N)));
      EXPECT_TRUE(same_floats(floats(r.scales_t), expected_scales(N, M)));
      HostTensor y(DType::kFloat16, {M, N});
      fp8_dequantize(r.q.view(), r.scales.view(), y.view(), o);
    }
  }
  // Empty views may carry null pointers.
  const TensorView null_x(nullptr, DType::kFloat32, {0, 5});
  float scale = NAN;
  fp8_quantize(null_x, TensorView(nullptr, DType::kFloat8E4M3, {0, 5}),
               TensorView(&scale, DType::kFloat32, {1}), {}, {}, {Fp8Granularity::kTensor});
  EXPECT_EQ(scale, 1.0f);
}

// --- The kernels' division-free quotient (ops/fp8/fp8_quotient.h) against float32 division ---

using ops::fp8::nearest_reciprocal;
using ops::fp8::reciprocal_quotient;
using ops::fp8::reciprocal_quotient_is_exact;

// x / s as the kernels compute it: by the reciprocal where that is exact for s, else divided.
float kernel_quotient(float x, float s) {
  return reciprocal_quotient_is_exact(s) ? reciprocal_quotient(x, s, nearest_reciprocal(s)) : x / s;
}

std::uint32_t bits_of(float v) {
  std::uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

// Pairs x, s in [1, 2) (s = S * 2^-23) whose quotient lies within `reach` units of
// 2^-(23 + k) of a midpoint m = M * 2^-k of the quotient's binade: k = 24 for quotients in [1, 2),
// 25 for [1/2, 1). 2^k * x - S * M = t then has the 2-adic valuation of S, so S * M = -t modulo
// 2^k fixes M modulo 2^(k - v) (v = that valuation, t = 2^v t', M odd) and x follows.
template <class Fn>
void for_each_near_midpoint_pair(std::uint32_t S, int reach, Fn&& fn) {
  const int v = std::countr_zero(S);
  const std::uint64_t odd = S >> v;
  std::uint64_t inverse = odd;  // Newton's iteration for odd^-1 modulo 2^64
  for (int i = 0; i < 6; ++i) inverse *= 2 - odd * inverse;
  for (int k = 24; k <= 25; ++k) {
    if (v >= k) continue;
    const std::uint64_t modulus = std::uint64_t{1} << (k - v);
    for (int t = -reach; t <= reach; ++t) {
      if (t == 0 || std::countr_zero(static_cast<unsigned>(std::abs(t))) != v) continue;
      const std::int64_t t_odd = t / (1 << v);
      const std::uint64_t first = (static_cast<std::uint64_t>(-t_odd) * inverse) & (modulus - 1);
      // Every such M in [2^24, 2^25): the midpoints of one binade.
      const std::uint64_t lo = std::uint64_t{1} << 24;
      const std::uint64_t skip = first < lo ? (lo - first + modulus - 1) / modulus * modulus : 0;
      for (std::uint64_t M = first + skip; M < 2 * lo; M += modulus) {
        const std::int64_t X = (static_cast<std::int64_t>(S * M) + t) >> k;
        if (X >= (1 << 23) && X < (1 << 24)) fn(std::ldexp(static_cast<float>(X), -23));
      }
    }
  }
}

// The proof of fp8_quotient.h for x, s in [1, 2). There y = RN(x r) is within 1.5 ulps of
// Q = x / s, |rs - 1| <= 2^-24 (r = RN(1/s)) and |y s - x| < 2^-22, so d is exact or off by at most
// 2^-47, and y - d r differs from Q by Q (rs - 1)^2 + (y - x r)(rs - 1) + r (d - (y s - x)),
// below 5 * 2^-48. RN(y - d r) != RN(Q) needs a midpoint m within that of Q, i.e.
// |2^k x - S m 2^k| = |t| < 10 in the units above. Every such pair, for every scale significand,
// must give the division's bits (reach 12 for margin); a reciprocal one ulp off must not.
TEST(Fp8Quotient, ExactNearEveryRoundingMidpointForEveryScaleSignificand) {
  constexpr std::uint32_t kFirst = 1u << 23, kCount = 1u << 23;
  constexpr int kReach = 12;
  std::atomic<std::int64_t> total{0}, failures{0};
  detail::parallel_for(kCount, 1 << 16, [&](std::int64_t lo, std::int64_t hi) {
    std::int64_t n = 0, bad = 0;
    for (std::int64_t i = lo; i < hi; ++i) {
      const auto S = static_cast<std::uint32_t>(kFirst + i);
      const float s = std::ldexp(static_cast<float>(S), -23), r = nearest_reciprocal(s);
      for_each_near_midpoint_pair(S, kReach, [&](float x) {
        ++n;
        bad += bits_of(reciprocal_quotient(x, s, r)) != bits_of(x / s);
      });
    }
    total += n;
    failures += bad;
  });
  std::printf("[fp8] division-free quotient: %lld pairs near midpoints checked\n",
              static_cast<long long>(total.load()));
  EXPECT_GT(total.load(), std::int64_t{1} << 25);
  EXPECT_EQ(failures.load(), 0);
  // The same pairs catch a reciprocal one ulp off: the check has teeth.
  std::int64_t caught = 0;
  for (std::uint32_t S = kFirst; S < kFirst + (1u << 12); ++S) {
    const float s = std::ldexp(static_cast<float>(S), -23);
    const float r = std::nextafter(nearest_reciprocal(s), 2.0f);
    for_each_near_midpoint_pair(S, kReach, [&](float x) {
      caught += bits_of(reciprocal_quotient(x, s, r)) != bits_of(x / s);
    });
  }
  EXPECT_GT(caught, 0);
}

// Checks x / s for one group (scale from amax) over `inputs`, the values with |x| <= amax (any
// when amax is NaN): the float32 bits of the division wherever the kernels take the reciprocal
// path and |x / s| >= 2^-19, the fp8 codes of both formats everywhere. Returns the failures.
std::int64_t check_group(float amax, float fmax, bool pow2, const std::vector<float>& inputs,
                         std::int64_t& bit_differences) {
  const float s = contract_scale(amax, fmax, pow2);
  std::int64_t failures = 0;
  for (float x : inputs) {
    if (!std::isnan(amax) && !(std::fabs(x) <= amax)) continue;
    const float got = kernel_quotient(x, s), want = x / s;
    if (bits_of(got) == bits_of(want) || (std::isnan(got) && std::isnan(want))) continue;
    ++bit_differences;
    const bool bits_required = reciprocal_quotient_is_exact(s) && std::fabs(want) >= 0x1p-19f;
    bool same = !bits_required;
    for (DType fp8 : kFp8Types) same = same && encode(fp8, got) == encode(fp8, want);
    if (!same && failures++ < 5) {
      ADD_FAILURE() << "amax " << std::hexfloat << amax << " s " << s << " x " << x << ": got "
                    << got << ", division " << want;
    }
  }
  return failures;
}

// Group amaxes: edges (zero, subnormals, the reciprocal path's limits, fmax multiples that give
// power-of-two scales, integers that give multiples of 1/fmax, all-ones significands, the
// largest finite values, Inf and NaN) and random ones spread over every exponent.
std::vector<float> amax_cases() {
  std::vector<float> a = {0.0f, 0x1p-149f, 3 * 0x1p-149f, 224 * 0x1p-149f, 225 * 0x1p-149f,
                          0x1p-133f, 0x1p-126f, 0x1.fffffep-1f, 0x1p-24f, 0x1p-14f, 1.0f, 448.0f,
                          57344.0f, 65504.0f, 0x1.fep127f, std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::infinity(), NAN};
  for (float fmax : {448.0f, 57344.0f}) {
    for (int e = -149; e <= 127; e += 3) a.push_back(std::ldexp(fmax, e));
    for (int k = 1; k <= 16; ++k) a.push_back(static_cast<float>(k));
    // Where s crosses the reciprocal path's lower limit, and s with an all-ones significand.
    const float edge = fmax * ops::fp8::kMinReciprocalScale;
    for (float v : {edge, std::nextafter(edge, 0.0f), std::nextafter(edge, 1.0f)}) a.push_back(v);
    for (int e : {-100, -81, -80, -79, -20, 0, 20, 100}) {
      a.push_back(fmax * std::ldexp(0x1.fffffep0f, e));
    }
  }
  for (int e = -149; e <= 127; e += 7) a.push_back(std::ldexp(0x1.fffffep0f, e));
  std::uniform_int_distribution<std::uint32_t> finite(1, 0x7f7fffffu);
  for (int k = 0; k < 160; ++k) {
    const std::uint32_t b = finite(test::rng());
    float v;
    std::memcpy(&v, &b, sizeof v);
    a.push_back(v);
  }
  return a;
}

// Every bf16 and every fp16 bit pattern against every amax above, both formats, both scale kinds.
TEST(Fp8Quotient, Fp8CodesMatchDivisionForEveryBf16AndFp16Input) {
  std::vector<float> inputs;
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    inputs.push_back(static_cast<float>(detail::bf16_to_double(static_cast<std::uint16_t>(b))));
    inputs.push_back(static_cast<float>(detail::half_to_double(static_cast<std::uint16_t>(b))));
  }
  const std::vector<float> amaxes = amax_cases();
  std::atomic<std::int64_t> failures{0}, differences{0};
  const auto count = static_cast<std::int64_t>(amaxes.size());
  detail::parallel_for(count, 4, [&](std::int64_t lo, std::int64_t hi) {
    std::int64_t diff = 0;
    for (std::int64_t i = lo; i < hi; ++i) {
      for (float fmax : {448.0f, 57344.0f}) {
        for (bool pow2 : {false, true}) {
          failures += check_group(amaxes[i], fmax, pow2, inputs, diff);
        }
      }
    }
    differences += diff;
  });
  std::printf("[fp8] %zu amaxes x %zu bf16/fp16 inputs: %lld float32 quotients differ, all below "
              "2^-19 with equal fp8 codes\n",
              amaxes.size(), inputs.size(), static_cast<long long>(differences.load()));
  EXPECT_EQ(failures.load(), 0);
}

// float32 inputs: random amaxes over every exponent, and random x below each (subnormals too).
TEST(Fp8Quotient, Fp8CodesMatchDivisionForRandomFloat32Inputs) {
  const std::vector<float> amaxes = amax_cases();
  std::atomic<std::int64_t> failures{0}, differences{0};
  const auto count = static_cast<std::int64_t>(amaxes.size());
  detail::parallel_for(count, 4, [&](std::int64_t lo, std::int64_t hi) {
    std::mt19937_64 gen(static_cast<std::uint64_t>(lo) * 7919 + 1);
    std::int64_t diff = 0;
    for (std::int64_t i = lo; i < hi; ++i) {
      const float amax = amaxes[i];
      const std::uint32_t top = std::isfinite(amax) ? bits_of(amax) : 0x7f7fffffu;
      std::uniform_int_distribution<std::uint32_t> below(0, top);
      std::vector<float> inputs;
      for (int k = 0; k < 20000; ++k) {
        const std::uint32_t b = below(gen) | (k % 2 ? 0x80000000u : 0u);
        float x;
        std::memcpy(&x, &b, sizeof x);
        inputs.push_back(x);
      }
      for (float fmax : {448.0f, 57344.0f}) {
        for (bool pow2 : {false, true}) failures += check_group(amax, fmax, pow2, inputs, diff);
      }
    }
    differences += diff;
  });
  std::printf("[fp8] random float32 inputs: %lld float32 quotients differ, all below 2^-19 with "
              "equal fp8 codes\n",
              static_cast<long long>(differences.load()));
  EXPECT_EQ(failures.load(), 0);
}

// --- Dequantize ---

TEST(Fp8Dequantize, IsTheFloat32ProductRoundedOnceForEveryDtypeAndLayout) {
  const std::int64_t M = 130, N = 300;
  for (DType fp8 : kFp8Types) {
    const HostTensor x = random_input(DType::kFloat32, M, N);
    const std::vector<float> xv = values_f32(x);
    for (const Fp8QuantizeOptions& o : every_layout(false)) {
      const Quantized r = quantize(x, fp8, o, false, /*row_pad=*/1);
      const Expected e = naive_quantize(xv, M, N, o.granularity, fp8, false);
      for (DType out : kInputTypes) {
        SCOPED_TRACE(describe(o, fp8, out));
        HostTensor y(out, {M, N}, /*row_pad=*/2);
        fp8_dequantize(r.q.view(), r.scales.view(), y.view(), o);
        for (std::int64_t i = 0; i < M; ++i) {
          for (std::int64_t j = 0; j < N; ++j) {
            const float product = decode(fp8, code_at(r.q, i, j)) * e.scale_of(o.granularity, i, j);
            ASSERT_EQ(y.at(i * N + j), detail::round_to(out, product)) << i << ", " << j;
          }
        }
      }
    }
  }
}

TEST(Fp8Dequantize, ExactValues) {
  // q (e4m3): 448, -1 | 2^-9 (smallest subnormal), 1.125; row scales 2 and 1 + 2^-10.
  HostTensor q(DType::kFloat8E4M3, {2, 2});
  const std::uint8_t raw[] = {0x7E, 0xB8, 0x01, 0x39};
  std::memcpy(q.data(), raw, sizeof raw);
  const HostTensor scales =
      HostTensor::from_values(DType::kFloat32, {2}, {2, 1 + std::ldexp(1, -10)});
  HostTensor y32(DType::kFloat32, {2, 2}), y16(DType::kFloat16, {2, 2});
  HostTensor ybf(DType::kBFloat16, {2, 2});
  for (HostTensor* y : {&y32, &y16, &ybf}) fp8_dequantize(q.view(), scales.view(), y->view());
  // Float32 keeps both products; float16 keeps 2^-9 + 2^-19 and rounds 1.125 + 1.125 * 2^-10 to
  // one ulp above 1.125; bfloat16 rounds them to 2^-9 and 1.125.
  const double sub = std::ldexp(1, -9), ulp16 = std::ldexp(1, -10);
  EXPECT_EQ(y32.values(), (std::vector<double>{896, -2, sub + sub * ulp16, 1.125 + 1.125 * ulp16}));
  EXPECT_EQ(y16.values(), (std::vector<double>{896, -2, sub + sub * ulp16, 1.125 + ulp16}));
  EXPECT_EQ(ybf.values(), (std::vector<double>{896, -2, sub, 1.125}));
}

// y = float(q) * s is rounded to float32 before y's dtype: 1.125 * s here is exactly the bfloat16
// tie 1 + 2^-8 in float32 (-> 1.0, even) although the exact product lies above it.
TEST(Fp8Dequantize, ProductIsRoundedToFloat32BeforeTheOutputDtype) {
  const float s = 0x1.c8e39p-1f, tie = 1.0f + pow2f(-8);
  ASSERT_EQ(1.125f * s, tie);
  ASSERT_GT(1.125 * static_cast<double>(s), tie);
  HostTensor q(DType::kFloat8E4M3, {1, 1});
  *static_cast<std::uint8_t*>(q.data()) = 0x39;  // 1.125
  const HostTensor scales = HostTensor::from_values(DType::kFloat32, {1}, {s});
  HostTensor y32(DType::kFloat32, {1, 1}), ybf(DType::kBFloat16, {1, 1});
  fp8_dequantize(q.view(), scales.view(), y32.view());
  fp8_dequantize(q.view(), scales.view(), ybf.view());
  EXPECT_EQ(y32.at(0), tie);
  EXPECT_EQ(ybf.at(0), 1.0);
}

// |dequant(quant(x)) - x| <= s * ulp_fp8(q) / 2, plus float32 rounding of the division and
// multiply and the final rounding to x's dtype; and each group's largest |q| uses the range.
TEST(Fp8RoundTrip, ErrorWithinHalfAnFp8UlpTimesTheScale) {
  const std::int64_t M = 129, N = 300;
  for (DType input : kInputTypes) {
    for (DType fp8 : kFp8Types) {
      const int man_bits = fp8 == DType::kFloat8E4M3 ? 3 : 2;
      const int min_exp = fp8 == DType::kFloat8E4M3 ? -6 : -14;
      const double unit_roundoff = std::ldexp(1.0, input == DType::kFloat32   ? -24
                                                   : input == DType::kFloat16 ? -11
                                                                              : -8);
      const double smallest_subnormal = std::ldexp(1.0, input == DType::kFloat32   ? -149
                                                        : input == DType::kFloat16 ? -24
                                                                                   : -133);
      const HostTensor x = random_input(input, M, N);
      for (bool pow2 : {false, true}) {
        for (const Fp8QuantizeOptions& o : every_layout(pow2)) {
          SCOPED_TRACE(describe(o, fp8, input));
          const Quantized r = quantize(x, fp8, o);
          HostTensor y(input, {M, N});
          fp8_dequantize(r.q.view(), r.scales.view(), y.view(), o);
          const Expected e = naive_quantize(values_f32(x), M, N, o.granularity, fp8, pow2);
          std::vector<float> group_qmax(e.scales.size(), 0.0f);
          for (std::int64_t i = 0; i < M; ++i) {
            for (std::int64_t j = 0; j < N; ++j) {
              const double xv = x.at(i * N + j), yv = y.at(i * N + j);
              const double qv = decode(fp8, code_at(r.q, i, j));
              const double s = e.scale_of(o.granularity, i, j);
              int q_exponent = 0;
              std::frexp(qv, &q_exponent);  // |q| in [2^(q_exponent - 1), 2^q_exponent)
              const int binade = qv == 0 ? min_exp : std::max(q_exponent - 1, min_exp);
              const double ulp = std::ldexp(1.0, binade - man_bits);
              const double bound = s * ulp / 2 + std::fabs(xv) * std::ldexp(1.0, -22) +
                                   std::fabs(yv) * unit_roundoff + smallest_subnormal / 2;
              ASSERT_LE(std::fabs(yv - xv), bound) << i << ", " << j << ": x " << xv << " q " << qv;
              auto [gi, gj] = group_of(o.granularity, i, j);
              float& qmax = group_qmax[gi * e.groups_across + gj];
              qmax = std::max(qmax, static_cast<float>(std::fabs(qv)));
            }
          }
          for (float qmax : group_qmax) {
            EXPECT_LE(qmax, fp8_max(fp8));
            if (pow2) {
              EXPECT_GE(qmax, fp8_max(fp8) / 2);
            } else {
              EXPECT_EQ(qmax, fp8_max(fp8));
            }
          }
        }
      }
    }
  }
}

// --- Argument errors ---

TensorView on_cuda(TensorView t) {
  t.device = Device::cuda(0);
  return t;
}

TEST(Fp8Quantize, ArgumentErrors) {
  const std::int64_t M = 4, N = 8;
  const HostTensor x = random_input(DType::kFloat32, M, N);
  HostTensor q(DType::kFloat8E4M3, {M, N}), s(DType::kFloat32, {M});
  HostTensor qt(DType::kFloat8E4M3, {N, M}), st(DType::kFloat32, {N});
  HostTensor spare(DType::kFloat32, {64});
  void* buf = spare.data();
  const TensorView X = x.view(), Q = q.view(), S = s.view(), QT = qt.view(), ST = st.view();
  const Fp8QuantizeOptions row{};
  auto run = [&](const TensorView& x_, const TensorView& q_, const TensorView& s_,
                 const TensorView& qt_, const TensorView& st_, const Fp8QuantizeOptions& o) {
    fp8_quantize(x_, q_, s_, qt_, st_, o);
  };
  run(X, Q, S, QT, ST, row);  // the baseline is valid

  // x
  TS_EXPECT_ERROR(run({}, Q, S, QT, ST, row), "trainscale::fp8_quantize", "argument 'x'",
                  "expected a tensor", "got none");
  TS_EXPECT_ERROR(run(TensorView(buf, DType::kFloat64, {M, N}), Q, S, QT, ST, row), "fp8_quantize",
                  "argument 'x'", "float32, float16, bfloat16", "float64");
  TS_EXPECT_ERROR(run(TensorView(buf, DType::kFloat32, {1, M, N}), Q, S, QT, ST, row),
                  "fp8_quantize", "argument 'x'", "2 dimensions", "3");
  TS_EXPECT_ERROR(run(TensorView(buf, DType::kFloat32, {M, N}, {2 * N, 2}), Q, S, QT, ST, row),
                  "fp8_quantize", "argument 'x'", "stride 1 in the last dimension");
  TS_EXPECT_ERROR(run(TensorView(buf, DType::kFloat32, {M, N}, {N / 2, 1}), Q, S, QT, ST, row),
                  "fp8_quantize", "argument 'x'", "row stride >= the row length 8");
  TS_EXPECT_ERROR(run(TensorView(buf, DType::kFloat32, {M, N}, {-N, 1}), Q, S, QT, ST, row),
                  "fp8_quantize", "argument 'x'", "non-negative strides");
  TS_EXPECT_ERROR(run(TensorView(nullptr, DType::kFloat32, {M, N}), Q, S, QT, ST, row),
                  "fp8_quantize", "argument 'x'", "non-null");
  // q
  TS_EXPECT_ERROR(run(X, {}, S, QT, ST, row), "fp8_quantize", "argument 'q'", "a tensor");
  TS_EXPECT_ERROR(run(X, TensorView(buf, DType::kFloat16, {M, N}), S, QT, ST, row),
                  "fp8_quantize", "argument 'q'", "float8_e4m3, float8_e5m2", "float16");
  TS_EXPECT_ERROR(run(X, TensorView(buf, DType::kFloat8E4M3, {M * N}), S, QT, ST, row),
                  "fp8_quantize", "argument 'q'", "2 dimensions");
  TS_EXPECT_ERROR(run(X, TensorView(buf, DType::kFloat8E4M3, {M, N - 1}), S, QT, ST, row),
                  "fp8_quantize", "argument 'q'", "shape [4, 8] (the shape of 'x')", "[4, 7]");
  TS_EXPECT_ERROR(run(X, TensorView(buf, DType::kFloat8E4M3, {M, N}, {2 * N, 2}), S, QT, ST, row),
                  "fp8_quantize", "argument 'q'", "stride 1");
  TS_EXPECT_ERROR(run(X, on_cuda(Q), S, QT, ST, row), "fp8_quantize", "argument 'q'",
                  "a tensor on cpu like 'x'", "cuda:0");
  // scales: presence, dtype, the shape of every layout, contiguity
  TS_EXPECT_ERROR(run(X, Q, {}, QT, ST, row), "fp8_quantize", "argument 'scales'", "a tensor");
  TS_EXPECT_ERROR(run(X, Q, TensorView(buf, DType::kFloat16, {M}), QT, ST, row), "fp8_quantize",
                  "argument 'scales'", "{float32}", "float16");
  TS_EXPECT_ERROR(run(X, Q, TensorView(buf, DType::kFloat32, {M - 1}), QT, ST, row),
                  "fp8_quantize", "argument 'scales'",
                  "shape [4] (row scales of a [4, 8] matrix)", "got shape [3]");
  TS_EXPECT_ERROR(run(X, Q, TensorView(buf, DType::kFloat32, {M, 1}, {2, 2}), {}, {},
                      {Fp8Granularity::kTile1x128}),
                  "fp8_quantize", "argument 'scales'", "a contiguous tensor");
  const std::pair<Fp8QuantizeOptions, const char*> wrong_shapes[] = {
      {{Fp8Granularity::kTensor}, "shape [1] (tensor scales of a [4, 8] matrix)"},
      {{Fp8Granularity::kTile1x128}, "shape [4, 1] (tile1x128 scales of a [4, 8] matrix)"},
      {{Fp8Granularity::kTile1x128, false, true}, "shape [1, 4] (tile1x128 m-major scales"},
      {{Fp8Granularity::kBlock128x128}, "shape [1, 1] (block128x128 scales"},
  };
  for (const auto& [o, expected] : wrong_shapes) {
    TS_EXPECT_ERROR(run(X, Q, TensorView(buf, DType::kFloat32, {2, 3}), {}, {}, o),
                    "fp8_quantize", "argument 'scales'", expected, "got shape [2, 3]");
  }
  // q_t / scales_t
  TS_EXPECT_ERROR(run(X, Q, S, QT, {}, row), "fp8_quantize", "argument 'scales_t'",
                  "q_t and scales_t come together", "got none");
  TS_EXPECT_ERROR(run(X, Q, S, {}, ST, row), "fp8_quantize", "argument 'q_t'",
                  "q_t and scales_t come together", "got none");
  TS_EXPECT_ERROR(run(X, Q, S, TensorView(buf, DType::kFloat32, {N, M}), ST, row), "fp8_quantize",
                  "argument 'q_t'", "float8_e4m3, float8_e5m2", "float32");
  TS_EXPECT_ERROR(run(X, Q, S, TensorView(buf, DType::kFloat8E5M2, {N, M}), ST, row),
                  "fp8_quantize", "argument 'q_t'", "float8_e4m3 (the dtype of 'q')",
                  "float8_e5m2");
  TS_EXPECT_ERROR(run(X, Q, S, TensorView(buf, DType::kFloat8E4M3, {M, N}), ST, row),
                  "fp8_quantize", "argument 'q_t'", "size 8 in dim 0 (the columns of x)",
                  "shape [4, 8]");
  TS_EXPECT_ERROR(run(X, Q, S, TensorView(buf, DType::kFloat8E4M3, {N, M - 1}), ST, row),
                  "fp8_quantize", "argument 'q_t'", "size 4 in dim 1 (the rows of x)");
  TS_EXPECT_ERROR(run(X, Q, S, TensorView(buf, DType::kFloat8E4M3, {N}), ST, row), "fp8_quantize",
                  "argument 'q_t'", "2 dimensions");
  TS_EXPECT_ERROR(run(X, Q, S, TensorView(buf, DType::kFloat8E4M3, {N, M}, {2 * M, 2}), ST, row),
                  "fp8_quantize", "argument 'q_t'", "stride 1");
  TS_EXPECT_ERROR(run(X, Q, S, QT, TensorView(buf, DType::kFloat32, {M}), row), "fp8_quantize",
                  "argument 'scales_t'", "shape [8] (row scales of a [8, 4] matrix)",
                  "got shape [4]");
  TS_EXPECT_ERROR(run(X, Q, S, QT, TensorView(buf, DType::kBFloat16, {N}), row), "fp8_quantize",
                  "argument 'scales_t'", "float32", "bfloat16");
  // Each output against the input and every earlier output.
  const TensorView views[] = {X, Q, S, QT, ST};
  const char* names[] = {"x", "q", "scales", "q_t", "scales_t"};
  for (int out = 1; out < 5; ++out) {
    for (int other = 0; other < out; ++other) {
      TensorView aliased[5] = {X, Q, S, QT, ST};
      aliased[out].data = views[other].data;
      const std::string argument = std::string("argument '") + names[out] + "'";
      const std::string disjoint = std::string("memory disjoint from '") + names[other] + "'";
      TS_EXPECT_ERROR(run(aliased[0], aliased[1], aliased[2], aliased[3], aliased[4], row),
                      "fp8_quantize", argument.c_str(), disjoint.c_str());
    }
  }
  // options
  TS_EXPECT_ERROR(run(X, Q, S, QT, ST, {static_cast<Fp8Granularity>(7)}), "fp8_quantize",
                  "argument 'options.granularity'", "one of tensor, row", "value 7");
  TS_EXPECT_ERROR(run(X, Q, S, QT, ST, {Fp8Granularity::kRow, false, true}), "fp8_quantize",
                  "argument 'options.scales_m_major'", "false unless granularity is tile1x128",
                  "true with granularity row");
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it (a CPU-only build
  // says it has no CUDA; a CUDA build without a device fails to find one).
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(run(on_cuda(X), on_cuda(Q), on_cuda(S), on_cuda(QT), on_cuda(ST), row),
                    "trainscale::fp8_quantize", "CUDA");
  }
}

TEST(Fp8Dequantize, ArgumentErrors) {
  const std::int64_t M = 4, N = 8;
  const HostTensor x = random_input(DType::kFloat32, M, N);
  const Quantized r = quantize(x, DType::kFloat8E5M2, {});
  HostTensor y(DType::kBFloat16, {M, N});
  HostTensor spare(DType::kFloat32, {64});
  void* buf = spare.data();
  const TensorView Q = r.q.view(), S = r.scales.view(), Y = y.view();
  fp8_dequantize(Q, S, Y);  // the baseline is valid

  TS_EXPECT_ERROR(fp8_dequantize({}, S, Y), "trainscale::fp8_dequantize", "argument 'q'",
                  "a tensor");
  TS_EXPECT_ERROR(fp8_dequantize(TensorView(buf, DType::kBFloat16, {M, N}), S, Y),
                  "fp8_dequantize", "argument 'q'", "float8_e4m3, float8_e5m2", "bfloat16");
  TS_EXPECT_ERROR(fp8_dequantize(TensorView(buf, DType::kFloat8E5M2, {1, M, N}), S, Y),
                  "fp8_dequantize", "argument 'q'", "2 dimensions");
  TS_EXPECT_ERROR(fp8_dequantize(TensorView(buf, DType::kFloat8E5M2, {M, N}, {2 * N, 2}), S, Y),
                  "fp8_dequantize", "argument 'q'", "stride 1");
  TS_EXPECT_ERROR(fp8_dequantize(Q, {}, Y), "fp8_dequantize", "argument 'scales'", "a tensor");
  TS_EXPECT_ERROR(fp8_dequantize(Q, TensorView(buf, DType::kFloat64, {M}), Y), "fp8_dequantize",
                  "argument 'scales'", "float32", "float64");
  TS_EXPECT_ERROR(fp8_dequantize(Q, TensorView(buf, DType::kFloat32, {N}), Y), "fp8_dequantize",
                  "argument 'scales'", "shape [4] (row scales of a [4, 8] matrix)",
                  "got shape [8]");
  TS_EXPECT_ERROR(fp8_dequantize(Q, TensorView(buf, DType::kFloat32, {M, 1}, {2, 2}), Y,
                                 {Fp8Granularity::kTile1x128}),
                  "fp8_dequantize", "argument 'scales'", "contiguous");
  TS_EXPECT_ERROR(fp8_dequantize(Q, S, {}), "fp8_dequantize", "argument 'y'", "a tensor");
  TS_EXPECT_ERROR(fp8_dequantize(Q, S, TensorView(buf, DType::kFloat8E4M3, {M, N})),
                  "fp8_dequantize", "argument 'y'", "float32, float16, bfloat16", "float8_e4m3");
  TS_EXPECT_ERROR(fp8_dequantize(Q, S, TensorView(buf, DType::kFloat32, {M * N})),
                  "fp8_dequantize", "argument 'y'", "2 dimensions");
  TS_EXPECT_ERROR(fp8_dequantize(Q, S, TensorView(buf, DType::kFloat32, {N, M})),
                  "fp8_dequantize", "argument 'y'", "shape [4, 8] (the shape of 'q')", "[8, 4]");
  TS_EXPECT_ERROR(fp8_dequantize(Q, S, TensorView(buf, DType::kFloat32, {M, N}, {2 * N, 2})),
                  "fp8_dequantize", "argument 'y'", "stride 1");
  TS_EXPECT_ERROR(fp8_dequantize(Q, S, TensorView(Q.data, DType::kFloat32, {M, N})),
                  "fp8_dequantize", "argument 'y'", "memory disjoint from 'q'");
  // A [4, 8] float view at the 16-byte scales also reaches past them, possibly into q's heap
  // block (checked first): only the argument and the kind of error are certain.
  TS_EXPECT_ERROR(fp8_dequantize(Q, S, TensorView(S.data, DType::kFloat32, {M, N})),
                  "fp8_dequantize", "argument 'y'", "memory disjoint from");
  TS_EXPECT_ERROR(fp8_dequantize(Q, S, on_cuda(Y)), "fp8_dequantize", "argument 'y'",
                  "a tensor on cpu like 'q'");
  TS_EXPECT_ERROR(fp8_dequantize(Q, S, Y, {static_cast<Fp8Granularity>(-1)}), "fp8_dequantize",
                  "argument 'options.granularity'", "value -1");
  TS_EXPECT_ERROR(fp8_dequantize(Q, S, Y, {Fp8Granularity::kBlock128x128, false, true}),
                  "fp8_dequantize", "argument 'options.scales_m_major'", "block128x128");
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(fp8_dequantize(on_cuda(Q), on_cuda(S), on_cuda(Y)),
                    "trainscale::fp8_dequantize", "CUDA");
  }
}

}  // namespace
}  // namespace trainscale
