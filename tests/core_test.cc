#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "core/check.h"
#include "core/host_dtype.h"
#include "core/parallel.h"
#include "util/test_util.h"

namespace trainscale {
namespace {

using namespace detail;

std::uint16_t float_bits_to_bf16_truncate_rne(float f) {
  // Independent RNE from the float's bits (valid for finite, non-overflowing inputs).
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  const std::uint32_t lsb = (u >> 16) & 1;
  return static_cast<std::uint16_t>((u + 0x7FFF + lsb) >> 16);
}

TEST(HostDType, BFloat16MatchesBitRoundingOnRandomFloats) {
  std::uniform_real_distribution<float> dist(-1e6f, 1e6f);
  for (int i = 0; i < 100000; ++i) {
    const float f = dist(test::rng());
    // The general codec (not double_to_bf16, whose fast path is this same bit trick).
    ASSERT_EQ(BFloat16Format::encode(f, Overflow::kToInfinity), float_bits_to_bf16_truncate_rne(f)) << f;
    const double back = bf16_to_double(double_to_bf16(f));
    ASSERT_LE(std::fabs(back - f), std::fabs(f) * std::ldexp(1.0, -8));
  }
}

TEST(HostDType, Float16KnownValues) {
  EXPECT_EQ(double_to_half(1.0), 0x3C00);
  EXPECT_EQ(double_to_half(-2.0), 0xC000);
  EXPECT_EQ(double_to_half(65504.0), 0x7BFF);
  EXPECT_EQ(double_to_half(65519.0), 0x7BFF);  // rounds down to max
  EXPECT_EQ(double_to_half(65520.0), 0x7C00);  // tie to even overflows to inf
  EXPECT_EQ(double_to_half(std::ldexp(1.0, -24)), 0x0001);        // smallest subnormal
  EXPECT_EQ(double_to_half(std::ldexp(1.0, -25)), 0x0000);        // tie to even: 0
  EXPECT_EQ(double_to_half(std::ldexp(1.5, -25)), 0x0001);        // above the tie
  EXPECT_EQ(double_to_half(std::ldexp(3.0, -25)), 0x0002);        // 1.5 ulp ties to even 2
  EXPECT_EQ(double_to_half(1.0 + std::ldexp(1.0, -11)), 0x3C00);  // tie: even mantissa
  EXPECT_EQ(double_to_half(1.0 + std::ldexp(3.0, -11)), 0x3C02);
  EXPECT_EQ(double_to_half(-0.0), 0x8000);
  EXPECT_TRUE(std::isnan(half_to_double(double_to_half(NAN))));
  EXPECT_EQ(half_to_double(0x0001), std::ldexp(1.0, -24));
  EXPECT_EQ(half_to_double(0x7C00), INFINITY);
}

TEST(HostDType, Float8E4M3ExactValues) {
  EXPECT_EQ(double_to_e4m3(448.0), 0x7E);
  EXPECT_EQ(double_to_e4m3(464.0), 0x7E);    // tie between 448 and 480 -> even (448)
  EXPECT_EQ(double_to_e4m3(1e9), 0x7E);      // saturates
  EXPECT_EQ(double_to_e4m3(-1e9), 0xFE);
  EXPECT_EQ(double_to_e4m3(INFINITY), 0x7E);
  EXPECT_EQ(double_to_e4m3(NAN) & 0x7F, 0x7F);
  EXPECT_EQ(double_to_e4m3(std::ldexp(1.0, -9)), 0x01);   // smallest subnormal
  EXPECT_EQ(double_to_e4m3(std::ldexp(1.0, -10)), 0x00);  // tie to zero
  EXPECT_EQ(double_to_e4m3(std::ldexp(3.0, -10)), 0x02);  // tie to even
  EXPECT_EQ(double_to_e4m3(std::ldexp(7.5, -9)), 0x08);   // rounds up into the first normal
  EXPECT_EQ(double_to_e4m3(1.0), 0x38);
  EXPECT_EQ(double_to_e4m3(1.0625), 0x38);  // tie -> even
  EXPECT_EQ(double_to_e4m3(1.1875), 0x3A);  // tie -> even (1.25)
  EXPECT_EQ(e4m3_to_double(0x7E), 448.0);
  EXPECT_TRUE(std::isnan(e4m3_to_double(0x7F)));
  EXPECT_EQ(e4m3_to_double(0x01), std::ldexp(1.0, -9));
  for (int b = 0; b < 256; ++b) {
    const double v = e4m3_to_double(static_cast<std::uint8_t>(b));
    if (!std::isnan(v)) {
      EXPECT_EQ(double_to_e4m3(v), b == 0x80 ? 0x80 : b) << b;  // every code round-trips
    }
  }
}

TEST(HostDType, Float8E5M2ExactValues) {
  EXPECT_EQ(double_to_e5m2(57344.0), 0x7B);
  EXPECT_EQ(double_to_e5m2(1e9), 0x7B);
  EXPECT_EQ(double_to_e5m2(INFINITY), 0x7B);
  EXPECT_EQ(double_to_e5m2(std::ldexp(1.0, -16)), 0x01);
  EXPECT_EQ(double_to_e5m2(1.0), 0x3C);
  EXPECT_EQ(e5m2_to_double(0x7C), INFINITY);
  EXPECT_TRUE(std::isnan(e5m2_to_double(double_to_e5m2(NAN))));
  for (int b = 0; b < 256; ++b) {
    const double v = e5m2_to_double(static_cast<std::uint8_t>(b));
    if (std::isfinite(v)) {
      EXPECT_EQ(double_to_e5m2(v), b) << b;
    }
  }
}

TEST(TensorView, ShapesStridesAndContiguity) {
  float buf[24];
  TensorView t(buf, DType::kFloat32, {2, 3, 4});
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.stride(0), 12);
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_TRUE(t.is_contiguous());
  TensorView s(buf, DType::kFloat32, {2, 3}, {8, 1});
  EXPECT_FALSE(s.is_contiguous());
  // An empty tensor is contiguous whatever its strides, as PyTorch allocates [1, 2, 0] with
  // strides [2, 1, 1].
  EXPECT_TRUE(TensorView(buf, DType::kFloat32, {1, 2, 0}, {2, 1, 1}).is_contiguous());
  EXPECT_FALSE(TensorView(buf, DType::kFloat32, {1, 2, 1}, {2, 2, 1}).is_contiguous());
  EXPECT_EQ(s.describe(), "float32[2, 3] (strides [8, 1]) on cpu");
  EXPECT_FALSE(TensorView().defined());
  TS_EXPECT_ERROR((TensorView(buf, DType::kFloat32, {1, 2, 3, 4, 5, 6, 7})), "at most 6");
  TS_EXPECT_ERROR((TensorView(buf, DType::kFloat32, {2, 3}, {1})), "strides");
}

TEST(OpChecker, RowsFlattensLeadingDims) {
  float buf[64];
  OpChecker c("op");
  auto r = c.rows(TensorView(buf, DType::kFloat32, {2, 3, 4}, {30, 10, 1}), "x");
  EXPECT_EQ(r.rows, 6);
  EXPECT_EQ(r.cols, 4);
  EXPECT_EQ(r.row_stride, 10);
  TS_EXPECT_ERROR(c.rows(TensorView(buf, DType::kFloat32, {2, 3, 4}, {40, 10, 1}), "x"),
                  "trainscale::op", "'x'", "evenly strided rows");
  TS_EXPECT_ERROR(c.rows(TensorView(buf, DType::kFloat32, {2, 4}, {1, 2}), "x"),
                  "stride 1 in the last dimension");
  // An empty tensor (an autograd gradient of no rows may be an expand, strides [0, 0]) has no
  // layout to check: rows of their own length.
  r = c.rows(TensorView(buf, DType::kFloat32, {0, 4}, {0, 0}), "x");
  EXPECT_EQ(r.rows, 0);
  EXPECT_EQ(r.row_stride, 4);
  c.unit_last_stride(TensorView(buf, DType::kFloat32, {2, 0, 4}, {0, 0, 0}), "x");
}

TEST(OpChecker, ErrorsNameOpArgumentExpectedAndGot) {
  float buf[16];
  TensorView x(buf, DType::kFloat32, {4, 4});
  TS_EXPECT_ERROR(OpChecker("myop").present(TensorView(), "w"), "trainscale::myop",
                  "argument 'w'", "expected a tensor", "got none");
  TS_EXPECT_ERROR(OpChecker("myop").present(TensorView(nullptr, DType::kFloat32, {2}), "w"),
                  "non-null", "null");
  TS_EXPECT_ERROR(OpChecker("myop").dtype_in(x, "x", {DType::kBFloat16}), "bfloat16",
                  "got float32");
  TensorView cuda_x = x;
  cuda_x.device = Device::cuda(0);
  TS_EXPECT_ERROR(OpChecker("myop").present(x, "x").present(cuda_x, "y"), "argument 'y'",
                  "on cpu like 'x'", "cuda:0");
  TS_EXPECT_ERROR(OpChecker("myop").no_overlap(TensorView(buf, DType::kFloat32, {8}), "out",
                                               TensorView(buf + 4, DType::kFloat32, {8}), "x"),
                  "disjoint from 'x'");
  OpChecker("myop").no_overlap(TensorView(buf, DType::kFloat32, {8}), "out",
                               TensorView(buf + 8, DType::kFloat32, {8}), "x");
  TensorView neg(buf, DType::kFloat32, {-1});
  TS_EXPECT_ERROR(OpChecker("myop").present(neg, "x"), "non-negative sizes");
  TensorView f64(buf, DType::kFloat64, {2}, Device::cuda(0));
  TS_EXPECT_ERROR(OpChecker("myop").present(f64, "x"), "float64");
}

TEST(OpChecker, RowLayoutIsWhatRowsAccepted) {
  float buf[64];
  for (const TensorView& t : {TensorView(buf, DType::kFloat32, {2, 3, 4}, {30, 10, 1}),
                              TensorView(buf, DType::kFloat32, {1, 1, 5}, {7, 9, 1}),
                              TensorView(buf, DType::kFloat32, {3, 1, 4}, {8, 99, 1}),
                              TensorView(buf, DType::kFloat32, {6}),
                              TensorView(buf, DType::kFloat32, {0, 4}, {0, 0}),
                              TensorView(buf, DType::kFloat32, {3, 0}, {0, 0})}) {
    const Rows checked = OpChecker("op").rows(t, "x"), layout = row_layout(t);
    EXPECT_EQ(layout.rows, checked.rows) << t.describe();
    EXPECT_EQ(layout.cols, checked.cols) << t.describe();
    EXPECT_EQ(layout.row_stride, checked.row_stride) << t.describe();
  }
}

TEST(OpChecker, LikeChecksDtypeShapeDeviceAndRows) {
  float buf[64];
  const TensorView x(buf, DType::kFloat32, {4, 8});
  OpChecker("op").like(TensorView(buf + 32, DType::kFloat32, {4, 8}, {16, 1}), "y", x, "x");
  TS_EXPECT_ERROR(OpChecker("op").like(TensorView(), "y", x, "x"), "argument 'y'", "none");
  TS_EXPECT_ERROR(OpChecker("op").like(TensorView(buf, DType::kFloat16, {4, 8}), "y", x, "x"),
                  "argument 'y'", "float32 (the dtype of 'x')", "float16");
  TS_EXPECT_ERROR(OpChecker("op").like(TensorView(buf, DType::kFloat32, {8, 4}), "y", x, "x"),
                  "argument 'y'", "shape [4, 8] (the shape of 'x')", "[8, 4]");
  TS_EXPECT_ERROR(OpChecker("op").like(TensorView(buf, DType::kFloat32, {4, 8}, {1, 4}), "y", x, "x"),
                  "argument 'y'", "stride 1 in the last dimension");
  TensorView cuda_y = x;
  cuda_y.device = Device::cuda(0);
  TS_EXPECT_ERROR(OpChecker("op").present(x, "x").like(cuda_y, "y", x, "x"), "argument 'y'",
                  "on cpu like 'x'");
  // matches() leaves the layout free.
  OpChecker("op").matches(TensorView(buf, DType::kFloat32, {4, 8}, {1, 4}), "y", x, "x");
}

TEST(OpChecker, Float32OrDtypeOf) {
  float buf[4];
  const TensorView bf16(buf, DType::kBFloat16, {2}), f32(buf, DType::kFloat32, {2}),
      f16(buf, DType::kFloat16, {2});
  OpChecker("op").float32_or_dtype_of(f32, "w", bf16, "x").float32_or_dtype_of(bf16, "w", bf16, "x");
  TS_EXPECT_ERROR(OpChecker("op").float32_or_dtype_of(f16, "w", bf16, "x"), "argument 'w'",
                  "float32 or bfloat16 (the dtype of 'x')", "got float16");
  TS_EXPECT_ERROR(OpChecker("op").float32_or_dtype_of(f16, "w", f32, "x"),
                  "expected float32 (the dtype of 'x')");
}

TEST(OpChecker, DisjointHasOneMeaningPerMode) {
  float buf[64];
  const TensorView x(buf, DType::kFloat32, {8});
  OpChecker("op").disjoint_or_in_place(x, "y", x, "x");
  OpChecker("op").disjoint_or_in_place(TensorView(buf + 8, DType::kFloat32, {8}), "y", x, "x");
  OpChecker("op").disjoint_or_in_place(TensorView(), "y", x, "x");
  TS_EXPECT_ERROR(
      OpChecker("op").disjoint_or_in_place(TensorView(buf + 1, DType::kFloat32, {8}), "y", x, "x"),
      "argument 'y'", "disjoint from 'x' or exactly its view (in place)", "partially overlapping");
  // Heads 0-1 and 2-3 of one [2, 4, 4] buffer: interleaved byte ranges, no shared element.
  const TensorView q(buf, DType::kFloat32, {2, 2, 4}, {16, 4, 1});
  const TensorView k(buf + 8, DType::kFloat32, {2, 2, 4}, {16, 4, 1});
  OpChecker("op").no_overlap(q, "q", k, "k", Disjoint::kElements);
  TS_EXPECT_ERROR(OpChecker("op").no_overlap(q, "q", k, "k"), "argument 'q'",
                  "memory disjoint from 'k'", "overlapping views");
  const TensorView shifted(buf + 4, DType::kFloat32, {2, 2, 4}, {16, 4, 1});
  TS_EXPECT_ERROR(OpChecker("op").no_overlap(q, "q", shifted, "k", Disjoint::kElements),
                  "memory disjoint from 'k'");
}

TEST(OpChecker, OutputsDisjointNamesTheLaterOutputAndAllowsOneInPlacePair) {
  float buf[64];
  const TensorView dy(buf, DType::kFloat32, {8}), x(buf + 8, DType::kFloat32, {8});
  const TensorView dw(buf + 16, DType::kFloat32, {8}), absent;
  OpChecker("op").outputs_disjoint({{dy, "dx"}, {dw, "dw"}, {absent, "workspace"}},
                                   {{dy, "dy"}, {x, "x"}}, "dx", "dy");
  TS_EXPECT_ERROR(OpChecker("op").outputs_disjoint({{dy, "dx"}}, {{dy, "dy"}}),
                  "argument 'dx'", "memory disjoint from 'dy'", "overlapping views");
  const TensorView x_over_dy(buf + 4, DType::kFloat32, {8});
  TS_EXPECT_ERROR(OpChecker("op").outputs_disjoint({{dy, "dx"}, {dw, "dw"}}, {{x_over_dy, "x"}}, "dx", "x"),
                  "argument 'dx'", "disjoint from 'x' or exactly its view", "partially");
  TS_EXPECT_ERROR(OpChecker("op").outputs_disjoint({{dw, "dw"}, {dw, "db"}}, {{x, "x"}}),
                  "argument 'db'", "memory disjoint from 'dw'");
}

// Reads may share memory with each other; an update may share none with anything. Extents nested
// in a long earlier one, a read between two updates and the same address for a read and an
// update (reported against the update) are the cases a check of neighbours alone would miss.
TEST(OpChecker, UpdatesDisjointBySortedExtents) {
  float buf[64];
  const TensorView a(buf, DType::kFloat32, {8}), b(buf + 8, DType::kFloat32, {8}), c(buf + 16, DType::kFloat32, {8});
  const TensorView whole(buf, DType::kFloat32, {32}), inside(buf + 20, DType::kFloat32, {2}), absent;
  const Arg ab[] = {{a, "a"}, {b, "b"}}, c_twice[] = {{c, "c1"}, {c, "c2"}}, none[] = {{absent, "w"}};
  OpChecker("op").updates_disjoint(ab, c_twice);  // two reads of one tensor
  OpChecker("op").updates_disjoint(none, ab);
  const Arg whole_read[] = {{whole, "x"}}, inside_read[] = {{inside, "y"}};
  TS_EXPECT_ERROR(OpChecker("op").updates_disjoint(ab, whole_read), "argument 'a'",
                  "memory disjoint from 'x' (updated while the other is read)", "overlapping views");
  const Arg a_whole[] = {{a, "a"}, {whole, "w"}};
  TS_EXPECT_ERROR(OpChecker("op").updates_disjoint(a_whole, {}), "argument 'w'", "disjoint from 'a'",
                  "(updated while the other is updated)");
  const Arg whole_written[] = {{whole, "w"}};
  TS_EXPECT_ERROR(OpChecker("op").updates_disjoint(whole_written, inside_read), "argument 'y'",
                  "disjoint from 'w' (read while the other is updated)");
  const TensorView bc(buf + 12, DType::kFloat32, {8});
  const Arg a_c[] = {{a, "a"}, {c, "c"}}, b_read[] = {{b, "b"}}, b_and_c[] = {{bc, "bc"}};
  OpChecker("op").updates_disjoint(a_c, b_read);
  TS_EXPECT_ERROR(OpChecker("op").updates_disjoint(a_c, b_and_c), "argument 'c'", "disjoint from 'bc'");
}

TEST(OpChecker, DistinctElements) {
  float buf[64];
  OpChecker("op").distinct_elements(TensorView(buf, DType::kFloat32, {2, 3, 4}, {12, 4, 1}), "out");
  OpChecker("op").distinct_elements(TensorView(buf, DType::kFloat32, {2, 0, 4}, {0, 0, 1}), "out");
  TS_EXPECT_ERROR(
      OpChecker("op").distinct_elements(TensorView(buf, DType::kFloat32, {2, 3, 4}, {12, 2, 1}), "out"),
      "argument 'out'", "no two elements share memory", "strides [12, 2, 1]");
}

TEST(Parallel, ChunksCoverRangeOnceAndPropagateExceptions) {
  std::vector<int> hits(1000, 0);
  parallel_for(1000, 7, [&](std::int64_t lo, std::int64_t hi) {
    for (auto i = lo; i < hi; ++i) hits[i]++;
  });
  for (int h : hits) ASSERT_EQ(h, 1);
  EXPECT_THROW(parallel_for(100, 1, [](std::int64_t lo, std::int64_t) {
                 if (lo == 50) throw Error("boom");
               }),
               Error);
}

}  // namespace
}  // namespace trainscale

namespace trainscale {
namespace {

TEST(HostDType, FastPathsAgreeWithTheGeneralCodec) {
  using detail::BFloat16Format;
  using detail::Float16Format;
  for (std::uint32_t b = 0; b < (1u << 16); ++b) {
    const double general = Float16Format::decode(b);
    const double fast = detail::half_to_double(static_cast<std::uint16_t>(b));
    ASSERT_TRUE(fast == general || (std::isnan(fast) && std::isnan(general))) << b;
    const double bgeneral = BFloat16Format::decode(b);
    const double bfast = detail::bf16_to_double(static_cast<std::uint16_t>(b));
    ASSERT_TRUE(bfast == bgeneral || (std::isnan(bfast) && std::isnan(bgeneral))) << b;
  }
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    const std::uint32_t u = bits(test::rng());
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isnan(f)) continue;
    ASSERT_EQ(detail::double_to_bf16(f),
              BFloat16Format::encode(f, detail::Overflow::kToInfinity))
        << f;
  }
  EXPECT_EQ(detail::double_to_bf16(3.3895313892515355e38), 0x7F7F);  // largest bf16
  EXPECT_EQ(detail::double_to_bf16(3.4028234663852886e38), 0x7F80);  // FLT_MAX rounds to inf
}

// Every entry point's OpChecker opens and closes an NVTX range. Without a profiler attached that
// must cost nothing next to a kernel launch (a few microseconds): well under 0.2 us a pair.
TEST(OpChecker, ProfilerRangeCostsNothingWithoutAProfiler) {
  constexpr int kCalls = 200000;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kCalls; ++i) {
    detail::OpChecker c("rmsnorm_forward");
    ASSERT_EQ(c.op()[0], 'r');
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / kCalls;
  std::printf("OpChecker with its NVTX range: %.1f ns per entry point\n", ns);
  EXPECT_LT(ns, 200.0);
}

}  // namespace
}  // namespace trainscale
